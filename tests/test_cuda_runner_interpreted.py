"""The CUDA runner end to end on CPU with the Triton kernels under triton's interpreter.

Exercises exactly the code a GPU runs minus pinned memory, graph capture and memory profiling:
one-copy staging of device-side metadata (no per-prefill objects), the Triton attention dispatch,
padded decode over static buffers, and sampling with one host transfer; its tokens must equal the
CPU ModelRunner's. TRITON_INTERPRET=1 must be set before triton is imported (as in
test_triton_attention.py); if triton was imported earlier in this process, the test reruns this
file in a fresh interpreter. Skipped on a CUDA machine, where the real kernels are tested.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; process-wide, harmless on CPU

triton_language = pytest.importorskip("triton.language")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.triton_interpreter import rerun_in_interpreter  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.runner.cuda_runner import CudaModelRunner  # noqa: E402

INTERPRETED = isinstance(triton_language.cdiv, InterpretedFunction)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled kernels are tested")


@pytest.mark.skipif(INTERPRETED, reason="the test runs in this process")
def test_in_fresh_interpreter():
    rerun_in_interpreter(__file__, timeout=900)


@pytest.mark.skipif(not INTERPRETED, reason="triton imported before TRITON_INTERPRET=1: see test_in_fresh_interpreter")
def test_triton_cuda_runner_matches_the_cpu_runner(tmp_path):
    path = make_tiny_model("qwen3", tmp_path / "qwen3", max_position_embeddings=64)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]} for n in (3, 21, 9, 40, 14)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=1 if m == 4 else None) for m in (6, 3, 5, 4, 6)]
    kwargs = dict(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=8,
                  max_num_batched_tokens=32, max_num_seqs=8)
    want = LLM(**kwargs).generate(prompts, params)

    llm = LLM(**kwargs)
    engine = llm.engine
    runner = CudaModelRunner(engine.loaded, engine.config.cache, engine.scheduler_config)  # triton backend
    engine.runner = runner
    got = llm.generate(prompts, params)

    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.num_padded_decode_steps > 0 and runner.num_general_steps > 0
    lp_got, lp_want = got[3].outputs[0].logprobs, want[3].outputs[0].logprobs
    assert [p.keys() for p in lp_got] == [p.keys() for p in lp_want]
    engine.check_integrity()
