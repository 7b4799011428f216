"""Multi-LoRA end to end: adapters written by peft (init_lora_weights=False, so B is not zero) on tiny
models and on SmolLM2 give peft's greedy tokens and log-probabilities; adapters and the base model
batch together with chunked prefill, preemption, n > 1, logprobs and stop strings and each request
equals itself run alone; slots and the host cache load and evict as counted; prefix-cache blocks are
never shared across adapters; deterministic mode stays bit-identical; unsupported adapters and
settings are refused naming the adapter (or the flag) and the reason."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.scheduler_helpers import make_request, scheduled, step
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.config import ConfigError, SchedulerConfig
from tokenmill.engine.llm import build_engine_config
from tokenmill.kv_cache import KVCacheManager
from tokenmill.layers import batch_invariant
from tokenmill.lora_request import LoRAModulePath, parse_lora_module
from tokenmill.models import gguf_cache
from tokenmill.scheduler import Scheduler

NEW_TOKENS = 10
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig arguments: several ranks, target sets, rsLoRA, per-module rank and alpha.
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS, use_rslora=True),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                rank_pattern={"gate_proj": 6}, alpha_pattern={"down_proj": 3}),
    "ko": dict(r=16, lora_alpha=8, target_modules=["k_proj", "o_proj"]),
}


def save_adapter(base: str, out: Path, seed: int, safe_serialization: bool = True, **lora_args) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_args))
    peft_model.save_pretrained(out, safe_serialization=safe_serialization)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float32 tiny Llama and the ADAPTERS made on it by peft: (base path, {name: LoRARequest})."""
    root = tmp_path_factory.mktemp("lora")
    base = str(make_tiny_model("llama", root / "base"))
    requests = {
        name: LoRARequest(name, i + 1, save_adapter(base, root / name, seed=100 + i, **args))
        for i, (name, args) in enumerate(ADAPTERS.items())
    }
    return base, requests


