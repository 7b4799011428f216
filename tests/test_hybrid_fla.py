"""Hybrid (Gated DeltaNet) models on the CUDA path: fla-core's kernels under our calling convention, the glue
around them, and the CUDA runner's state handling (docs/hybrid_models.md, "CUDA").

Without a GPU:
- the pure-torch glue: how a step's prefill requests are split into varlen kernel calls at state checkpoints
  (``fla_ops.plan_prefill_rounds``), and ``fla_ops.prefill`` with the torch reference kernel against the
  token-by-token rule (initial states, slots, checkpoints);
- the decode buffers' state-slot row (padding rows on the padding slot);
- the CUDA runner run on CPU with the reference attention backend (padded "graph-shaped" decode with state
  slots read from the static buffers, zeroing / checkpoint restores before and checkpoint saves after the
  step, chunked prefill, preemption, prefix hits): its tokens must equal the CPU ModelRunner's;
- when fla-core and triton are installed, fla's chunked and fused recurrent kernels run on CPU tensors under
  triton's interpreter (TRITON_INTERPRET=1) exactly as ``fla_ops`` calls them, against the torch reference in
  float32 (GVA heads, nonzero initial states, state carried across two calls, slots of a pool), and the whole
  CUDA runner with Triton attention and fla's kernels (``fla_ops.FORCE_ON_CPU``) equals the CPU runner.
  Under the interpreter two things are patched for these tests only: the autotuner keeps its first config
  (benchmarking needs a GPU driver) and ``range`` in fla's kernel modules yields ints with a ``.to()``
  (compiled kernels' loop variables are tensors; the interpreter's are plain ints).
On a GPU (benchmarks/gpu/h200_check.sh): the same kernel checks compiled, and a CUDA engine (graphs on and
off) against the CPU engine and transformers.
"""
from __future__ import annotations

import builtins
import collections
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; process-wide, harmless on CPU

from tests.offline_models import BOS_TOKEN_ID, EOS_TOKEN_ID, synthetic_tokenizer  # noqa: E402
from tests.test_cuda_runner_logic import _use_cuda_runner  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.linear_attention import fla_ops  # noqa: E402
from tokenmill.linear_attention.gated_delta_rule import decode_step, recurrent_gated_delta_rule  # noqa: E402
from tokenmill.linear_attention.state_cache import LinearStateMetadata  # noqa: E402
from tokenmill.runner.cuda_runner import CudaModelRunner  # noqa: E402
from tokenmill.runner.padded_decode import DecodeBuffers  # noqa: E402

try:
    import triton.language as triton_language
    from triton.runtime.interpreter import InterpretedFunction

    INTERPRETED = isinstance(triton_language.cdiv, InterpretedFunction)
except ImportError:
    triton_language, INTERPRETED = None, False
HAS_FLA = triton_language is not None and fla_ops.available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# fla-core is a CUDA extra: installed on a CPU machine it also becomes transformers' own Qwen3-Next / Qwen3.5
# kernel, which cannot run there. To run these tests on CPU put it on PYTHONPATH for this file only.
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="fla-core not importable (pip install 'tokenmill[fla]' on a CUDA "
                               "machine; on CPU: PYTHONPATH=<fla-core and einops installed with --target>)")
needs_interpreter = pytest.mark.skipif(not ON_CUDA and not INTERPRETED,
                                       reason="triton imported before TRITON_INTERPRET=1: see test_in_fresh_interpreter")
cpu_only = pytest.mark.skipif(ON_CUDA, reason="on a GPU the compiled path is tested instead")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


