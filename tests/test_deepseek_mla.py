"""DeepSeek-V2 / V3 with multi-head latent attention: the paged attention paths on a one-plane latent cache against
the torch reference (latent widths of the tiny models and of the real ones), tiny V2 and V3 models against
transformers in float32 (logits, then greedy through the engine with chunked prefill and prefix caching on and off),
the KV pool and `tokenmill plan` counting the latent's bytes per token, preemption with a tiny pool, deterministic
mode alone vs in a batch of 16, blocks through the RAM tier, what is refused (quantized KV, the CUDA runner,
adapters on the latent projections), and `tokenmill serve` on a DeepSeek checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.deepseek_models import DEEPSEEK_ARCHS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, make_deepseek_model
from tests.server_fixtures import ServerProcess
from tests.test_models import BLOCK_IDS, TOKEN_IDS, hf_logits, new_kv_caches, run_step
from tokenmill import LLM, SamplingParams
from tokenmill.attention import Attention, build_attention_metadata, cpu_decode, cpu_prefill
from tokenmill.attention.torch_paged import paged_attention
from tokenmill.config import ConfigError
from tokenmill.layers import batch_invariant
from tokenmill.lora_request import LoRARequest
from tokenmill.memory_plan import PlanConfig, plan_memory, read_model_shape
from tokenmill.models import load_model
from tokenmill.models.errors import UnsupportedModelError

LATENT = KV_LORA_RANK + QK_ROPE_HEAD_DIM
NUM_LAYERS = 3
needs_kernels = pytest.mark.skipif(not batch_invariant.available(), reason="batch-invariant kernels not built here")


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    """arch -> (path, transformers model) for V2 and V3."""
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: (str(root / arch), make_deepseek_model(arch, root / arch)) for arch in DEEPSEEK_ARCHS}


def _hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[(37 * i + 11 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((9, 41))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# --- the paged attention paths on a latent cache --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("latent", [LATENT, 576])  # the tiny models' and DeepSeek-V2/V3's 512 + 64
def test_latent_attention_layer_writes_one_plane_and_every_path_equals_the_reference(latent, dtype):
    """``Attention(latent_cache=True)`` (16 query heads, one KV head of the latent width) writes each token's latent
    once into the one plane and attends over it as keys and values: the C decode and prefill kernels and the
    deterministic per-token path equal the torch reference on a step mixing a resumed prefill chunk, a fresh
    prompt and decode queries."""
    torch.manual_seed(0)
    block_size, heads = 4, 16
    query_lens, computed = np.array([7, 1, 5, 1]), np.array([6, 13, 0, 2])
    table = np.array([[3, 9, 1, 30], [12, 5, 22, 8], [17, 2, 0, 0], [25, 0, 0, 0]])
    metadata, _ = build_attention_metadata(query_lens, computed, table, block_size)
    per_token_metadata, _ = build_attention_metadata(query_lens, computed, table, block_size, per_token=True)
    num_tokens = int(query_lens.sum())
    q = torch.randn(num_tokens, heads * latent).to(dtype)
    new = torch.randn(num_tokens, latent).to(dtype)
    before = torch.randn(40, block_size, 1, latent).to(dtype)  # (blocks, block_size, 1 KV head, latent)
    written = before.clone()
    written.view(-1, latent)[metadata.slot_mapping] = new
    want = paged_attention(q.float().view(num_tokens, heads, latent), written.float(), written.float(), metadata, 0.1,
                           use_kernel=False).view(num_tokens, -1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    paths = [("reference", False, False, False, metadata)]
    if cpu_decode.available():
        paths += [("kernels", True, cpu_prefill.available(), False, metadata),
                  ("per-token", True, False, True, per_token_metadata)]
    for name, decode_kernel, prefill_kernel, invariant, step_metadata in paths:
        attn = Attention(heads, 1, latent, scale=0.1, latent_cache=True)
        attn.cpu_decode_kernel, attn.cpu_prefill_kernel, attn.batch_invariant = decode_kernel, prefill_kernel, invariant
        cache = before.clone()
        got = attn(q, new, new, (cache, cache), step_metadata)
        assert torch.equal(cache, written), name  # this step's latents, once, at their slots; nothing else
        torch.testing.assert_close(got.float(), want, **tol, msg=name)
    if cpu_prefill.available():  # the latent widths are multiples of every ISA's vector width
        assert cpu_prefill.supports(q.view(num_tokens, heads, latent), before)


# --- tiny models against transformers -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_prefill_then_decode_logits_match_transformers(tiny_deepseek, arch):
    path, hf = tiny_deepseek[arch]
    loaded = load_model(path, dtype="float32")
    assert type(loaded.model).__name__ == hf.config.architectures[0]
    assert (loaded.kv_planes, loaded.num_kv_heads, loaded.head_dim) == (1, 1, LATENT)
    kv = [(latent, latent) for latent, _ in new_kv_caches(loaded)]  # one latent plane per layer, read as K and V
    prefill = run_step(loaded, kv, [TOKEN_IDS[:-1]], [0], [BLOCK_IDS[:5]])
    decode = run_step(loaded, kv, [TOKEN_IDS[-1:]], [len(TOKEN_IDS) - 1], [BLOCK_IDS[:5]])
    torch.testing.assert_close(torch.cat([prefill, decode]), hf_logits(hf, TOKEN_IDS), rtol=1e-4, atol=1e-4)
    snap = loaded.model.expert_load.snapshot()
    assert len(snap.layer_imbalance) == NUM_LAYERS - 1  # first_k_dense_replace 1: layer 0 dense
    assert len([e for e in snap.tokens_per_expert if e]) >= 4


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_llm_greedy_matches_transformers_with_chunked_prefill_and_prefix_cache_on_and_off(tiny_deepseek, arch):
    """Greedy tokens equal transformers' with 16-token chunks, with the prefix cache off and on (the second pass
    resumes prompts from cached latent blocks); the pool holds one latent plane of the formula's bytes."""
    path, hf = tiny_deepseek[arch]
    want = [_hf_greedy(hf, p, 6) for p in PROMPTS]
    assert max(len(set(w)) for w in want) >= 3
    for prefix_caching in (False, True):
        with LLM(model=path, dtype="float32", max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
                 enable_prefix_caching=prefix_caching, enable_chunked_prefill=True) as llm:
            runner = llm.engine.runner
            pool = runner.kv_pool
            assert pool.num_planes == 1 and pool.block_shape == (NUM_LAYERS, 1, 4, 1, LATENT)
            assert runner.bytes_per_token == NUM_LAYERS * LATENT * 4  # layers x (kv_lora_rank + rope) x float32
            assert pool.block_bytes == 4 * runner.bytes_per_token
            for _ in range(2):
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
                assert [o.outputs[0].token_ids for o in outs] == want
            assert (llm.engine.kv_cache_manager.prefix_cache_hits > 0) == prefix_caching
            assert outs[1].num_cached_tokens == (40 if prefix_caching else 0)


