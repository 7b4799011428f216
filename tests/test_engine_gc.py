"""The engine moves its start-up objects out of the garbage collector's generations (gc.freeze), so full
collections during decode steps do not scan them; a closed engine, or one dropped before the next is
built, is still collected."""
from __future__ import annotations

import gc
import weakref

from tokenmill import LLM, SamplingParams


def test_start_up_heap_is_frozen_and_engines_are_still_collected():
    llm = LLM(model=None, num_kv_blocks=64, max_model_len=256)
    assert gc.get_freeze_count() > 10_000  # modules, weights' wrappers, tokenizer tables
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    closed = weakref.ref(llm.engine)
    llm.close()
    del llm, out
    gc.collect()
    assert closed() is None, "a closed engine stays frozen"
    assert gc.get_freeze_count() == 0
    dropped = LLM(model=None, num_kv_blocks=64, max_model_len=256)
    ref = weakref.ref(dropped.engine)
    del dropped  # not closed: the next engine's start-up unfreezes and collects it
    successor = LLM(model=None, num_kv_blocks=64, max_model_len=256)
    assert ref() is None, "an engine dropped before the next one was built stays in memory"
    last = weakref.ref(successor.engine)
    del successor  # neither closed nor followed by another engine: freeing the LLM unfreezes the heap
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert last() is None