def _inputs(length: int, hk: int, hv: int, dk: int, dv: int, seed: int, device=DEVICE):
    """q, k [L, Hk, Dk] (normalised, q scaled), v [L, Hv, Dv], g, beta [L, Hv] as the layer makes them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(length, hk, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(length, hk, dk, generator=gen), dim=-1)
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen) * 1.5  # log-decay <= 0
    beta = torch.rand(length, hv, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta)]


def _expand(x: torch.Tensor, hv: int) -> torch.Tensor:
    return x.repeat_interleave(hv // x.shape[1], dim=1)


# ---- pure-torch glue (no triton, no fla) -------------------------------------------------------


def test_prefill_rounds_split_requests_at_their_checkpoints():
    qsl = np.array([0, 1, 11, 12, 30, 35])  # requests 1, 3 and 4 have several tokens; 0 and 2 are decodes
    rounds = fla_ops.plan_prefill_rounds(qsl, [1, 3, 4], {3: [(4, 7), (12, 9)], 4: [(5, 2)]})
    # request 3's chunk (tokens 12..30) is cut after 4 and 12 tokens; request 4's checkpoint is at its chunk's end
    assert len(rounds) == 3
    first, second, third = rounds
    assert first.reqs.tolist() == [1, 3, 4] and first.cu_seqlens.tolist() == [0, 10, 14, 19]
    assert first.token_idx.tolist() == [*range(1, 11), *range(12, 16), *range(30, 35)]
    assert first.saves == [(1, 7), (2, 2)]
    assert second.reqs.tolist() == [3] and second.token_idx.tolist() == list(range(16, 24)) and second.saves == [(0, 9)]
    assert third.reqs.tolist() == [3] and third.token_idx.tolist() == list(range(24, 30)) and third.saves == []
    assert fla_ops.plan_prefill_rounds(np.array([0, 1, 2]), [], {}) == []


def _step_meta(query_lens, slot_ids, saves, device=DEVICE) -> LinearStateMetadata:
    query_lens = np.asarray(query_lens)
    qsl = np.concatenate(([0], np.cumsum(query_lens)))
    decode = np.nonzero(query_lens == 1)[0]
    empty = torch.zeros(0)
    return LinearStateMetadata(
        conv_state=empty, recurrent_state=empty, slot_ids=torch.tensor(slot_ids, device=device), query_start_loc=qsl,
        num_computed=np.zeros(len(query_lens), dtype=np.int64), decode_reqs=torch.from_numpy(decode).to(device),
        decode_token_idx=torch.from_numpy(qsl[decode]).to(device), prefill_reqs=np.nonzero(query_lens > 1)[0].tolist(),
        saves=saves)


def _check_prefill(kernel, device, tol: float) -> float:
    """A step of three multi-token requests (one cut by two checkpoints) and a decode through ``fla_ops.prefill``
    with ``kernel``, against the token-by-token rule per request. Returns the largest difference."""
    hk, hv, dk, dv = 2, 4, 16, 8
    query_lens = [9, 1, 70, 2]
    slot_ids = [3, 0, 5, 1]
    saves = {2: [(30, 1), (64, 0)]}
    q, k, v, g, beta = _inputs(sum(query_lens), hk, hv, dk, dv, seed=1, device=device)
    pool = torch.randn(6, hv, dk, dv, generator=torch.Generator().manual_seed(2)).to(device) * 0.3
    ckpt = torch.zeros(2, hv, dk, dv, device=device)
    core = torch.full((sum(query_lens), hv, dv), float("nan"), device=device)
    before = pool.clone()
    fla_ops.prefill(q, k, v, g, beta, _step_meta(query_lens, slot_ids, saves, device), pool, ckpt, core, kernel)
    qsl = np.concatenate(([0], np.cumsum(query_lens)))
    worst = 0.0
    for r in (0, 2, 3):
        a, b = qsl[r], qsl[r + 1]
        want_o, want_s = recurrent_gated_delta_rule(_expand(q[a:b], hv), _expand(k[a:b], hv), v[a:b], g[a:b],
                                                    beta[a:b], before[slot_ids[r]])
        worst = max(worst, (core[a:b] - want_o).abs().max().item(), (pool[slot_ids[r]] - want_s).abs().max().item())
    for n, slot in saves[2]:  # the state after the first n tokens of request 2
        a = qsl[2]
        _, want_s = recurrent_gated_delta_rule(_expand(q[a:a + n], hv), _expand(k[a:a + n], hv), v[a:a + n],
                                               g[a:a + n], beta[a:a + n], before[5])
        worst = max(worst, (ckpt[slot] - want_s).abs().max().item())
    assert torch.isnan(core[qsl[1]]).all(), "the decode token is not prefill's to write"
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]]), "slots of no prefill request stay as they were"
    assert worst < tol, worst
    return worst


def test_prefill_glue_with_the_torch_kernel_is_the_recurrence():
    _check_prefill(fla_ops.reference_chunk_varlen, torch.device("cpu"), 1e-5)


def test_decode_buffers_put_padding_rows_on_the_padding_state_slot():
    buffers = DecodeBuffers(max_batch_size=8, max_blocks=4, block_size=4, padding_block_id=50,
                            device=torch.device("cpu"), reference_views=True)
    assert buffers.metadata(4).linear_state is None
    built = []
    buffers.set_linear_state(lambda slots: built.append(slots) or slots, padding_state_slot=9)
    assert buffers.state_slots.tolist() == [9] * 8
    meta = buffers.metadata(4)
    assert meta.linear_state is built[0] and meta is buffers.metadata(4)  # built once per bucket
    buffers.load(np.array([7, 9]), np.array([2, 6]), np.array([[4, 0], [1, 3]]), 4, np.array([0, 1]),
                 state_slots=np.array([3, 1]))
    assert meta.linear_state.tolist() == [3, 1, 9, 9]  # a view of the static buffer: sees each step's slots
    assert buffers.seq_lens[:4].tolist() == [3, 7, 1, 1]  # the other rows are laid out as before


VOCAB = 2000
HYBRID = dict(  # tests/test_hybrid_models.py's tiny hybrid, with a synthetic tokenizer (builds on the GPU machine too)
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)


def make_tiny_hybrid(out_dir) -> str:
    """A random float32 Qwen3.5 text checkpoint (Qwen3-Next where transformers has no Qwen3.5) written by
    transformers, with decays spread per head, and the synthetic tokenizer of tests/offline_models.py."""
    import json

    import transformers

    config_cls, arch, extra = getattr(transformers, "Qwen3_5TextConfig", None), "Qwen3_5ForCausalLM", {}
    if config_cls is None:
        config_cls, arch, extra = transformers.Qwen3NextConfig, "Qwen3NextForCausalLM", {"num_experts": 0}
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(architectures=[arch], **HYBRID, **extra),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
                layer.linear_attn.dt_bias.uniform_(-1.0, 1.0)
    model.save_pretrained(out_dir)
    synthetic_tokenizer(VOCAB).save_pretrained(out_dir)
    gen = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(gen) + "\n")
    return str(out_dir)


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("hybrid"))


def _workload(rng_seed: int):
    """Prompts of 1 to 40 tokens (shared prefixes for prefix hits), greedy, some with top-2 logprobs."""
    rng = np.random.default_rng(rng_seed)
    base = rng.integers(3, VOCAB, 30).tolist()
    prompts = [base[:1], rng.integers(3, VOCAB, 3).tolist(), base[:21], rng.integers(3, VOCAB, 9).tolist(),
               base + rng.integers(3, VOCAB, 10).tolist(), base[:26] + [7, 8], rng.integers(3, VOCAB, 14).tolist()]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, logprobs=2 if i % 2 else None)
              for i, m in enumerate(rng.integers(3, 12, len(prompts)))]
    return [{"prompt_token_ids": p} for p in prompts], params


def _swap_in_cuda_runner(llm: LLM, attention_backend: str) -> CudaModelRunner:
    """The engine's CPU ModelRunner replaced by the CUDA runner over the same model, with a fresh state pool."""
    runner = _use_cuda_runner(llm, attention_backend)
    engine = llm.engine  # a new state pool in the new runner, and the KV bookkeeping built over it
    engine.kv_cache_manager = engine.scheduler.kv_cache_manager = engine._build_kv_cache(
        engine.scheduler_config.max_model_len, None)
    assert runner.state_cache.padding_slot == runner.state_cache.slots.num_slots
    return runner