def test_plan_counts_the_latents_bytes_per_token(tiny_deepseek, tmp_path):
    """`tokenmill plan`: KV bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, for the tiny
    V3 and for a DeepSeek-V2-Lite-shaped config (27 x 576 x 2 in bf16); a quantized KV cache is refused."""
    shape = read_model_shape(tiny_deepseek["deepseek_v3"][0])
    plan = plan_memory(shape, PlanConfig(memory=1, dtype="bfloat16", max_model_len=256))
    assert plan.kv_bytes_per_token == NUM_LAYERS * LATENT * 2
    lite = tmp_path / "v2-lite"
    lite.mkdir()
    config = json.loads((Path(tiny_deepseek["deepseek_v2"][0]) / "config.json").read_text())
    config.update(num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
                  head_dim=64, max_position_embeddings=163840, vocab_size=102400)
    (lite / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 8, dtype=torch.bfloat16)}, str(lite / "model.safetensors"))
    lite_plan = plan_memory(read_model_shape(str(lite)), PlanConfig(memory=64, dtype="bfloat16", max_model_len=4096))
    assert lite_plan.kv_bytes_per_token == 27 * 576 * 2 == 31104
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'.*latent"):
        plan_memory(shape, PlanConfig(memory=1, kv_cache_dtype="int8", max_model_len=256))


def test_preemption_with_a_tiny_pool_keeps_transformers_greedy(tiny_deepseek):
    """Four requests that outgrow a 16-block pool are preempted and recomputed: still transformers' tokens."""
    path, hf = tiny_deepseek["deepseek_v3"]
    prompts = [[(41 * i + 7 * j) % 30000 + 300 for j in range(19)] for i in range(4)]
    with LLM(model=path, dtype="float32", num_kv_blocks=16, block_size=4, max_num_batched_tokens=16) as llm:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16) for p in prompts]
        assert llm.engine.scheduler.num_preemptions_total > 0


