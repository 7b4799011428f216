"""Session save/restore (tokenmill/kv_transfer/): a conversation's KV blocks saved to files, the server
restarted, the blocks restored into the prefix cache, and the next round equal to an uninterrupted run
with only its new tokens prefilled; blocks from another model, tokenizer, dtype or block size, or with
corrupt bytes, refused before the pool changes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.kv_transfer.blocks import KVBlocksError
from tokenmill.kv_transfer.session import read_session, session_dir, write_session

BLOCK_SIZE = 16
SERVER_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE),
               "--disable-log-requests"]
HISTORY = [{"role": "system", "content": "You are a patient assistant who answers in full sentences. " * 3},
           {"role": "user", "content": "Tell me about rivers, mountains and the sea, please."}]
NEXT_TURN = {"role": "user", "content": "And what about lakes?"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_sessions")))


def make_llm(model: str, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "num_threads": 1, "block_size": BLOCK_SIZE, "num_kv_blocks": 48, **kwargs}
    return LLM(model, **kwargs)


def cached_hashes(llm: LLM) -> set[int]:
    return set(llm.engine.kv_cache_manager.block_pool.cached_block_hash_to_block)


def chat(server: ServerProcess, model: str, messages: list[dict]) -> dict:
    response = server.post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 12,
                                                     "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_offline_export_import_between_engines_and_refusals(tiny, tmp_path):
    other = str(make_tiny_model("llama", tmp_path / "other", seed=1234))
    prompt = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
    with make_llm(tiny) as source:
        want = source.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0))[0]
        meta, blocks, state = source.engine.block_io.export_blocks(prompt)
    assert state == {} and meta.format_version == 1 and meta.state_blocks == []
    assert meta.token_ids == prompt[:48] and len(meta.block_hashes) == 3
    write_session(tmp_path / "sessions", "s1", meta, blocks)
    meta, blocks, state = read_session(tmp_path / "sessions", "s1")
    assert state == {}

    with make_llm(tiny) as target:
        before = cached_hashes(target)
        result = target.engine.block_io.import_blocks(meta, blocks)
        assert result == {"num_blocks": 3, "num_imported": 3, "num_already_cached": 0, "num_tokens": 48,
                          "num_state_checkpoints": 0}
        assert target.engine.block_io.import_blocks(meta, blocks)["num_already_cached"] == 3  # idempotent
        assert len(cached_hashes(target) - before) == 3
        target.engine.check_integrity()
        got = target.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0))[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == 48  # only the 2 tokens after the restored blocks were prefilled

    refusals = [
        (make_llm(other), "model_fingerprint"),  # same shapes, other weights
        (make_llm(tiny, block_size=32), "block_size"),
        (make_llm(tiny, dtype="bfloat16"), "kv_dtype"),
    ]
    for llm, param in refusals:
        with llm:
            before = cached_hashes(llm)
            free = llm.engine.kv_cache_manager.block_pool.num_free_blocks
            with pytest.raises(KVBlocksError) as info:
                llm.engine.block_io.import_blocks(meta, blocks)
            assert info.value.param == param and info.value.status_code == 400, (param, info.value)
            assert cached_hashes(llm) == before and llm.engine.kv_cache_manager.block_pool.num_free_blocks == free

    with make_llm(tiny) as target:
        corrupt = blocks.clone()
        corrupt.view(-1)[7] += 1.0
        with pytest.raises(KVBlocksError, match="checksum") as info:
            target.engine.block_io.import_blocks(meta, corrupt)
        assert info.value.param == "sha256"
        tampered = json.loads(meta.to_json())
        tampered["token_ids"][3] += 1  # the hashes no longer follow from the tokens
        with pytest.raises(KVBlocksError) as info:
            target.engine.block_io.import_blocks(type(meta)(**tampered), blocks)
        assert info.value.param == "block_hashes"
        assert not cached_hashes(target)

    long_prompt = list(range(500, 581))
    with make_llm(tiny) as source:
        source.generate({"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=1))
        meta5, blocks5, _ = source.engine.block_io.export_blocks(long_prompt)
    with make_llm(tiny, num_kv_blocks=4) as small:  # 5 blocks do not fit in 4: refused, nothing changes
        with pytest.raises(KVBlocksError) as info:
            small.engine.block_io.import_blocks(meta5, blocks5)
        assert info.value.status_code == 507 and not cached_hashes(small)
        small.engine.check_integrity()

    with pytest.raises(KVBlocksError) as info:
        session_dir(tmp_path, "../escape")
    assert info.value.param == "session_id"


def test_server_save_restart_restore_continues_with_only_new_tokens(tiny, tmp_path):
    sessions = tmp_path / "sessions"
    args = [*SERVER_ARGS, "--session-save-path", str(sessions)]
    first = ServerProcess(tiny, args, tmp_path / "first.log").wait_healthy()
    try:
        answer = chat(first, tiny, HISTORY)["choices"][0]["message"]["content"]
        history = [*HISTORY, {"role": "assistant", "content": answer}]
        uninterrupted = chat(first, tiny, [*history, NEXT_TURN])
        response = first.post("/v1/sessions/conv-1/save", {"messages": history})
        assert response.status_code == 200, response.text
        saved = response.json()
        assert saved["num_blocks"] == saved["num_prompt_tokens"] // BLOCK_SIZE >= 4
        assert (Path(saved["path"]) / "kv.safetensors").is_file()
        for path, body, status, param in [
            ("/v1/sessions/bad$id/save", {"token_ids": [1, 2]}, 400, "session_id"),
            ("/v1/sessions/x/save", {"token_ids": [1], "prompt": "a"}, 400, "token_ids"),
            ("/v1/sessions/x/save", {"token_ids": [10**9]}, 400, "token_ids"),
            ("/v1/sessions/x/save", {"token_ids": [1, 2, 3]}, 400, "token_ids"),  # no full block
            ("/v1/sessions/nope/restore", {}, 404, "session_id"),
        ]:
            bad = first.post(path, body)
            assert bad.status_code == status and bad.json()["error"]["param"] == param, (path, bad.text)
    finally:
        first.stop()

    # A tampered copy (other block size) is refused and leaves the pool as it was.
    meta = json.loads((sessions / "conv-1" / "session.json").read_text())
    tampered = sessions / "conv-2"
    tampered.mkdir()
    (tampered / "kv.safetensors").write_bytes((sessions / "conv-1" / "kv.safetensors").read_bytes())
    (tampered / "session.json").write_text(json.dumps({**meta, "block_size": 32}))

    second = ServerProcess(tiny, args, tmp_path / "second.log").wait_healthy()
    try:
        pool = second.kv_cache()
        refused = second.post("/v1/sessions/conv-2/restore", {})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "block_size", refused.text
        assert second.kv_cache() == pool
        restored = second.post("/v1/sessions/conv-1/restore", {})
        assert restored.status_code == 200, restored.text
        assert restored.json()["num_imported"] == saved["num_blocks"]
        resumed = chat(second, tiny, [*history, NEXT_TURN])
        assert resumed["choices"][0]["message"] == uninterrupted["choices"][0]["message"]
        cached = resumed["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == saved["num_blocks"] * BLOCK_SIZE  # the history's full blocks: only new tokens prefilled
        assert second.kv_cache()["integrity"] == "ok"
        deleted = httpx_delete(second, "/v1/sessions/conv-1")
        assert deleted.status_code == 200 and httpx_delete(second, "/v1/sessions/conv-1").status_code == 404
    finally:
        second.stop()


def httpx_delete(server: ServerProcess, path: str):
    import httpx2 as httpx

    return httpx.delete(f"{server.url}{path}", headers={**server.headers(), "content-type": "application/json"},
                        timeout=30)


def test_blocks_tensor_layout_matches_the_pool(tiny):
    with make_llm(tiny) as llm:
        prompt = list(range(200, 233))
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
        meta, blocks, _ = llm.engine.block_io.export_blocks(prompt)
        kv = llm.engine.runner.kv_cache  # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        ids = llm.engine.kv_cache_manager.cached_prefix_block_ids([int(h, 16) for h in meta.block_hashes])
        assert blocks.shape == (2, kv.shape[0], 2, BLOCK_SIZE, kv.shape[4], kv.shape[5])
        for i, block_id in enumerate(ids):
            assert torch.equal(blocks[i], kv[:, :, block_id])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_saves_and_restores_with_its_scales(tiny, tmp_path, kv_cache_dtype):
    """An int8/fp8 session carries its codes and their scales (``kv_scales``): restored into another engine it
    is served from the prefix cache with the source's own cached-prefix output; missing or wrong scales are
    refused by name, nothing changed."""
    prompt = list(range(300, 350))  # 3 full blocks and 2 tokens
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    with make_llm(tiny, kv_cache_dtype=kv_cache_dtype) as source:
        source.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
        want = source.generate({"prompt_token_ids": prompt}, greedy)[0]  # from its own prefix cache
        assert want.num_cached_tokens == 48
        meta, blocks, state = source.engine.block_io.export_blocks(prompt)
        pool = source.engine.runner.kv_pool
        ids = source.engine.kv_cache_manager.cached_prefix_block_ids([int(h, 16) for h in meta.block_hashes])
        assert meta.kv_dtype == pool.dtype_name and blocks.dtype == pool.dtype
        assert set(state) == {"kv_scales"} and state["kv_scales"].shape == (3, *pool.block_shape[:-1])
        for i, block_id in enumerate(ids):  # the pool's codes and scales, as they are
            assert torch.equal(blocks[i].view(torch.uint8), pool.kv[:, :, block_id].view(torch.uint8))
            assert torch.equal(state["kv_scales"][i], pool.scales[:, :, block_id])
    write_session(tmp_path / "sessions", "q", meta, blocks, state)
    meta, blocks, state = read_session(tmp_path / "sessions", "q")
    with make_llm(tiny, kv_cache_dtype=kv_cache_dtype) as target:
        for bad in ({}, {"kv_scales": state["kv_scales"][:, :1]}):
            with pytest.raises(KVBlocksError) as info:
                target.engine.block_io.import_blocks(meta, blocks, bad)
            assert info.value.param == "kv_scales" and not cached_hashes(target)
        wrong = {"kv_scales": state["kv_scales"] * 2}
        with pytest.raises(KVBlocksError) as info:
            target.engine.block_io.import_blocks(meta, blocks, wrong)
        assert info.value.param == "sha256" and not cached_hashes(target)
        assert target.engine.block_io.import_blocks(meta, blocks, state)["num_imported"] == 3
        got = target.generate({"prompt_token_ids": prompt}, greedy)[0]
        assert got.num_cached_tokens == 48
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert ([{t: lp.logprob for t, lp in pos.items()} for pos in got.outputs[0].logprobs]
                == [{t: lp.logprob for t, lp in pos.items()} for pos in want.outputs[0].logprobs])
    with make_llm(tiny) as float_kv:  # a float KV cache refuses quantized blocks by their dtype
        with pytest.raises(KVBlocksError) as info:
            float_kv.engine.block_io.import_blocks(meta, blocks, state)
        assert info.value.param == "kv_dtype"