def _assert_same(got, want, tol: float) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    for g, w in zip(got, want):
        for pg, pw in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert pg.keys() == pw.keys()
            assert max(abs(pg[t].logprob - pw[t].logprob) for t in pw) < tol


def _run_cuda_runner_against_cpu(path: str, attention_backend: str, tol: float, **kwargs) -> LLM:
    kwargs = dict(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8, num_threads=1,
                  state_checkpoint_interval=2, **kwargs)  # a state checkpoint every 8 tokens
    prompts, params = _workload(0)
    want_llm = LLM(**kwargs)
    llm = LLM(**kwargs)
    runner = _swap_in_cuda_runner(llm, attention_backend)
    for half in (slice(0, 4), slice(4, None)):  # the second half hits the first half's prefixes
        got = llm.generate(prompts[half], params[half])
        _assert_same(got, want_llm.generate(prompts[half], params[half]), tol)
    assert max(o.num_cached_tokens for o in got) >= 16  # resumed from a state checkpoint
    assert runner.num_padded_decode_steps > 0 and runner.num_general_steps > 0
    llm.engine.check_integrity()
    slots = llm.engine.kv_cache_manager.state_slots
    assert slots.num_free_slots == slots.num_slots and len(slots.checkpoints) > 0
    return llm


@pytest.mark.parametrize("budget,num_kv_blocks", [(16, None), (64, 18)])
def test_cuda_runner_with_the_torch_rule_on_cpu_matches_the_cpu_runner(tiny_hybrid, budget, num_kv_blocks):
    """Chunked prefill with checkpoint saves inside chunks and at decode steps, prefix hits restoring them (16 and
    24 tokens reused), a one-token prompt, and (18 blocks) preemption: the CUDA runner's steps (reference
    attention, the linear layers' torch rule) give the CPU runner's tokens and cached-token counts."""
    llm = _run_cuda_runner_against_cpu(tiny_hybrid, "torch", 1e-5, max_num_batched_tokens=budget,
                                       num_kv_blocks=num_kv_blocks, max_model_len=64)
    if num_kv_blocks is not None:
        assert llm.engine.scheduler.num_preemptions_total > 0


