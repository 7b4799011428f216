"""Lean decode step: a decode-only or mixed (prompt chunks beside decode queries) step of a Llama-family model
with GGUF/int8 weights runs every decoder layer in one C call (csrc/lean_decode.c) instead of ~15 torch ops
and Python calls per layer.

At batch 1 a step's products read ~100 MB of 4-bit weights in a few milliseconds, so per-layer Python
and torch dispatch (hundreds of calls per step) are a large share of it. ``install_lean_decode`` (called
by the CPU runner in default mode) gives ``LlamaModel`` a ``LeanDecode``; for each step it either runs
the layers in C and returns the hidden states, or returns None and the torch path (the reference,
``tokenmill/models/llama.py``) runs. The C step calls the same compiled kernels as the torch path's
layers (qgemm, RMSNorm, SiLU×up, paged decode attention: function pointers into their libraries, for one
ISA path; each layer's sliding window, if any, passed to the attention kernels as its ``Attention`` passes it)
and holds every intermediate in the model dtype, so the two agree bit for bit wherever the layers run those
kernels. Taken only when the quantized kernel is the measured choice at the step's row
count and, for a step with prompt chunks, the C prefill attention kernel is (on large chunks the
dequantized GEMM wins and the per-layer overhead is small beside it); never with LoRA, a quantized KV cache,
deterministic mode (the runner does not install it) or dense weights. ``--no-cpu-kernels`` turns it off
with the other C kernels (docs/lean_decode.md).
"""
from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import torch

from tokenmill.attention import cpu_decode, cpu_prefill
from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.layers.rotary_embedding import RotaryEmbedding
from tokenmill.quantization import qgemm

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "lean_decode.c"
MAX_SEGMENTS = 4  # LD_MAX_SEGMENTS: format segments per fused projection
MAX_ADAPTIVE_ROWS = 8  # batch sizes up to this choose their thread count by timing (ThreadChoice)


class _Linear(ctypes.Structure):
    _fields_ = [("num_segments", ctypes.c_int32), ("qtype", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int64 * MAX_SEGMENTS), ("data", ctypes.c_void_p * MAX_SEGMENTS),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("sliding_window", ctypes.c_int64),  # 0: none
                ("qk_norm_whole", ctypes.c_int32), ("mlp_external", ctypes.c_int32),
                # a MoE block run in C (ld_layer.moe_in_c)
                ("moe_in_c", ctypes.c_int32), ("norm_topk", ctypes.c_int32), ("softmax_after_topk", ctypes.c_int32),
                ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("moe_slot", ctypes.c_int64),
                ("moe_model", ctypes.c_void_p), ("router_q", _Linear), ("router", ctypes.c_void_p),
                ("router_f32", ctypes.c_int32), ("shared_gate_up", _Linear), ("shared_down", _Linear),
                # multi-head latent attention (ld_model.mla)
                ("q_a", _Linear), ("kv_a", _Linear), ("q_a_norm", ctypes.c_void_p), ("kv_a_norm", ctypes.c_void_p),
                ("w_uk_t", ctypes.c_void_p), ("w_uv", ctypes.c_void_p), ("uv_stride", ctypes.c_int64)]


class _Kernels(ctypes.Structure):
    _fields_ = [("qlinear", ctypes.c_void_p), ("rms_norm", ctypes.c_void_p), ("silu_and_mul", ctypes.c_void_p),
                ("attention", ctypes.c_void_p), ("qlinear_bf16", ctypes.c_void_p), ("prefill", ctypes.c_void_p),
                ("moe_step", ctypes.c_void_p), ("moe_route", ctypes.c_void_p), ("dense_linear", ctypes.c_void_p),
                ("dense_linear_f32", ctypes.c_void_p), ("linear_heads", ctypes.c_void_p)]