def random_prompts(num: int, seed: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


def peft_model(base: str, lora_request: LoRARequest | None):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return model if lora_request is None else PeftModel.from_pretrained(model, lora_request.lora_path).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(max_tokens: int = NEW_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# ---- equality with peft ---------------------------------------------------------------------
@torch.inference_mode()
def test_adapters_and_base_in_one_batch_match_peft_greedy_and_logprobs(tiny):
    """Base-model prompts and one prompt per adapter (ranks 2-16, different targets, rsLoRA, rank and
    alpha patterns) in one generate call: greedy tokens equal peft's; prompt log-probabilities agree
    within 1e-4; every adapter moves the log-probabilities (so the comparison means something)."""
    base, loras = tiny
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4, enable_lora=True, max_loras=4,
              max_lora_rank=16)
    prompts = random_prompts(6, seed=1)
    choices = [None, None, *loras.values()]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(prompt_logprobs=1), lora_request=choices)
    base_model = peft_model(base, None)
    for prompt, lora, out in zip(prompts, choices, outs):
        model = base_model if lora is None else peft_model(base, lora)
        assert out.outputs[0].token_ids == hf_greedy(model, prompt), lora
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # (P, V)
        for pos in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        if lora is not None:
            base_ref = torch.log_softmax(base_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
            assert (ref - base_ref).abs().max() > 0.05, lora
    assert llm.engine.lora_manager.stats() == {"disk_loads": 4, "host_evictions": 0, "slot_loads": 4,
                                               "slot_evictions": 0}


@torch.inference_mode()
def test_qwen3_adapter_matches_peft_and_bin_format_loads_the_same(tmp_path):
    """Qwen3 (head_dim 32: o_proj's input is 128 wide, not hidden 64; q/k norms after the adapted
    projections); the adapter saved as adapter_model.bin gives the same tokens as its safetensors twin."""
    base = str(make_tiny_model("qwen3", tmp_path / "qwen3"))
    args = dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"])
    safetensors_dir = save_adapter(base, tmp_path / "st", seed=5, **args)
    bin_dir = save_adapter(base, tmp_path / "bin", seed=5, safe_serialization=False, **args)
    assert (Path(bin_dir) / "adapter_model.bin").is_file()
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = random_prompts(2, seed=2)
    lora_st, lora_bin = LoRARequest("st", 1, safetensors_dir), LoRARequest("bin", 2, bin_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], greedy(),
                        lora_request=[lora_st, lora_st, lora_bin, lora_bin])
    model = peft_model(base, lora_st)
    expected = [hf_greedy(model, p) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected * 2


def transformers_twin(llm: LLM):
    """The transformers model of an engine's weights (fused qkv/gate_up split back into projections),
    so SmolLM2's GGUF is parsed and dequantized once."""
    loaded = llm.engine.loaded
    hf = AutoModelForCausalLM.from_config(gguf_cache.class_config(loaded.hf_config), dtype=torch.float32).eval()
    state = {}
    for name, module in loaded.model.named_modules():
        for fused, projections in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if name.endswith(fused):
                for proj, part in zip(projections, module.weight.split(module.output_sizes)):
                    state[f"{name[: -len(fused)]}{proj}.weight"] = part
    state.update((k, v) for k, v in loaded.model.state_dict().items() if "qkv_proj" not in k and "gate_up_proj" not in k)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


@torch.inference_mode()
def test_smollm2_adapter_matches_peft_greedy(tmp_path):
    llm = LLM(dtype="float32", quantization="none", max_model_len=128, kv_cache_memory=0.02, num_threads=1,
              enable_lora=True, max_lora_rank=8)  # peft runs the dequantized weights
    torch.manual_seed(0)
    peft = get_peft_model(transformers_twin(llm), LoraConfig(r=8, lora_alpha=32, init_lora_weights=False,
                                                             target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    peft.save_pretrained(tmp_path / "smol")
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(temperature=0, max_tokens=8)
    lora = LoRARequest("smol", 1, str(tmp_path / "smol"))
    out, base = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=[lora, None])
    assert out.outputs[0].token_ids == hf_greedy(peft.eval(), prompt, 8)
    assert out.outputs[0].token_ids != base.outputs[0].token_ids


# ---- batching, preemption, slots ------------------------------------------------------------
def drive(llm: LLM, arrivals: dict[int, list[tuple]]) -> dict[str, object]:
    """Add (request_id, prompt, params, lora) at their step numbers and step until all finish."""
    engine, results, arrivals, step_no = llm.engine, {}, dict(arrivals), 0
    while arrivals or engine.has_unfinished_requests():
        for request_id, prompt, params, lora in arrivals.pop(step_no, []):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
        step_no += 1
    engine.check_integrity()
    return results


def summary(output) -> list:
    """Per sequence: tokens, text, finish and stop reasons, and the logprob entries (token ids, values)."""
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in o.logprobs or []])
            for o in output.outputs]


def assert_same(got: list, expected: list, what: str) -> None:
    """Equal summaries, log-probabilities within 1e-4 (default mode is not bit-invariant)."""
    assert [s[:4] for s in got] == [s[:4] for s in expected], what
    for seq_got, seq_expected in zip(got, expected):
        for pos_got, pos_expected in zip(seq_got[4], seq_expected[4], strict=True):
            assert [t for t, _ in pos_got] == [t for t, _ in pos_expected], what
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(pos_got, pos_expected)), what


