"""RL weight updates and sleep in process (offline LLM API, tiny Llama, float32): an updated engine
equals transformers and a fresh engine on the new checkpoint (tokens, prompt log-probabilities,
model fingerprint); partial tensor updates without a flush never hit blocks of the old weights;
sleep level 2 after a tensor update restores from a host copy; refusals name what is wrong and
change nothing; every tier flush is published as AllBlocksCleared."""
from __future__ import annotations

import json
import random

import pytest
import torch

from tests.rl_checkpoints import Reference, perturbed_copy
from tests.test_kv_events import EVENTS, RawSubscriber
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.kv_events import AllBlocksCleared
from tokenmill.rl import WeightUpdateError
from tokenmill.rl.checkpoint import check_tensor_specs
from tokenmill.rl.engine_ops import EngineAsleepError

GREEDY = SamplingParams(temperature=0, max_tokens=8)
GIB = 1024**3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_offline")
    base = make_tiny_model("llama", root / "base")
    wider = perturbed_copy(base, root / "wider", seed=6)  # another config: refused before any tensor is read
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    return {"root": root, "base": base, "new": perturbed_copy(base, root / "new", seed=5), "wider": wider}


def make_llm(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=1, block_size=4, num_kv_blocks=64, max_model_len=128,
               **kwargs)


def prompt(seed: int, length: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def test_updated_engine_equals_transformers_and_a_fresh_engine_on_the_new_weights(ckpts, tmp_path):
    p = prompt(1)
    with make_llm(ckpts["base"], kv_offload_memory=16 * 2048 / GIB, kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        first = llm.generate([p], GREEDY)[0]
        assert llm.generate([p], GREEDY)[0].num_cached_tokens == 20
        old_info = llm.weight_info()
        info = llm.update_weights_from_disk(str(ckpts["new"]), weight_version="v1")
        assert info["weight_version"] == "v1" and info["num_updates"] == 1 and info["model_path"] == str(ckpts["new"])
        assert llm.generate([p], GREEDY)[0].num_cached_tokens == 0  # cached before the update: never hit
        after = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0))[0]
        new_info = llm.weight_info()
        assert new_info["fingerprint"] != old_info["fingerprint"]
        # one key for every consumer: the disk tier's directory, sessions / KV transfer, weight_info
        engine = llm.engine
        assert engine.fingerprints()[0] == new_info["fingerprint"] == engine.kv_store.disk.fingerprint.hex()
    ref = Reference(ckpts["new"])
    assert after.outputs[0].token_ids == ref.greedy(p, 8) != first.outputs[0].token_ids
    got = [next(iter(e.values())).logprob for e in after.prompt_logprobs[1:]]
    assert got == pytest.approx(ref.prompt_logprobs(p), abs=2e-4)
    with make_llm(ckpts["new"], kv_offload_disk_path=str(tmp_path / "kv2")) as fresh:
        assert fresh.engine.rl_state.fingerprint == new_info["fingerprint"]  # from the disk tier's start: no 2nd pass
        assert fresh.weight_info()["fingerprint"] == new_info["fingerprint"]
        assert fresh.generate([p], GREEDY)[0].outputs[0].token_ids == after.outputs[0].token_ids


def kv_pool_resident_bytes(kv_cache: torch.Tensor) -> int:
    """Memory the KV pool holds: its storage's bytes, or for a pool of its own mapping (tokenmill.runner.
    huge_pages: released in place by sleep) the resident bytes Linux reports for that mapping."""
    import re
    from pathlib import Path

    from tokenmill.huge_pages import is_mapped

    if not is_mapped(kv_cache):
        return kv_cache.untyped_storage().nbytes()
    ptr, inside = kv_cache.untyped_storage().data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= ptr < int(head.group(2), 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("the KV pool's mapping is missing from /proc/self/smaps")


def test_partial_tensor_update_without_flush_and_sleep_level_2_from_a_host_copy(ckpts):
    p, q = prompt(2), prompt(3)
    with make_llm(ckpts["base"], kv_offload_memory=16 * 2048 / GIB) as llm:
        llm.generate([p], GREEDY)
        norm = llm.engine.loaded.model.model.norm.weight.detach().clone()
        info = llm.update_weights_from_tensor({"model.norm.weight": norm * 1.5}, flush_cache=False)
        assert info["weight_version"] == "1" and info["weight_epoch"] == 1 and info["model_path"] is None
        assert torch.equal(llm.engine.loaded.model.model.norm.weight, norm * 1.5)
        assert llm.generate([p], GREEDY)[0].num_cached_tokens == 0  # cached before the update: never hit
        assert llm.generate([p], GREEDY)[0].num_cached_tokens == 20  # cached with the new weights
        before = [o.outputs[0].token_ids for o in llm.generate([p, q], GREEDY)]
        llm.sleep(2)
        assert llm.is_sleeping() and kv_pool_resident_bytes(llm.engine.runner.kv_cache) == 0
        assert llm.engine.loaded.model.model.norm.weight.numel() == 0
        with pytest.raises(EngineAsleepError):
            llm.generate([p], GREEDY)
        with pytest.raises(WeightUpdateError, match="freed"):
            llm.update_weights_from_tensor({"model.norm.weight": norm})
        llm.wake_up()
        assert not llm.is_sleeping()
        assert [o.outputs[0].token_ids for o in llm.generate([p, q], GREEDY)] == before
        llm.sleep(1)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate([p, q], GREEDY)] == before