@needs_kernels
def test_deterministic_mode_alone_equals_in_a_batch_of_16(tiny_deepseek):
    """Deterministic mode (the absorbed products per head in the batch-invariant GEMM, sigmoid routing through
    invariant_sigmoid): a request's tokens and log-probabilities are bit-identical alone and among 15 others."""
    path, _ = tiny_deepseek["deepseek_v3"]
    prompts = [[(13 * i + 7 * j) % 30000 + 200 for j in range(5 + 3 * i)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    with LLM(model=path, dtype="float32", deterministic=True, num_kv_blocks=256) as llm:
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i in (0, 15):
            alone = llm.generate([{"prompt_token_ids": prompts[i]}], params)[0]
            assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
            assert alone.outputs[0].logprobs == batch[i].outputs[0].logprobs


def test_latent_blocks_come_back_from_the_ram_tier(tiny_deepseek):
    """A prefix evicted from a 24-block pool to the RAM tier (the latent block as one byte row) is loaded back and
    gives the tokens of a run that recomputed it."""
    path, _ = tiny_deepseek["deepseek_v2"]
    prefix = [(53 * j) % 30000 + 500 for j in range(40)]  # 10 blocks of 4
    fillers = [[(29 * i + 31 * j) % 30000 + 700 for j in range(40)] for i in range(4)]
    probe = prefix + [11, 12, 13]
    block_bytes = 4 * NUM_LAYERS * LATENT * 4
    with LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64,
             max_model_len=96, kv_offload_memory=200 * block_bytes / 1024**3) as llm:
        llm.generate({"prompt_token_ids": prefix + [1, 2]}, GREEDY)
        for filler in fillers:
            llm.generate({"prompt_token_ids": filler}, GREEDY)
        got = llm.generate({"prompt_token_ids": probe}, GREEDY)[0]
        assert llm.engine.kv_store.ram.stats.hits == 10 and got.num_cached_tokens >= 40
        llm.engine.check_integrity()
    with LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=False) as fresh:
        want = fresh.generate({"prompt_token_ids": probe}, GREEDY)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


# --- what is refused --------------------------------------------------------------------------------------------------

def test_quantized_kv_cuda_runner_and_latent_projection_adapters_are_refused(tiny_deepseek, tmp_path):
    path, _ = tiny_deepseek["deepseek_v2"]
    with pytest.raises((ConfigError, ValueError), match="kv_cache_dtype.*latent"):
        LLM(model=path, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=16)
    from tokenmill.config import CacheConfig, SchedulerConfig
    from tokenmill.runner.cuda_runner import CudaModelRunner

    loaded = load_model(path, dtype="float32")
    with pytest.raises(UnsupportedModelError, match="latent attention.*CPU only"):
        CudaModelRunner(loaded, CacheConfig(block_size=16), SchedulerConfig(max_model_len=64))
    adapter = tmp_path / "kv_b"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["kv_b_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.kv_b_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, KV_LORA_RANK), f"{prefix}.lora_B.weight": torch.zeros(160, 4)},
              str(adapter / "adapter_model.safetensors"))
    with LLM(model=path, dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=32) as llm:
        with pytest.raises(ValueError, match="kv_b_proj"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY,
                         lora_request=LoRARequest("kv_b", 1, str(adapter)))


def test_o_proj_lora_matches_peft(tiny_deepseek, tmp_path):
    """An adapter on o_proj (the latent attention's output projection) gives peft's greedy tokens."""
    from peft import LoraConfig, PeftModel, get_peft_model

    path, _ = tiny_deepseek["deepseek_v2"]
    torch.manual_seed(21)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["o_proj"])
                   ).save_pretrained(tmp_path / "o")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                     str(tmp_path / "o")).eval()
    with LLM(model=path, dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=32) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            lora_request=LoRARequest("o", 1, str(tmp_path / "o")))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(peft, p, 6) for p in PROMPTS]


def test_serve_answers_on_a_deepseek_checkpoint(tiny_deepseek, tmp_path):
    """`tokenmill serve` loads a saved DeepSeek-V3 checkpoint and completes a request."""
    path, _ = tiny_deepseek["deepseek_v3"]
    server = ServerProcess(path, ["--dtype", "float32", "--max-model-len", "128"], tmp_path / "server.log")
    try:
        server.wait_healthy()
        response = server.post("/v1/completions", {"prompt": "Hello latent attention", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