class _Batch(ctypes.Structure):
    """ld_batch: a step's tokens and attention layout (pointers to int64 tensors the caller keeps alive)."""
    _fields_ = [("num_tokens", ctypes.c_int64), ("positions", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("num_decodes", ctypes.c_int64), ("decode_idx", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("max_blocks", ctypes.c_int64), ("seq_lens", ctypes.c_void_p), ("num_prefills", ctypes.c_int64),
                ("q_start", ctypes.c_void_p), ("q_len", ctypes.c_void_p), ("ctx_len", ctypes.c_void_p),
                ("prefill_table", ctypes.c_void_p), ("prefill_max_blocks", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64),
                ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("max_position", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("bf16", ctypes.c_int32), ("cos_sin", ctypes.c_void_p),
                ("layers", ctypes.POINTER(_Layer)), ("kernels", _Kernels), ("moe_c", ctypes.c_int32),
                ("moe_tables", ctypes.c_void_p), ("moe_counts", ctypes.c_void_p), ("moe_counts_stride", ctypes.c_int64),
                ("mla", ctypes.c_int32), ("rope_interleave", ctypes.c_int32), ("kv_lora_rank", ctypes.c_int64),
                ("qk_nope", ctypes.c_int64), ("qk_rope", ctypes.c_int64), ("v_head", ctypes.c_int64),
                ("q_lora_rank", ctypes.c_int64), ("latent_eps", ctypes.c_float)]


def _setup(lib: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    lib.ld_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Batch), p, p, ctypes.c_int, ctypes.c_int]
    lib.ld_step.restype = ctypes.c_int
    lib.ld_step_range.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Batch), p, p, p, ctypes.c_int64,
                                  ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.ld_step_range.restype = ctypes.c_int


# The step's library. It holds no SIMD code of its own: the kernels it calls carry the ISA path.
library = CLibrary(_SOURCE, "lean_decode", _setup, DEFAULT_FLAGS)
_built = library.built  # this process's build, or None
_load = library.load  # any ISA path's build, not cached (tests run the step on another path)
available = library.available


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def kernel_set(dtype: torch.dtype, isa: str | None = None) -> tuple[_Kernels, str] | None:
    """The kernels the step calls for ``dtype`` and their ISA path: this process's builds (``isa`` None, the
    ones the torch path's layers call) or builds for ``isa`` (tests run the step on another path). None when
    one of them cannot be built."""
    modules = (qgemm, batch_invariant, silu_and_mul_kernel, cpu_decode)
    libs = tuple(m.library.built() if isa is None else m.library.load(isa) for m in modules)
    if any(lib is None for lib in libs):
        return None
    q, bi, silu, attn = libs
    prefill = cpu_prefill.library.built() if isa is None else cpu_prefill.library.load(isa)
    suffix = "bf16" if dtype == torch.bfloat16 else "f32"
    kernels = _Kernels(qlinear=_address(q.qg_linear), rms_norm=_address(getattr(bi, f"bi_rms_norm_{suffix}")),
                       silu_and_mul=_address(getattr(silu, f"silu_and_mul_{suffix}")),
                       attention=_address(getattr(attn, f"paged_decode_{suffix}")),
                       qlinear_bf16=_address(q.qg_linear_bf16),
                       prefill=_address(getattr(prefill, f"paged_prefill_{suffix}")) if prefill is not None else None)
    from tokenmill.moe import cpu_experts

    moe = cpu_experts.library.built() if isa is None else cpu_experts.library.load(isa)
    if moe is not None:
        kernels.moe_step, kernels.moe_route = _address(moe.me_step), _address(moe.me_route)
        kernels.dense_linear = _address(getattr(bi, f"bi_linear_{suffix}"))
        kernels.dense_linear_f32 = _address(bi.bi_linear_f32)
    kernels.linear_heads = _address(getattr(bi, f"bi_linear_heads_{suffix}"))
    return kernels, q.qg_isa().decode()


def _linear(module, dtype: torch.dtype) -> tuple[_Linear, list[torch.Tensor]] | None:
    """The C description of a quantized ``Linear`` (and the tensors it points into), or None when the layer
    is not one the lean step runs (dense weight, too many format segments, a bias in another dtype)."""
    quant = getattr(module, "quant", None)
    if quant is None or len(quant.parts) > MAX_SEGMENTS:
        return None
    if module.bias is not None and (module.bias.dtype != dtype or not module.bias.is_contiguous()):
        return None
    desc = _Linear(num_segments=len(quant.parts))
    keep = []
    for i, part in enumerate(quant.parts):
        assert part.data.is_contiguous() and part.data.dtype == torch.uint8
        desc.qtype[i], desc.rows[i], desc.data[i] = part.qtype, part.shape[0], part.data.data_ptr()
        keep.append(part.data)
    if module.bias is not None:
        desc.bias = module.bias.data_ptr()
        keep.append(module.bias.data)
    return desc, keep


class ThreadChoice:
    """How many threads the lean step of one batch size runs with: the pool's (``torch.get_num_threads()``) or one.

    A decode step calls ~150 kernels, each ending in a barrier of its threads. When another process keeps
    one of two cores busy, every barrier waits for a descheduled thread and a batch-1 step on two threads
    becomes several times slower than on one (measured on the 2-core machine: RESULTS.md). The step's bits do
    not depend on the thread count (each kernel it calls computes a row with the same instructions whatever
    the threads), so it may switch at any step: the count with the lower moving average of the C call's
    time is used, and the other one is tried for one step after ``interval`` steps (16 at first, doubling
    each time the trial loses, at most 1024; back to 16 when it wins).
    """

    FIRST_INTERVAL = 16
    MAX_INTERVAL = 1024

    def __init__(self) -> None:
        self.average: dict[int, float] = {}  # seconds per step, by thread count
        self.current: int | None = None
        self.interval = self.FIRST_INTERVAL
        self.countdown = self.FIRST_INTERVAL

    def pick(self, pool: int) -> int:
        """The thread count of the next step (``pool``: the engine's thread count)."""
        if self.current not in (1, pool):  # first step, or the pool's size changed
            self.current, self.average = pool, {}
        if pool == 1:
            return 1
        other = 1 if self.current == pool else pool
        return other if self.countdown <= 0 else self.current

    def record(self, threads: int, seconds: float) -> None:
        """The C call of a step picked by ``pick`` took ``seconds`` on ``threads`` threads."""
        if threads != self.current:  # the trial step of the other count
            self.average[threads] = seconds
            if seconds < self.average.get(self.current, float("inf")):
                self.current, self.interval = threads, self.FIRST_INTERVAL
            else:
                self.interval = min(2 * self.interval, self.MAX_INTERVAL)
            self.countdown = self.interval
            return
        previous = self.average.get(threads)
        self.average[threads] = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        self.countdown -= 1


def step_batch(metadata, positions: torch.Tensor, num_blocks: int, mixed: bool) -> tuple[_Batch, tuple]:
    """The ld_batch of a step (``metadata``: its AttentionMetadata; ``positions`` [T] int64; ``num_blocks``: the
    KV pool's blocks per layer; ``mixed``: it has prompt chunks) and the tensors it points into, which the
    caller keeps alive over the C call."""
    num_tokens = positions.shape[0]
    positions, slot_mapping = positions.contiguous(), metadata.slot_mapping.contiguous()
    if mixed or metadata.query_start_loc.shape[0] != num_tokens + 1:
        # decode queries through decode_* (gathered in C), prompt chunks through prefill_tables
        tables = (metadata.decode_token_idx.contiguous(), metadata.decode_block_table.contiguous(),
                  metadata.decode_seq_lens.contiguous(), *metadata.prefill_tables)
        decode_idx, block_table, seq_lens, q_start, q_len, ctx_len, prefill_table = tables
        batch = _Batch(num_decodes=decode_idx.shape[0], decode_idx=decode_idx.data_ptr(),
                       num_prefills=q_start.shape[0], q_start=q_start.data_ptr(), q_len=q_len.data_ptr(),
                       ctx_len=ctx_len.data_ptr(), prefill_table=prefill_table.data_ptr(),
                       prefill_max_blocks=prefill_table.shape[1])
    else:  # decode-only: query b is token b
        tables = (metadata.block_table.contiguous(), metadata.seq_lens.contiguous())
        block_table, seq_lens = tables
        batch = _Batch(num_decodes=num_tokens)
    batch.num_tokens, batch.positions, batch.slot_mapping = num_tokens, positions.data_ptr(), slot_mapping.data_ptr()
    batch.num_blocks = num_blocks
    batch.block_table, batch.max_blocks, batch.seq_lens = block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr()
    return batch, (positions, slot_mapping, *tables)


class LeanDecode:
    """A LlamaModel's decode-only and mixed steps in one C call; built by ``install_lean_decode``.

    ``__call__(model, input_ids [T] int64, positions [T] int64, kv_caches, metadata)`` returns the final
    hidden states [T, hidden] (after the model's final norm, in the model dtype) or None when the step is
    not one the lean path takes (the caller then runs the torch layers). A step with prompt chunks (a prefill,
    or chunked prefill beside decode queries) is taken when the plan runs prompt chunks on the C prefill
    kernel (``Attention.cpu_prefill_kernel``) and the quantized product at the step's row count, as its
    layers would. ``enabled`` (default True) switches it off without uninstalling (tests and benchmarks
    compare both paths on one engine); ``steps`` counts the steps it ran, ``mixed_steps`` those with prompt
    chunks. Decode-only batches up to ``MAX_ADAPTIVE_ROWS`` pick their thread count with a ``ThreadChoice``
    each (``threads`` fixes it instead); other steps use the engine's.
    """

    enabled = True
    threads: int | None = None  # a fixed thread count for the C call (tests, benchmarks); None: ThreadChoice

    def __init__(self, lib: ctypes.CDLL, desc: _Model, described: tuple[ctypes.Array, list[torch.Tensor]],
                 rope: RotaryEmbedding, dtype: torch.dtype, probe, isa: str, weights_key: tuple[int, int],
                 prefill_kernel: bool = False) -> None:
        self._lib = lib
        self.isa = isa  # the kernels' ISA path
        self._desc = desc
        self._layers, self._keep = described  # the ctypes array desc.layers points into; the tensors it points at
        self._rope = rope  # its table's address is in desc; desc.max_position follows its filled rows
        self._weights_key = weights_key
        self.dtype = dtype
        self._probe = probe  # a quantized layer: its dequantize_table says which row counts take the kernel
        self._kv_key = None
        self._kv_ptrs = None
        self.steps = 0  # steps run here (tests check that the lean path was taken)
        self.mixed_steps = 0  # of which steps with prompt chunks
        self.moe_steps = 0  # of which steps that ran their MoE blocks in C (ld_layer.moe_in_c)
        self.prefill_kernel = prefill_kernel  # whether prompt chunks may run here (the C prefill kernel takes them)
        self.thread_choice: dict[int, ThreadChoice] = {}  # by batch size, up to MAX_ADAPTIVE_ROWS
        self._moe_layout()

    def _moe_layout(self) -> None:
        """Range ends and MoE bookkeeping from the description: ``_external`` ends a range after every external
        layer (the blocks' modules run them), ``_external_c`` only after those the step cannot run itself (when a
        step runs the moe_in_c blocks in C); ``_moe_slots`` the layers of the moe_in_c blocks, by moe_slot."""
        layers = [self._layers[i] for i in range(self._desc.num_layers)]
        self._external = tuple(i + 1 for i, d in enumerate(layers) if d.mlp_external)
        self._external_c = tuple(i + 1 for i, d in enumerate(layers) if d.mlp_external and not d.moe_in_c)
        slots = sorted((d.moe_slot, i) for i, d in enumerate(layers) if d.moe_in_c)
        self._moe_slots = [i for _, i in slots]
        width = max([layers[i].num_experts for i in self._moe_slots] or [1])
        self._moe_counts = torch.zeros(max(len(slots), 1), width, dtype=torch.int64)
        self._desc.moe_counts, self._desc.moe_counts_stride = self._moe_counts.data_ptr(), width
        self._moe_tables = None  # me_tables of the step, kept alive over the C call

    def _moe_in_c(self, model, num_tokens: int) -> bool:
        """Whether this step runs the moe_in_c blocks in C: the router's product at this many rows is the C GEMM
        (or GGUF blocks) and no expert's rows can be refused (``FusedExperts.may_refuse``), as their modules run."""
        if not self._moe_slots:
            return False
        block = model.layers[self._moe_slots[0]].mlp
        fused, gate = block.cpu_fused, block.gate
        table = gate.cpu_gemm_table
        if (gate.quant is None and not gate.float32  # a float32 router always runs the C GEMM (Router.c_logits)
                and not (gate.batch_invariant or (table and table[min(num_tokens, len(table) - 1)]))):
            return False
        if fused is None or isinstance(fused, str) or fused.may_refuse(num_tokens):
            return False
        self._moe_tables = fused.tables()
        self._desc.moe_tables = ctypes.addressof(self._moe_tables)
        return True

    def _record_moe(self, model) -> None:
        """The step's tokens per expert of the MoE layers run in C, into their blocks' expert-load counters."""
        for slot, index in enumerate(self._moe_slots):
            block = model.layers[index].mlp
            if block.expert_load is not None:
                block.expert_load.record(block.moe_index, self._moe_counts[slot, :block.num_experts])

    def _kv_pointers(self, kv_caches) -> ctypes.Array | None:
        first = kv_caches[0][0]
        if type(first) is not torch.Tensor or first.dtype != self.dtype or len(kv_caches) != self._desc.num_layers:
            return None  # a quantized KV cache (QuantizedKVCache), or not this model's caches
        key = (id(kv_caches), first.data_ptr())
        if key != self._kv_key:  # the pool moved (RL sleep/wake) or another pool: pointers again
            ptrs = (ctypes.c_void_p * (2 * len(kv_caches)))()
            for i, (k, v) in enumerate(kv_caches):
                if not (k.is_contiguous() and v.is_contiguous()):
                    return None
                ptrs[2 * i], ptrs[2 * i + 1] = k.data_ptr(), v.data_ptr()
            self._kv_key, self._kv_ptrs = key, ptrs
        return self._kv_ptrs

    def __call__(self, model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, metadata) -> torch.Tensor | None:
        if not self.enabled:
            return None
        num_tokens = input_ids.shape[0]
        if num_tokens == 0 or metadata.linear_state is not None or metadata.prefill_count is not None:
            return None
        mixed = metadata.num_prefills > 0
        if mixed and not (self.prefill_kernel and model.layers[0].self_attn.attn.prefill_kernel_takes(metadata)):
            return None  # prompt chunks: the plan keeps them (or these long ones) on SDPA, or the kernel lacks the head_dim
        table = self._probe.dequantize_table
        rows = metadata.dispatch_rows or num_tokens  # a verify step: the batch plain decoding would run
        if table and table[min(rows, len(table) - 1)]:
            return None  # the measured plan dequantizes for torch's GEMM at this many rows
        amx_table = self._probe.amx_bf16_table  # the plan's AMX bf16 products at this many rows, as the layers
        amx = int(bool(amx_table) and amx_table[min(rows, len(amx_table) - 1)])
        if _weights_key(model.layers) != self._weights_key:  # parameters reallocated (RL wake-up): describe again
            described = _describe(list(model.layers), self.dtype)
            if isinstance(described, str):
                self.enabled = False
                return None
            self._layers, self._keep = described
            self._desc.layers = ctypes.cast(self._layers, ctypes.POINTER(_Layer))
            self._weights_key = _weights_key(model.layers)
            self._moe_layout()
        ptrs = self._kv_pointers(kv_caches)
        if ptrs is None:
            return None
        rope = self._rope
        if rope.rows_ready == 0:  # no engine has fitted the table (set_max_model_len): all of it, as forward does
            rope.fill_rows(rope.max_position_embeddings)
        self._desc.max_position = rope.rows_ready  # a position past the filled rows: the torch path (which raises)
        hidden = model.embed_tokens(input_ids).contiguous()  # (T, hidden), overwritten by the C call
        batch, keep = step_batch(metadata, positions, kv_caches[0][0].shape[0], mixed)  # keep: alive over the call
        pool = torch.get_num_threads()
        choice = None
        if self.threads is None and num_tokens <= MAX_ADAPTIVE_ROWS and not mixed:
            choice = self.thread_choice.setdefault(num_tokens, ThreadChoice())
        threads = self.threads or (pool if choice is None else choice.pick(pool))
        start = time.perf_counter()
        if self._external:  # MoE layers: in C where it can (moe_c), else C up to each block, which runs here
            moe_c = self._moe_in_c(model, num_tokens)
            self._desc.moe_c = int(moe_c)
            if moe_c:
                self._moe_counts.zero_()
            hidden, rc = self._run_ranges(model, batch, ptrs, hidden, threads, amx,
                                          self._external_c if moe_c else self._external)
            # (a -3 from a later MoE layer sends the step to the torch path: the blocks that ran as modules before
            # it have recorded their counts once already, which the torch path records again; FusedExperts.may_refuse
            # keeps such steps off this path)
            if rc == 0 and moe_c:
                self._record_moe(model)
                self.moe_steps += 1
        else:
            rc = self._lib.ld_step(ctypes.byref(self._desc), ctypes.byref(batch), ptrs, hidden.data_ptr(), threads,
                                   amx)
        if choice is not None and rc == 0:
            choice.record(threads, time.perf_counter() - start)
        if rc == -2:
            raise MemoryError("lean step: scratch memory could not be allocated")
        if rc != 0:
            return None  # e.g. a position past the RoPE cache: the torch path raises its own error
        self.steps += 1
        self.mixed_steps += mixed
        return model.norm(hidden)

    def _run_ranges(self, model, batch: _Batch, ptrs, hidden: torch.Tensor, threads: int,
                    amx: int, ends: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        """The step with external-MLP layers (MoE): C from one such layer's successor through the next one's
        attention block, then that layer's MLP module on the returned RMSNorm(h), added to h as
        LlamaDecoderLayer does (``out = mlp(norm(h)); out.add_(h)``). Returns (hidden, ld_step_range's code)."""
        xn = torch.empty_like(hidden)
        first = 0
        for end in (*ends, self._desc.num_layers):
            if end <= first:
                continue
            rc = self._lib.ld_step_range(ctypes.byref(self._desc), ctypes.byref(batch), ptrs, hidden.data_ptr(),
                                         xn.data_ptr(), first, end, threads, amx)
            if rc != 0:
                return hidden, rc
            ran_in_c = self._desc.moe_c and self._layers[end - 1].moe_in_c
            if self._layers[end - 1].mlp_external and not ran_in_c:
                out = model.layers[end - 1].mlp(xn)  # (T, hidden)
                out.add_(hidden)
                hidden = out.contiguous()
            first = end
        return hidden, 0


def _describe(layers, dtype: torch.dtype) -> tuple[ctypes.Array, list[torch.Tensor]] | str:
    """The C description of ``layers`` (LlamaDecoderLayers) and the tensors it points into, or why the lean
    step cannot run them."""
    keep: list = []
    keep_blocks: list = []  # the MoE blocks run in C, in moe_slot order
    descs = (_Layer * len(layers))()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        external = not hasattr(mlp, "gate_up_proj")  # a MoE block: the step leaves it to its module
        latent = hasattr(attn, "kv_b_proj")  # multi-head latent attention (models/deepseek.py)
        q_proj = (attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj) if latent else attn.qkv_proj
        projections = (q_proj, attn.o_proj) if external else (q_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        parts = [_linear(m, dtype) for m in projections]
        if any(p is None for p in parts):
            return f"layer {i} has a dense projection (the lean step runs quantized GGUF/int8 weights only)"
        for _, tensors in parts:
            keep.extend(tensors)
        d = descs[i]
        d.qkv, d.o = parts[0][0], parts[1][0]
        if latent:
            why = _describe_latent(attn, dtype, d, keep)
            if why is not None:
                return f"layer {i}: {why}"
        if external:
            d.mlp_external = 1
            in_c = _describe_moe(mlp, dtype, d, len(keep_blocks))
            if in_c is not None:
                keep.extend(in_c)
                keep_blocks.append(mlp)
        else:
            d.gate_up, d.down = parts[2][0], parts[3][0]
        d.qk_norm_whole = int(bool(getattr(attn, "qk_norm_whole", False)))
        d.input_norm = layer.input_layernorm.weight.data_ptr()
        d.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        d.sliding_window = attn.attn.sliding_window or 0  # the kernels take it as the torch path's layers do
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is not None:
            d.q_norm, d.k_norm = q_norm.weight.data_ptr(), k_norm.weight.data_ptr()
        keep.extend(n.weight.data for n in (layer.input_layernorm, layer.post_attention_layernorm, q_norm,
                                            k_norm) if n is not None)
    return descs, keep


def _describe_latent(attn, dtype: torch.dtype, d: _Layer, keep: list) -> str | None:
    """Fill ``d``'s multi-head latent attention fields from ``attn`` (a LatentAttention): q_a / kv_a products,
    the latent norms, W_UK^T and W_UV (``LatentProjection``, in the model dtype). Returns why not, or None."""
    projections = [attn.kv_a_proj_with_mqa] + ([attn.q_a_proj] if attn.q_lora_rank is not None else [])
    parts = [_linear(m, dtype) for m in projections]
    if any(p is None for p in parts):
        return "a dense latent projection (the lean step runs quantized GGUF/int8 weights only)"
    for _, tensors in parts:
        keep.extend(tensors)
    d.kv_a = parts[0][0]
    if attn.q_lora_rank is not None:
        d.q_a, d.q_a_norm = parts[1][0], attn.q_a_layernorm.weight.data_ptr()
        keep.append(attn.q_a_layernorm.weight.data)
    proj = attn.kv_b_proj
    if proj.weight.dtype != dtype or not proj.weight.is_contiguous():
        return "kv_b_proj is not a contiguous weight of the model dtype"
    w_uk_t, w_uv = proj.uk_t(), proj.uv_heads()
    d.kv_a_norm, d.w_uk_t, d.w_uv, d.uv_stride = (attn.kv_a_layernorm.weight.data_ptr(), w_uk_t.data_ptr(),
                                                  w_uv.data_ptr(), w_uv.stride(0))
    keep.extend((attn.kv_a_layernorm.weight.data, w_uk_t, proj.weight.data))
    return None


def _describe_moe(block, dtype: torch.dtype, d: _Layer, slot: int) -> list | None:
    """Fill ``d``'s MoE fields when the step can run ``block`` (a SparseMoeBlock) itself, as its module runs on
    CPU: experts in the fused C step, a softmax router ``cpu_experts.route`` implements, at most an ungated
    shared expert in GGUF/int8 blocks, a router that is GGUF blocks or a dense weight of the model dtype (or
    float32 for a ``router_float32`` block; no bias, no LoRA). Returns what the description points into (kept
    alive by the caller), or None (the block's module runs it)."""
    from tokenmill.moe import cpu_experts

    probe = torch.empty(0, block.moe_config.hidden_size, dtype=dtype)
    fused = block.fused_experts(probe)
    gate = block.gate
    if (fused is None or not block.routes_in_c(probe) or block.shared_expert_gate is not None
            or gate.bias is not None or gate.lora is not None or not cpu_experts.library.available()):
        return None
    keep: list = [fused]
    if block.shared_expert is not None:  # an ungated shared expert (DeepSeek), added to the routed output
        shared = [_linear(m, dtype) for m in (block.shared_expert.gate_up_proj, block.shared_expert.down_proj)]
        if any(p is None for p in shared):
            return None
        d.shared_gate_up, d.shared_down = shared[0][0], shared[1][0]
        keep.extend(t for _, tensors in shared for t in tensors)
    if gate.quant is not None:
        router = _linear(gate, dtype)
        if router is None:
            return None
        d.router_q = router[0]
        keep.extend(router[1])
    else:
        f32 = gate.float32  # Router.c_logits: float32 inputs and weight
        if gate.weight.dtype != (torch.float32 if f32 else dtype) or not gate.weight.is_contiguous():
            return None
        d.router, d.router_f32 = gate.weight.data_ptr(), int(f32)
        keep.append(gate.weight.data)
    config = gate.config
    d.moe_in_c, d.norm_topk, d.softmax_after_topk = 1, int(config.norm_topk_prob), int(config.softmax_after_topk)
    d.num_experts, d.top_k, d.moe_slot, d.moe_model = config.num_experts, config.top_k, slot, fused.address
    return keep


def _weights_key(layers) -> tuple[int, int]:
    """Where the first and last layers' norm weights live: RL sleep frees and reallocates every parameter
    (tokenmill/rl/engine_ops.py), after which the description's pointers are rebuilt."""
    return layers[0].input_layernorm.weight.data_ptr(), layers[-1].post_attention_layernorm.weight.data_ptr()


def install_lean_decode(model, dtype: torch.dtype, block_size: int, isa: str | None = None) -> str | None:
    """Give ``model`` (a ``LlamaForCausalLM`` or subclass) a ``LeanDecode`` for its decode and mixed steps.

    ``isa``: run the step on the kernels built for that path (tests; default: this process's builds, which
    the torch path's layers call). Returns None when installed, else why not (a dense or oddly fused layer,
    a dtype other than float32 / bfloat16, norms with different eps, a model that is not a plain
    Llama-family stack, or a library that cannot be built). Uninstalls a previous one first.
    """
    from tokenmill.models.deepseek import LatentAttention
    from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
    from tokenmill.moe import SparseMoeBlock

    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel):
        return "not a Llama-family decoder stack"
    inner.lean_decode = None
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    layers = list(inner.layers)
    attn_type = type(layers[0].self_attn) if layers else None
    if (not layers or attn_type not in (LlamaAttention, LatentAttention)
            or any(type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not attn_type
                   or type(layer.mlp) not in (LlamaMLP, SparseMoeBlock) for layer in layers)):
        return "decoder layers other than LlamaDecoderLayer"
    attn0 = layers[0].self_attn
    mla = attn_type is LatentAttention
    if any(layer.self_attn.attn.logit_softcap is not None for layer in layers):
        return "attention logit soft-capping (the lean step does not cap)"
    eps = layers[0].input_layernorm.variance_epsilon
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                             getattr(layer.self_attn, "q_norm", None),
                                             getattr(layer.self_attn, "k_norm", None)) if n is not None]
    latent_norms = [n for layer in layers if mla for n in (layer.self_attn.kv_a_layernorm,
                                                           getattr(layer.self_attn, "q_a_layernorm", None))
                    if n is not None]
    latent_eps = latent_norms[0].variance_epsilon if latent_norms else eps
    if (any(n.variance_epsilon != eps for n in norms) or any(n.variance_epsilon != latent_eps for n in latent_norms)
            or any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms + latent_norms)):
        return "RMSNorms with different eps or dtypes"
    head_dim = attn0.latent_dim if mla else attn0.head_dim  # the cached vector's width (MLA: one KV head)
    rope = inner.rotary_emb
    cache = rope.cos_sin_table  # its address only: the rows are filled before a step reads them (LeanDecode)
    if (cache.dtype != torch.float32 or not cache.is_contiguous()
            or cache.shape[1] != (attn0.qk_rope_head_dim if mla else attn0.head_dim)):
        return "a RoPE cache the lean step cannot read"
    described = _describe(layers, dtype)
    if isinstance(described, str):
        return described
    lib = library.built() if isa is None else library.load(isa)
    kernels = kernel_set(dtype, isa)
    if lib is None or kernels is None:
        return "the lean decode library or a kernel it calls cannot be built here"
    prefill = cpu_prefill.library.built() if isa is None else cpu_prefill.library.load(isa)
    prefill_kernel = prefill is not None and head_dim % prefill.paged_prefill_vector_width() == 0
    if not prefill_kernel:
        kernels[0].prefill = None
    desc = _Model(num_layers=len(layers), hidden=inner.embed_tokens.embedding_dim, num_heads=attn0.num_heads,
                  num_kv_heads=1 if mla else attn0.num_kv_heads, head_dim=head_dim,
                  intermediate=max([layer.mlp.down_proj.in_features for layer in layers
                                    if type(layer.mlp) is LlamaMLP] or [1]), block_size=block_size,
                  max_position=rope.rows_ready, eps=eps, scale=attn0.attn.scale, bf16=int(dtype == torch.bfloat16),
                  cos_sin=cache.data_ptr(), layers=described[0], kernels=kernels[0])
    if mla:
        desc.mla, desc.rope_interleave, desc.latent_eps = 1, int(attn0.rope_interleave), latent_eps
        desc.kv_lora_rank, desc.qk_nope, desc.qk_rope = (attn0.kv_lora_rank, attn0.qk_nope_head_dim,
                                                         attn0.qk_rope_head_dim)
        desc.v_head, desc.q_lora_rank = attn0.v_head_dim, int(attn0.q_lora_rank or 0)
    probe = (attn0.kv_a_proj_with_mqa if mla else attn0.qkv_proj).quant
    inner.lean_decode = LeanDecode(lib, desc, described, rope, dtype, probe, kernels[1], _weights_key(layers),
                                   prefill_kernel)
    return None