def test_mixed_batch_with_chunking_and_preemption_equals_each_request_alone(tiny, monkeypatch):
    """Base-model and three adapters' requests arriving at different steps, with a 7-token budget, a
    pool small enough to preempt, 2 slots for 3 adapters, n=2 seeded sampling, logprobs and a stop
    string: every request's output equals its output alone on an idle engine."""
    base, loras = tiny
    qv, all_, mlp = loras["qv"], loras["all"], loras["mlp"]
    prompts = random_prompts(8, seed=3, lo=8, hi=20)
    plain = greedy(12)
    probe = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=256, enable_lora=True, max_loras=1)
    text = probe.generate({"prompt_token_ids": prompts[4]}, plain, lora_request=mlp)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    requests = [  # (step, request_id, prompt, params, lora)
        (0, "base-0", prompts[0], plain, None),
        (0, "qv-0", prompts[1], greedy(12, logprobs=2), qv),
        (1, "all-0", prompts[2], SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=12, ignore_eos=True), all_),
        (2, "qv-1", prompts[1][:6] + prompts[3], plain, qv),
        (3, "mlp-0", prompts[4], greedy(12, stop=[stop]), mlp),
        (3, "base-1", prompts[5], greedy(12, logprobs=1), None),
        (5, "all-1", prompts[6], plain, all_),
        (6, "mlp-1", prompts[7], plain, mlp),
    ]
    alone = {}
    for _, request_id, prompt, params, lora in requests:
        alone[request_id] = summary(drive(probe, {0: [(request_id, prompt, params, lora)]})[request_id])
    assert alone["mlp-0"][0][2] == "stop"

    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=14, block_size=4, max_num_batched_tokens=7,
              enable_lora=True, max_loras=2, max_cpu_loras=2)
    preempted = []
    original = llm.engine.scheduler._preempt
    monkeypatch.setattr(llm.engine.scheduler, "_preempt", lambda r: (preempted.append(r.lora_int_id), original(r)))
    adapters_per_step = []
    activate = llm.engine.lora_manager.activate
    monkeypatch.setattr(llm.engine.lora_manager, "activate",
                        lambda reqs: (adapters_per_step.append({r.lora_int_id for r in reqs if r}), activate(reqs))[1])
    arrivals: dict[int, list[tuple]] = {}
    for step_no, request_id, prompt, params, lora in requests:
        arrivals.setdefault(step_no, []).append((request_id, prompt, params, lora))
    results = drive(llm, arrivals)
    for _, request_id, *_ in requests:
        assert_same(summary(results[request_id]), alone[request_id], request_id)
    assert any(p is not None for p in preempted)  # an adapter request was preempted and recomputed
    assert max(len(a) for a in adapters_per_step) == 2
    assert llm.engine.lora_manager.num_slot_evictions > 0
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == 14


def test_more_adapters_than_slots_and_host_cache_load_and_evict_as_counted(tiny):
    """4 adapters, 2 slots, 2 host entries, one request each (same length): registration reads all four
    (the last two push out the first two); step 1 runs qv and all (read again, slots 0 and 1), mlp and
    ko wait; when qv and all finish, mlp and ko are read again and replace them in the slots."""
    base, loras = tiny
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=256, enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=16)
    manager = llm.engine.lora_manager
    order = ["qv", "all", "mlp", "ko"]
    prompts = random_prompts(4, seed=4, lo=10, hi=11)
    steps: list[set[int]] = []
    activate = manager.activate
    manager.activate = lambda reqs: (steps.append({r.lora_int_id for r in reqs if r}), activate(reqs))[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4), lora_request=[loras[n] for n in order])
    ids = {name: loras[name].lora_int_id for name in order}
    assert steps[0] == {ids["qv"], ids["all"]} and steps[-1] == {ids["mlp"], ids["ko"]}
    assert all(len(s) <= 2 for s in steps)
    assert manager.stats() == {"disk_loads": 8, "host_evictions": 6, "slot_loads": 4, "slot_evictions": 2}
    assert manager.resident_lora_ids == [ids["mlp"], ids["ko"]] and manager.host_lora_ids == [ids["mlp"], ids["ko"]]
    for name, prompt, out in zip(order, prompts, outs):  # each equals itself alone with plenty of slots
        assert out.outputs[0].token_ids == hf_greedy(peft_model(base, loras[name]), prompt, 4), name


