"""KVPool: the paged KV memory of one runner, and the only code that knows its layout.

The pool holds the K/V tensor ``kv`` ``(layers, planes, num_blocks, block_size, kv_heads, head_dim)`` in the KV
dtype (the model's dtype, or int8 / float8 e4m3 codes) and, for a quantized KV cache, ``scales``
``(layers, planes, num_blocks, block_size, kv_heads)`` float16, one per vector. ``planes`` is 2 (K and V) for
every model but those with multi-head latent attention (DeepSeek-V2/V3, docs/moe.md), whose one plane holds per
token the latent ``kv_lora_rank + qk_rope_head_dim`` vector (``kv_heads`` 1) that attention reads as both K and V. Everything that moves whole blocks
(the RAM and disk tiers, session save and restore, prefill/decode KV transfer) goes through ``gather`` /
``scatter`` and sees a block as ``block_bytes`` bytes: the block's K/V in ``(layers, planes, block_size, kv_heads,
head_dim)`` order, then its scales in ``(layers, planes, block_size, kv_heads)`` order when it has them. So a block
is one byte row whatever the KV dtype, and a new copy site never needs to know about scales. ``split`` /
``join`` turn rows into the two typed tensors and back (the session file keeps them as tensors).

``release`` / ``restore`` give the memory back while the engine sleeps (tokenmill/rl) and make it again,
zeroed, keeping every view of the tensors (per-layer caches, CUDA graphs are rebuilt by their owner) valid.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tokenmill.huge_pages import Prefault, is_mapped, release_pages, zeros_on_huge_pages


class KVPool:
    """The KV tensor, its scales and the block layout.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the pool's shape (``num_blocks`` counts
            any padding blocks too).
        dtype: the KV dtype (``kv``'s element type).
        device: where the pool lives.
        scale_dtype: the per-vector scales' dtype for a quantized KV cache, else None (no scales).
        num_planes: 2 (K and V), or 1 (a latent read as both: multi-head latent attention).

    Raises:
        MemoryError / RuntimeError: the memory cannot be allocated.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, scale_dtype: torch.dtype | None = None,
                 num_planes: int = 2) -> None:
        assert num_planes in (1, 2), num_planes
        device = torch.device(device)
        shape = (num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim)
        # Scattered block reads: huge pages mean fewer TLB misses. Advised 2 MiB at a time by the idle prefault,
        # so a step that first writes a page never waits for compaction (huge_pages.zeros_on_huge_pages).
        kv = zeros_on_huge_pages(shape, dtype, device, advise=False)
        self._adopt(kv, None if scale_dtype is None else torch.zeros(shape[:-1], dtype=scale_dtype, device=device))
        # A hybrid model's linear-attention state pool (``LinearStateCache``: live slots, prefix-cache
        # checkpoints), set by the runner when it allocates it (``allocate_state_cache``); None otherwise.
        self.state = None
        self._prefault = self._start_prefault()

    def _adopt(self, kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Take ``kv`` (and ``scales``) as the pool's tensors and derive the block layout from their shape."""
        self.device, self.kv, self.scales = kv.device, kv, scales
        layers, planes, self.num_blocks, block_size, heads, dim = kv.shape
        self.block_shape = (layers, planes, block_size, heads, dim)
        self.kv_block_bytes = math.prod(self.block_shape) * kv.element_size()
        self.scale_block_bytes = 0 if scales is None else math.prod(self.block_shape[:-1]) * scales.element_size()
        self.block_bytes = self.kv_block_bytes + self.scale_block_bytes
        self._released: dict[str, int | None] = {}

    def step_started(self) -> None:
        """An engine step starts: the background prefault (if any) waits until the engine is idle again."""
        if self._prefault is not None:
            self._prefault.step_started()

    def step_ended(self) -> None:
        """The engine step ended (``step_started``)."""
        if self._prefault is not None:
            self._prefault.step_ended()

    def _start_prefault(self) -> Prefault | None:
        """Fault the K/V mapping's pages in behind the engine's back (``huge_pages.Prefault``), so no step pays
        for first touches; None for a pool that is not its own mapping."""
        return Prefault(self.kv, advise=True) if is_mapped(self.kv) else None

    @classmethod
    def over(cls, kv: torch.Tensor, scales: torch.Tensor | None = None) -> KVPool:
        """A pool over existing tensors (``kv`` ``(layers, planes, num_blocks, block_size, kv_heads, head_dim)``,
        planes 2 or 1, ``scales`` the same without ``head_dim``), e.g. a test's or a draft model's; they are not
        copied.

        Raises:
            ValueError: ``kv`` is not 6-D with 1 or 2 planes, or ``scales`` does not match it.
        """
        if (kv.dim() != 6 or kv.shape[1] not in (1, 2)
                or (scales is not None and tuple(scales.shape) != tuple(kv.shape[:-1]))):
            raise ValueError(f"KVPool.over needs kv (layers, 1 or 2, blocks, block_size, heads, dim) and matching scales, "
                             f"got {list(kv.shape)} and {None if scales is None else list(scales.shape)}")
        pool = cls.__new__(cls)
        pool._adopt(kv, scales)
        pool._prefault = None
        pool.state = None
        return pool

    @property
    def num_planes(self) -> int:
        """2 (K and V), or 1 (the latent of multi-head latent attention, read as both)."""
        return self.block_shape[1]

    def layer_planes(self, tensor: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (K, V) views of ``tensor`` (``kv`` or ``scales``): ``[num_blocks, block_size, kv_heads(,
        head_dim)]`` each; with one plane both are the same latent view."""
        return tensor[layer, 0], tensor[layer, self.num_planes - 1]

    @property
    def dtype(self) -> torch.dtype:
        """The KV dtype."""
        return self.kv.dtype

    @property
    def dtype_name(self) -> str:
        """The KV dtype as metadata spells it (``bfloat16``, ``int8``, ``float8_e4m3fn``)."""
        return str(self.kv.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (K/V and scales)."""
        return self.num_blocks * self.block_bytes

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies of blocks as byte rows: uint8 ``[len(block_ids), block_bytes]`` on the pool's device."""
        ids = self._ids(block_ids)
        n = ids.numel()
        # (layers, planes, n, block_size, heads, dim) -> (n, layers, planes, block_size, heads, dim)
        source = self.kv.view(torch.uint8) if self.kv.element_size() == 1 else self.kv  # float8 codes as bytes
        kv = source.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        kv = kv.reshape(n, math.prod(self.block_shape)).view(torch.uint8)
        if self.scales is None:
            return kv
        scales = self.scales.index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous()
        return torch.cat((kv, scales.reshape(n, math.prod(self.block_shape[:-1])).view(torch.uint8)), dim=1)

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Write byte rows (uint8 ``[len(block_ids), block_bytes]``, on any device) into blocks.

        Raises:
            ValueError: rows of another width or count.
        """
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape != (len(block_ids), self.block_bytes):
            raise ValueError(f"scatter needs uint8 rows [{len(block_ids)}, {self.block_bytes}], got "
                             f"{rows.dtype} {list(rows.shape)}")
        if not len(block_ids):
            return
        kv, scales = self.split(rows.to(self.device))
        ids = self._ids(block_ids)
        if self.kv.element_size() == 1:  # int8 / float8 codes: copied as bytes (no float8 index_copy_ on CPU)
            self.kv.view(torch.uint8).index_copy_(2, ids, kv.view(torch.uint8).permute(1, 2, 0, 3, 4, 5))
        else:
            self.kv.index_copy_(2, ids, kv.permute(1, 2, 0, 3, 4, 5))
        if self.scales is not None:
            self.scales.index_copy_(2, ids, scales.permute(1, 2, 0, 3, 4))

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Byte rows -> (K/V ``[n, *block_shape]`` in the KV dtype, scales ``[n, *block_shape[:-1]]`` or None),
        views where the layout allows."""
        n = rows.shape[0]
        kv = rows[:, : self.kv_block_bytes].contiguous().view(self.kv.dtype).view(n, *self.block_shape)
        if self.scales is None:
            return kv, None
        scales = rows[:, self.kv_block_bytes:].contiguous().view(self.scales.dtype).view(n, *self.block_shape[:-1])
        return kv, scales

    def join(self, kv: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """(K/V ``[n, *block_shape]``, scales or None) -> byte rows ``[n, block_bytes]`` (the inverse of ``split``).

        Raises:
            ValueError: tensors of another dtype or shape than this pool's blocks, or scales missing/extra.
        """
        n = kv.shape[0]
        if kv.dtype != self.kv.dtype or tuple(kv.shape[1:]) != self.block_shape:
            raise ValueError(f"blocks must be {self.dtype_name} {[n, *self.block_shape]}, got "
                             f"{str(kv.dtype).removeprefix('torch.')} {list(kv.shape)}")
        rows = kv.contiguous().reshape(n, math.prod(self.block_shape)).view(torch.uint8)
        if (scales is None) != (self.scales is None):
            raise ValueError("scales are needed exactly when the KV cache is quantized (int8/fp8)")
        if scales is None:
            return rows
        if scales.dtype != self.scales.dtype or tuple(scales.shape) != (n, *self.block_shape[:-1]):
            raise ValueError(f"scales must be {self.scales.dtype} {[n, *self.block_shape[:-1]]}, got "
                             f"{scales.dtype} {list(scales.shape)}")
        flat = scales.contiguous().reshape(n, math.prod(self.block_shape[:-1])).view(torch.uint8)
        return torch.cat((rows, flat.to(rows.device)), dim=1)

    def release(self) -> None:
        """Give the pool's memory back (sleep): a CPU pool of its own mapping drops its pages in place
        (it reads as zeros), any other storage shrinks to nothing. Views stay valid; no-op when released. A hybrid
        model's state pool (``state``, small) is kept."""
        if self._released:
            return
        if self._prefault is not None:
            self._prefault.stop()
        for name in ("kv", "scales"):
            tensor = getattr(self, name)
            if tensor is None:
                continue
            if is_mapped(tensor):
                release_pages(tensor)
                self._released[name] = None
            else:
                storage = tensor.untyped_storage()
                self._released[name] = storage.nbytes()
                storage.resize_(0)

    def restore(self) -> None:
        """Make the memory ``release`` gave back, zeroed (wake up). No-op when not released."""
        for name, nbytes in self._released.items():
            if nbytes is not None:  # None: released pages, already reading as zeros
                tensor = getattr(self, name)
                tensor.untyped_storage().resize_(nbytes)
                tensor.zero_()
        if self._released:
            self._prefault = self._start_prefault()
        self._released = {}

    @property
    def released(self) -> bool:
        """Whether the memory is given back (between ``release`` and ``restore``)."""
        return bool(self._released)