def test_refusals_name_what_is_wrong_and_change_nothing(ckpts):
    with make_llm(ckpts["base"]) as llm:
        p = prompt(4)
        expected = llm.generate([p], GREEDY)[0].outputs[0].token_ids
        with pytest.raises(WeightUpdateError, match="hidden_size: served 64, new 96"):
            llm.update_weights_from_disk(str(ckpts["wider"]))
        with pytest.raises(WeightUpdateError, match="does not exist"):
            llm.update_weights_from_disk(str(ckpts["root"] / "nowhere"))
        with pytest.raises(WeightUpdateError, match=r"model.norm.weight is int64"):
            llm.update_weights_from_tensor({"model.norm.weight": torch.ones(64, dtype=torch.int64)})
        with pytest.raises(WeightUpdateError, match=r"does not have \(model.layers.9.mlp.up_proj.weight\)"):
            llm.update_weights_from_tensor([("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64)),
                                            ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
        with pytest.raises(WeightUpdateError, match="given twice"):
            llm.update_weights_from_tensor([("model.norm.weight", torch.ones(64))] * 2)
        with pytest.raises(WeightUpdateError, match="not a \\(name, tensor\\) pair"):
            llm.update_weights_from_tensor([("model.norm.weight", [1.0])])
        assert llm.weight_info()["num_updates"] == 0
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == expected
    targets = llm.engine.rl_state.targets
    assert targets["model.layers.0.self_attn.k_proj.weight"].start == 64  # k rows after q's in qkv_proj
    with pytest.raises(WeightUpdateError, match="20 tensors missing"):
        check_tensor_specs(targets, [("model.norm.weight", (64,), torch.float32)], False, partial=False)


def test_flushes_publish_all_blocks_cleared_for_every_tier(ckpts, tmp_path):
    with make_llm(ckpts["base"], kv_events_config=EVENTS, kv_offload_memory=16 * 2048 / GIB,
                  kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        publisher = llm.engine.kv_events
        sub = RawSubscriber(publisher.endpoint)
        try:
            sub.ready(publisher)
            llm.generate([prompt(5)], GREEDY)
            llm.reset_prefix_cache()
            sub.receive()
            cleared = {e.medium for e in sub.events() if isinstance(e, AllBlocksCleared)}
            assert {"pool", "ram", "disk"} <= cleared
            sub.batches.clear()
            llm.update_weights_from_disk(str(ckpts["new"]))
            sub.receive()
            cleared = {e.medium for e in sub.events() if isinstance(e, AllBlocksCleared)}
            assert {"pool", "ram", "disk"} <= cleared
        finally:
            sub.close()


def test_quantized_model_refuses_updates_and_still_sleeps_and_wakes(ckpts):
    with make_llm(ckpts["base"], quantization="int8") as llm:
        p = prompt(6)
        expected = llm.generate([p], GREEDY)[0].outputs[0].token_ids
        with pytest.raises(WeightUpdateError, match="--quantization none"):
            llm.update_weights_from_disk(str(ckpts["new"]))
        with pytest.raises(WeightUpdateError, match="quantized weights"):
            llm.update_weights_from_tensor({"model.norm.weight": torch.ones(64)})
        llm.sleep(2)
        llm.wake_up()
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == expected


def test_update_while_asleep_at_level_2_fills_the_freed_weights(ckpts):
    p = prompt(7)
    expected = Reference(ckpts["new"]).greedy(p, 8)
    with make_llm(ckpts["base"]) as llm:
        llm.sleep(2)
        info = llm.update_weights_from_disk(str(ckpts["new"]), weight_version="v2")
        assert info["is_sleeping"] and info["weight_version"] == "v2"
        llm.wake_up()
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == expected