def test_scheduler_limits_adapters_per_step_fcfs_without_starvation():
    """max_loras=1: A runs; waiting B1, A2, base: B1 cannot get the slot and is skipped, A2 (later) must
    not overtake it, the base-model request goes ahead; when A finishes, B1 runs, then A2."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, max_loras=1), kv)
    lora_a, lora_b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    a1 = make_request("a1", 4, max_tokens=3)
    b1, a2, plain = make_request("b1", 4, max_tokens=2), make_request("a2", 4, max_tokens=2), make_request("p", 4)
    a1.lora_request, b1.lora_request, a2.lora_request = lora_a, lora_b, lora_a
    s.add_request(a1)
    assert scheduled(step(s)) == {"a1": 4}
    for r in (b1, a2, plain):
        s.add_request(r)
    assert scheduled(step(s)) == {"a1": 1, "p": 4}
    assert [r.request_id for r in s.waiting] == ["b1", "a2"]
    assert scheduled(step(s)) == {"a1": 1, "p": 1}  # a1 finishes (3 tokens) this step
    assert scheduled(step(s)) == {"p": 1, "b1": 4}
    assert scheduled(step(s)) == {"p": 1, "b1": 1}  # b1 finishes; a2 still waits for the slot
    assert scheduled(step(s)) == {"a2": 4}
    kv.check_integrity()


def test_prefix_cache_never_shared_across_adapters(tiny):
    base, loras = tiny
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4, enable_lora=True, max_loras=2)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5, lo=20, hi=21)[0]}

    def cached(lora) -> int:
        return llm.generate(prompt, greedy(2), lora_request=lora)[0].num_cached_tokens

    assert cached(loras["qv"]) == 0
    assert cached(loras["all"]) == 0  # same tokens, another adapter: no hit
    assert cached(None) == 0  # nor for the base model
    assert cached(loras["qv"]) == 16 and cached(loras["all"]) == 16 and cached(None) == 16  # each hits its own


# ---- deterministic mode ---------------------------------------------------------------------
@pytest.mark.skipif(not batch_invariant.available(), reason="no C compiler for the batch-invariant kernels")
def test_deterministic_mode_adapter_request_is_bit_identical_in_any_batch(tiny):
    """bf16, deterministic: an adapter request's tokens and logprob bits alone equal those among base and
    other adapters' requests under other budgets, block sizes, slots and a pool that preempts."""
    base, loras = tiny
    target = random_prompts(1, seed=6, lo=30, hi=31)[0]
    params = greedy(12, logprobs=2)

    def run(seed: int | None) -> list:
        rng = random.Random(seed)
        block_size = 16 if seed is None else rng.choice([4, 8])
        llm = LLM(model=base, dtype="bfloat16", deterministic=True, num_threads=1, enable_lora=True, max_loras=2,
                  block_size=block_size, max_num_batched_tokens=512 if seed is None else rng.choice([7, 16, 33]),
                  num_kv_blocks=(1024 if seed is None else rng.choice([96, 1024])) // block_size)
        arrivals = {rng.randrange(3) if seed else 0: [("target", target, params, loras["all"])]}
        for i in range(0 if seed is None else 8):
            lora = rng.choice([None, loras["qv"], loras["all"], loras["mlp"]])
            other = target[: rng.randrange(4, 30)] if rng.random() < 0.3 else random_prompts(1, seed * 10 + i)[0]
            arrivals.setdefault(rng.randrange(6), []).append((f"o{i}", other, greedy(rng.randrange(2, 10)), lora))
        out = drive(llm, arrivals)["target"].outputs[0]
        return [out.token_ids, [sorted((t, lp.logprob.hex()) for t, lp in pos.items()) for pos in out.logprobs]]

    alone = run(None)
    for seed in (1, 2, 3):
        assert run(seed) == alone, seed


# ---- refusals ---------------------------------------------------------------------------
def edit_adapter(src: str, dst: Path, config_changes: dict | None = None, rename=None, extra=None) -> str:
    """A copy of adapter ``src`` with config fields changed, tensor keys renamed or tensors added."""
    dst.mkdir()
    config = json.loads((Path(src) / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(Path(src) / "adapter_model.safetensors"))
    if rename:
        tensors = {rename(k): v for k, v in tensors.items()}
    tensors.update(extra or {})
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_unsupported_adapters_are_refused_naming_adapter_and_reason(tiny, tmp_path):
    base, loras = tiny
    src = loras["qv"].lora_path
    other_base = str(make_tiny_model("llama", tmp_path / "wider", hidden_size=96, intermediate_size=128))
    layer0_q = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = {
        "dora": (edit_adapter(src, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        "dora-tensor": (edit_adapter(src, tmp_path / "dora2", extra={f"{layer0_q}.lora_magnitude_vector":
                                                                       torch.ones(64)}), "DoRA"),
        "embed": (save_adapter(base, tmp_path / "embed", 1, r=4, target_modules=["embed_tokens", "q_proj"]),
                  "embedding"),
        "lm-head": (edit_adapter(src, tmp_path / "head", extra={"base_model.model.lm_head.lora_A.weight":
                                                                 torch.ones(4, 64)}), "LM-head"),
        "fc1": (edit_adapter(src, tmp_path / "fc1", rename=lambda k: k.replace("v_proj", "fc1")), "'model.layers.0.self_attn.fc1'"),
        "fc1-config": (edit_adapter(src, tmp_path / "fc1c", {"target_modules": ["q_proj", "fc1"]}), "'fc1'"),
        "rank": (loras["ko"].lora_path, "rank 16, above max_lora_rank 8"),
        "shapes": (save_adapter(other_base, tmp_path / "wide", 1, r=4, target_modules=["q_proj"]), "another base model"),
        "layers": (edit_adapter(src, tmp_path / "deep", rename=lambda k: k.replace("layers.1.", "layers.7.")),
                   "layer 7 but the base model has 2 layers"),
        "modules-to-save": (edit_adapter(src, tmp_path / "mts", {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        "missing": (str(tmp_path / "nowhere"), "not a directory"),
    }
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=8)
    for i, (name, (path, reason)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=f"LoRA adapter '{name}' refused: .*{reason}"):
            llm.generate({"prompt_token_ids": [100, 101]}, greedy(2), lora_request=LoRARequest(name, 10 + i, path))
    assert not llm.engine.has_unfinished_requests()
    lora = loras["qv"]
    assert llm.generate({"prompt_token_ids": [100, 101]}, greedy(2), lora_request=lora)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'qv'"):
        llm.generate({"prompt_token_ids": [100]}, greedy(2), lora_request=LoRARequest("other", 1, loras["all"].lora_path))
    plain = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=64)
    with pytest.raises(ValueError, match="needs an engine started with enable_lora=True"):
        plain.generate({"prompt_token_ids": [100]}, greedy(2), lora_request=lora)


def test_lora_settings_are_validated_naming_the_flag():
    for kwargs, name in [
        (dict(max_loras=0), "max_loras"),
        (dict(max_lora_rank=0), "max_lora_rank"),
        (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
        (dict(max_loras="2"), "max_loras"),
    ]:
        with pytest.raises(ConfigError, match=name) as info:
            build_engine_config(enable_lora=True, **kwargs)
        assert "--" + name.replace("_", "-") in info.value.for_cli()
    with pytest.raises(ConfigError, match="enable_lora"):
        build_engine_config(enable_lora="yes")
    assert build_engine_config(max_loras=0).lora is None  # LoRA off: its settings are not used
    config = build_engine_config(enable_lora=True, max_loras=3)
    assert (config.lora.max_loras, config.lora.max_lora_rank, config.lora.host_capacity) == (3, 16, 3)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/x")


# ---- adapters across restarts, runtime add/remove, --lora-modules ---------------------------
def test_disk_kv_tier_keeps_each_adapters_blocks_across_restarts_whatever_its_id(tiny, tmp_path):
    """Blocks saved to the disk tier under adapter "qv" (id 1) are found again after a restart where
    "qv" has id 7 and id 1 now names another adapter ("all"): block hashes carry the adapter's
    content digest, not its id. The hit gives the same tokens as computing afresh."""
    base, loras = tiny
    prompt = {"prompt_token_ids": random_prompts(1, seed=9, lo=24, hi=25)[0]}
    kwargs = dict(model=base, dtype="float32", num_threads=1, num_kv_blocks=64, block_size=4, enable_lora=True,
                  max_loras=2, kv_offload_disk_path=str(tmp_path / "kv"))
    qv_first = LoRARequest("qv", 1, loras["qv"].lora_path)
    with LLM(**kwargs) as llm:
        fresh = llm.generate(prompt, greedy(4), lora_request=qv_first)[0]
        assert fresh.num_cached_tokens == 0 and fresh.lora_request == qv_first
    qv_later, other = LoRARequest("qv-renamed", 7, loras["qv"].lora_path), LoRARequest("all", 1, loras["all"].lora_path)
    with LLM(**kwargs) as llm:
        assert llm.generate(prompt, greedy(4), lora_request=other)[0].num_cached_tokens == 0
        again = llm.generate(prompt, greedy(4), lora_request=qv_later)[0]
        assert again.num_cached_tokens == 20 and llm.engine.kv_store.disk.stats.hits >= 5
        assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_add_and_remove_lora_at_run_time(tiny):
    """``add_lora`` reads and registers an adapter ahead of use (False for an id already there);
    ``remove_lora`` refuses while a request of it is unfinished, then frees its slot and host entry and
    retires the id: a later request with it is refused, the same adapter under a new id serves again."""
    base, loras = tiny
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=256, enable_lora=True, max_loras=2)
    engine, qv = llm.engine, loras["qv"]
    assert engine.add_lora(qv) and not engine.add_lora(qv)
    assert engine.list_loras() == {qv.lora_int_id} and engine.lora_manager.stats()["disk_loads"] == 1
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, greedy(3), lora_request=qv)
    engine.step()
    assert engine.lora_requests_in_flight(qv.lora_int_id) == 1
    assert engine.lora_adapters_by_state() == (["qv"], [])
    with pytest.raises(ValueError, match="in flight"):
        engine.remove_lora(qv.lora_int_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert qv.lora_int_id in engine.lora_manager.resident_lora_ids
    assert engine.remove_lora(qv.lora_int_id) and not engine.remove_lora(qv.lora_int_id)
    manager = engine.lora_manager
    assert qv.lora_int_id not in manager.resident_lora_ids and manager.host_lora_ids == [] and not engine.list_loras()
    with pytest.raises(ValueError, match="removed"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(3), lora_request=qv)
    renewed = LoRARequest("qv", 99, qv.lora_path)
    before = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(3), lora_request=renewed)[0]
    assert before.outputs[0].token_ids == LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=64,
                                              enable_lora=True).generate({"prompt_token_ids": [5, 6, 7]}, greedy(3),
                                                                         lora_request=qv)[0].outputs[0].token_ids
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=16).engine.add_lora(qv)


def test_lora_modules_flag_spellings():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoRAModulePath("sql", "/a", "m")
    for bad, why in [("sql", "name=path"), ("=/a", "name"), ("sql=", "path"), ('{"name": "x"}', "path"),
                     ('{"name": "x", "path": "/a", "rank": 2}', "expected"), ("{bad json", "JSON")]:
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)
    from tokenmill.cli.main import main

    assert main(["serve", "--lora-modules", "a=/x"]) == 2  # needs --enable-lora: refused before any loading
    with pytest.raises(SystemExit):
        main(["serve", "--enable-lora", "--lora-modules", "nonsense"])