# ---- fla-core's kernels (interpreted on CPU, compiled on CUDA) --------------------------------


@pytest.mark.skipif(ON_CUDA or INTERPRETED or not HAS_FLA, reason="the tests run in this process, or skip")
def test_in_fresh_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_fla_"],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


class _Int(int):
    """A loop index of an interpreted kernel: compiled kernels call ``.to(tl.int64)`` on theirs."""

    def to(self, *args, **kwargs):
        return self


def _interpreter_range(*args):
    for i in builtins.range(*args):
        yield _Int(i)


@pytest.fixture
def fla_kernels(monkeypatch):
    """On CPU, the two interpreter patches of the module docstring; on CUDA nothing."""
    if not ON_CUDA:
        from triton.runtime.autotuner import Autotuner

        prune = Autotuner.prune_configs
        monkeypatch.setattr(Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])
        for name, module in list(sys.modules.items()):
            if name.startswith("fla.ops"):
                monkeypatch.setattr(module, "range", _interpreter_range, raising=False)


@needs_fla
@needs_interpreter
def test_fla_chunk_kernel_matches_the_reference(fla_kernels):
    """``fla_ops.chunk_varlen`` (GVA heads unexpanded, scale 1, states [N, Hv, Dk, Dv]) on three sequences of 1,
    9 and 70 tokens from nonzero initial states, then a 70-token sequence as two calls carrying the state."""
    hk, hv, dk, dv = 2, 4, 16, 8
    lengths = [1, 9, 70]
    q, k, v, g, beta = _inputs(sum(lengths), hk, hv, dk, dv, seed=3)
    h0 = torch.randn(3, hv, dk, dv, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 0.5
    cu = torch.tensor([0, 1, 10, 80])
    o, final = fla_ops.chunk_varlen(q, k, v, g, beta, h0, cu.to(DEVICE), cu)
    assert o.shape == v.shape and final.shape == h0.shape and final.dtype == torch.float32
    worst = 0.0
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        want_o, want_s = recurrent_gated_delta_rule(_expand(q[a:b], hv), _expand(k[a:b], hv), v[a:b], g[a:b],
                                                    beta[a:b], h0[n])
        worst = max(worst, (o[a:b] - want_o).abs().max().item(), (final[n] - want_s).abs().max().item())
    a, b = 10, 80  # the 70-token sequence in two calls of 37 and 33 tokens, the state carried between them
    split = a + 37
    parts = []
    state = h0[2:3]
    for lo, hi in ((a, split), (split, b)):
        cu_part = torch.tensor([0, hi - lo])
        out, state = fla_ops.chunk_varlen(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state,
                                          cu_part.to(DEVICE), cu_part)
        parts.append(out)
    worst = max(worst, (torch.cat(parts) - o[a:b]).abs().max().item(), (state[0] - final[2]).abs().max().item())
    print(f"fla chunk_gated_delta_rule vs torch reference: max abs diff {worst:.3g}")
    assert worst < (1e-2 if ON_CUDA else 1e-5), worst  # TF32 dots on a GPU


@needs_fla
@needs_interpreter
def test_fla_recurrent_step_updates_the_pool_slots_like_the_reference(fla_kernels):
    """``fla_ops.recurrent_step`` on rows whose slots are scattered over a pool, three tokens in a row, against
    the batched torch decode step; slots of no row stay untouched."""
    hk, hv, dk, dv = 2, 4, 16, 8
    pool = torch.randn(6, hv, dk, dv, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 0.5
    slots = torch.tensor([2, 0, 5], device=DEVICE)
    ref_state = pool[slots].clone()
    untouched = pool[[1, 3, 4]].clone()
    worst = 0.0
    for step in range(3):
        q, k, v, g, beta = _inputs(3, hk, hv, dk, dv, seed=10 + step)
        o = fla_ops.recurrent_step(q, k, v, g, beta, pool, slots)
        want = decode_step(_expand(q, hv), _expand(k, hv), v, g, beta, ref_state)
        worst = max(worst, (o - want).abs().max().item(), (pool[slots] - ref_state).abs().max().item())
    assert torch.equal(pool[[1, 3, 4]], untouched)
    print(f"fla fused_recurrent_gated_delta_rule vs torch reference: max abs diff {worst:.3g}")
    assert worst < 1e-5, worst


@needs_fla
@needs_interpreter
def test_fla_prefill_glue_is_the_recurrence(fla_kernels):
    """``fla_ops.prefill`` with fla's kernel: the step of the torch-kernel glue test, same bound on CPU."""
    worst = _check_prefill(fla_ops.chunk_varlen, DEVICE, 1e-2 if ON_CUDA else 1e-5)
    print(f"fla prefill rounds vs token-by-token reference: max abs diff {worst:.3g}")


@cpu_only
@needs_fla
@needs_interpreter
def test_fla_cuda_runner_interpreted_matches_the_cpu_runner(tiny_hybrid, fla_kernels, monkeypatch):
    """The whole CUDA path on CPU: Triton attention and elementwise kernels and fla's gated delta rule kernels,
    all interpreted, over the same workload as the reference-backend test: the CPU runner's tokens."""
    monkeypatch.setattr(fla_ops, "FORCE_ON_CPU", True)
    calls = collections.Counter()
    for name in ("prefill", "recurrent_step"):  # the layers look both up on the module at each call
        fn = getattr(fla_ops, name)
        monkeypatch.setattr(fla_ops, name, lambda *a, _fn=fn, _name=name, **kw: calls.update([_name]) or _fn(*a, **kw))
    _run_cuda_runner_against_cpu(tiny_hybrid, "triton", 1e-4, max_num_batched_tokens=32, num_kv_blocks=64,
                                 max_model_len=64)
    assert calls["prefill"] > 0 and calls["recurrent_step"] > 0


# ---- on a GPU --------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_engine_matches_the_cpu_engine_and_transformers(tiny_hybrid, enforce_eager):
    """A float32 CUDA engine (graphs on: the decode graphs carry the state update) against the CPU engine: same
    greedy tokens, logprobs within 1e-2 (fla's prefill uses TF32 dots); and transformers' greedy continuation."""
    from transformers import AutoModelForCausalLM

    prompts, params = _workload(0)
    kwargs = dict(model=tiny_hybrid, dtype="float32", block_size=16, max_num_seqs=8, state_checkpoint_interval=1,
                  max_model_len=128)
    want = LLM(device="cpu", num_threads=4, **kwargs)
    llm = LLM(device="cuda", gpu_memory_utilization=0.2, enforce_eager=enforce_eager, **kwargs)
    runner = llm.engine.runner
    print(f"CUDA hybrid runner: {runner.kernel_choice}; fla-core {fla_ops.version()}")
    assert (runner.graphs is not None) != enforce_eager
    for half in (slice(0, 4), slice(4, None)):
        _assert_same(llm.generate(prompts[half], params[half]), want.generate(prompts[half], params[half]), 1e-2)
    assert runner.num_padded_decode_steps > 0
    llm.engine.check_integrity()
    # on the GPU: with fla-core installed transformers' own layers call its kernels, which need CUDA tensors
    hf = AutoModelForCausalLM.from_pretrained(tiny_hybrid, dtype=torch.float32).to("cuda").eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ids = prompt["prompt_token_ids"] + out.outputs[0].token_ids
            logits = hf(torch.tensor([ids], device="cuda")).logits[0, len(prompt["prompt_token_ids"]) - 1 : -1]
            ours = torch.tensor(out.outputs[0].token_ids, device="cuda")
            # transformers' argmax, or within 1e-3 of its top logit (a near-tie that rounding may flip)
            margin = logits.max(-1).values - logits.gather(1, ours[:, None])[:, 0]
            assert (margin <= 1e-3 * logits.abs().max()).all(), margin
