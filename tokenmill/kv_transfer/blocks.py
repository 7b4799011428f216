"""Moving whole KV blocks in and out of an engine's pool, with the facts that decide whether a block
may be used elsewhere (``KVBlockMeta``). Engine thread only, between steps.

Used by session save/restore (``session.py``); the KV transfer connectors use the same export and
import. A block is the pool's unit: ``(layers, 2, block_size, kv_heads, head_dim)`` of K and V.
Only full blocks travel, indexed by the prefix cache's chained hashes, so an imported block is an
ordinary prefix-cache entry: a later request whose prompt starts with those tokens hits it.

Hybrid (linear-attention) models: the prefix cache's state checkpoints held for the exported blocks travel with
them (``state``: ``state_conv`` / ``state_recurrent`` tensors, ``KVBlockMeta.state_blocks`` says which blocks they
belong to) and are installed as checkpoints on import, so a hit on restored blocks resumes from them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch

from tokenmill.kv_cache.block_hash import extend_block_hashes

FORMAT_VERSION = 1  # KV blocks only
KV_SCALES = "kv_scales"  # the name of an int8/fp8 KV cache's scales among the exported tensors
FORMAT_VERSION_STATE = 2  # KV blocks and linear-attention state checkpoints (hybrid models)


class KVBlocksError(ValueError):
    """Blocks that cannot be used here (other model, dtype, block size, shape, corrupt data) or cannot
    be made (not cached, no room); ``param`` names the field at fault for a 4xx answer."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.param, self.status_code = param, status_code


@dataclass(frozen=True)
class KVBlockMeta:
    """What a set of exported blocks is: enough to refuse them where they do not belong.

    token_ids: the tokens the blocks hold (``num_blocks * block_size`` of them; the tokens of a trailing
        partial block are not included). block_hashes: their chained prefix-cache hashes (hex strings,
        so JSON readers without 64-bit integers keep them). extra_keys: what was hashed with them
        (``cache_salt``, ``lora:<adapter digest>``). model_fingerprint: ``kv_offload.fingerprint``'s
        sha256 of weights, config, compute dtype, block size and KV dtype. tokenizer_fingerprint: sha256
        of the tokenizer's serialised vocabulary and rules. block_shape: one block's
        ``(layers, 2, block_size, kv_heads, head_dim)``. sha256: of the blocks' bytes in order (each block's
        ``KVPool`` byte row: K/V, then an int8/fp8 cache's scales).
        state_blocks: (format version 2, hybrid models) indices of the blocks whose state checkpoint (the
        linear layers' state after that block) travels with them, ascending; state_sha256: of the
        ``state_conv`` then ``state_recurrent`` tensors' bytes.
    """

    format_version: int
    token_ids: list[int]
    block_hashes: list[str]
    extra_keys: list
    lora_name: str | None
    model_fingerprint: str
    tokenizer_fingerprint: str
    kv_dtype: str
    block_size: int
    block_shape: list[int]
    sha256: str
    state_blocks: list[int] = field(default_factory=list)
    state_sha256: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> KVBlockMeta:
        """Raises KVBlocksError: not this format (or another version of it)."""
        try:
            raw = json.loads(text)
            version = raw.get("format_version")
            if version not in (FORMAT_VERSION, FORMAT_VERSION_STATE):
                raise KVBlocksError(f"format_version {version!r} is not {FORMAT_VERSION} or {FORMAT_VERSION_STATE}",
                                    "format_version")
            meta = cls(**raw)
            if (version == FORMAT_VERSION_STATE) != bool(meta.state_blocks and meta.state_sha256):
                raise KVBlocksError(f"format_version {version} with state_blocks {meta.state_blocks!r}: version "
                                    f"{FORMAT_VERSION_STATE} is the one that carries state", "format_version")
            return meta
        except (ValueError, TypeError, AttributeError) as exc:
            if isinstance(exc, KVBlocksError):
                raise
            raise KVBlocksError(f"unreadable KV block metadata: {exc}", "metadata") from None


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's full serialisation (vocabulary, merges, normaliser, added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def blocks_sha256(blocks: torch.Tensor) -> str:
    """sha256 of a contiguous CPU tensor's bytes (for blocks: their ``KVPool`` byte rows, K/V then scales)."""
    return hashlib.sha256(memoryview(blocks.reshape(-1).view(torch.uint8).numpy())).hexdigest()


def _state_sha256(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in ("state_conv", "state_recurrent"):
        digest.update(memoryview(state[name].contiguous().reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


class BlockIO:
    """Whole KV blocks in and out of one engine's pool (session save / restore; KV transfer checks), with the
    objects that work uses, given at construction. Engine thread only, between steps.

    Args:
        kv_pool: the runner's ``KVPool`` (K/V, scales, a hybrid model's state pool).
        kv_cache_manager: the engine's ``KVCacheManager`` (prefix-cache lookups and imports).
        kv_store: the lower KV tiers (``TieredKVStore``), or None: blocks evicted by an import are copied there.
        fingerprints: () -> (model fingerprint, tokenizer fingerprint) of the engine now (weights may change).
        lora_manager: the engine's ``LoRAManager``, or None without ``enable_lora``.
    """

    def __init__(self, kv_pool, kv_cache_manager, kv_store, fingerprints, lora_manager=None) -> None:
        self.kv_pool, self.kv_cache_manager, self.kv_store = kv_pool, kv_cache_manager, kv_store
        self._fingerprints, self.lora_manager = fingerprints, lora_manager

    def fingerprints(self) -> tuple[str, str]:
        """(model fingerprint, tokenizer fingerprint) of the engine now (one pass over the weights)."""
        return self._fingerprints()

    def extra_keys_of(self, cache_salt: str | None, lora_request=None) -> tuple:
        """The prefix-cache extra keys a request with this salt and adapter gets (``KVCacheManager.extra_keys``:
        the weight key after an unflushed weight update included)."""
        digest = None
        if lora_request is not None:
            if self.lora_manager is None:
                raise KVBlocksError("LoRA adapters need --enable-lora", "model")
            digest = self.lora_manager.register(lora_request).digest
        return self.kv_cache_manager.extra_keys(cache_salt, digest, lora_request)

    def export_blocks(self, token_ids: list[int], extra_keys: tuple = (), lora_name: str | None = None
                      ) -> tuple[KVBlockMeta, torch.Tensor, dict[str, torch.Tensor]]:
        """The pool's blocks for the full blocks of ``token_ids``, copied out, with a hybrid model's state
        checkpoints held for them.

        Returns (metadata, blocks ``(num_blocks, layers, 2, block_size, kv_heads, head_dim)`` in the KV dtype on
        the CPU, state): state holds, for an int8/fp8 KV cache, ``kv_scales`` ``(num_blocks, layers, 2, block_size,
        kv_heads)`` float16; and for a hybrid model with k of the blocks holding a checkpoint ``state_conv``
        ``(k, linear layers, conv_dim, kernel - 1)`` and ``state_recurrent`` ``(k, linear layers, value heads,
        head_k_dim, head_v_dim)`` float32 (``meta.state_blocks`` names the k blocks).

        Raises:
            KVBlocksError: fewer than one full block, or some of them are not in the pool (409: compute
                them first, e.g. with a 1-token generation over ``token_ids``).
        """
        manager = self.kv_cache_manager
        block_size = manager.block_size
        hashes: list[int] = []
        extend_block_hashes(hashes, list(token_ids), block_size, extra_keys)
        if not hashes:
            raise KVBlocksError(f"token_ids: {len(token_ids)} tokens hold no full block of {block_size}", "token_ids")
        block_ids = manager.cached_prefix_block_ids(hashes)
        if len(block_ids) < len(hashes):
            raise KVBlocksError(f"only {len(block_ids)} of {len(hashes)} blocks are in the KV pool", "token_ids", 409)
        pool = self.kv_pool
        rows = pool.gather(block_ids).cpu()  # (n, block_bytes): K/V, then an int8/fp8 cache's scales
        blocks, scales = pool.split(rows)
        model_fp, tokenizer_fp = self.fingerprints()
        state_blocks, state = self._export_state(hashes)
        meta = KVBlockMeta(FORMAT_VERSION_STATE if state_blocks else FORMAT_VERSION,
                           list(token_ids[: len(hashes) * block_size]), [f"{h:016x}" for h in hashes],
                           list(extra_keys), lora_name, model_fp, tokenizer_fp, pool.dtype_name,
                           block_size, list(blocks.shape[1:]), blocks_sha256(rows), state_blocks,
                           _state_sha256(state) if state_blocks else None)
        if scales is not None:
            state = {**state, KV_SCALES: scales}
        return meta, blocks, state

    def _state_cache(self):
        """A hybrid model's LinearStateCache with prefix-cache checkpoints, or None."""
        cache = self.kv_pool.state
        return cache if cache is not None and cache.checkpoint_conv is not None else None

    def _export_state(self, hashes: list[int]) -> tuple[list[int], dict[str, torch.Tensor]]:
        cache = self._state_cache()
        if cache is None:
            return [], {}
        slots = [(i, cache.slots.checkpoints.ready_slot(h)) for i, h in enumerate(hashes)]
        slots = [(i, slot) for i, slot in slots if slot is not None]
        if not slots:
            return [], {}
        index = torch.tensor([slot for _, slot in slots], device=cache.device)
        # (layers, slots, ...) -> (k, layers, ...)
        conv = cache.checkpoint_conv.index_select(1, index).transpose(0, 1).contiguous().cpu()
        recurrent = cache.checkpoint_recurrent.index_select(1, index).transpose(0, 1).contiguous().cpu()
        return [i for i, _ in slots], {"state_conv": conv, "state_recurrent": recurrent}

    def _rows(self, blocks: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """The pool's byte rows of ``blocks`` and their ``scales``.

        Raises:
            KVBlocksError: scales missing for an int8/fp8 KV cache, present for another, or of the wrong shape.
        """
        try:
            return self.kv_pool.join(blocks, scales)
        except ValueError as exc:
            raise KVBlocksError(f"{KV_SCALES}: {exc}", KV_SCALES) from None

    def check_blocks(self, meta: KVBlockMeta, blocks: torch.Tensor,
                     state: dict[str, torch.Tensor] | None = None) -> tuple[int, ...]:
        """Refuse blocks that do not belong in this engine, before anything changes.

        Returns the extra keys to hash with.

        Raises:
            KVBlocksError: another model or tokenizer, KV dtype, block size or block shape; hashes that do
                not follow from the tokens; bytes that do not match the checksum; state checkpoints
                (``state_blocks``) that are missing, shaped otherwise than this model's, for an engine without
                them (prefix caching off), or whose bytes do not match ``state_sha256``.
        """
        pool = self.kv_pool
        block_size = self.kv_cache_manager.block_size
        kv_dtype = pool.dtype_name
        want_shape = list(pool.block_shape)
        if meta.block_size != block_size:
            raise KVBlocksError(f"block_size {meta.block_size} does not match this server's {block_size}", "block_size")
        if meta.kv_dtype != kv_dtype:
            raise KVBlocksError(f"kv_dtype {meta.kv_dtype} does not match this server's {kv_dtype}", "kv_dtype")
        if list(meta.block_shape) != want_shape or list(blocks.shape[1:]) != want_shape:
            raise KVBlocksError(f"block_shape {list(blocks.shape[1:])} does not match this model's {want_shape}",
                                "block_shape")
        if str(blocks.dtype).removeprefix("torch.") != kv_dtype:
            raise KVBlocksError(f"blocks are {blocks.dtype}, this server's KV cache is {kv_dtype}", "kv_dtype")
        model_fp, tokenizer_fp = self.fingerprints()
        if meta.tokenizer_fingerprint != tokenizer_fp:
            raise KVBlocksError("the blocks were made with another tokenizer", "tokenizer_fingerprint")
        if meta.model_fingerprint != model_fp:
            raise KVBlocksError("the blocks were made by another model (weights, config, dtype, block size or KV dtype "
                                "differ)", "model_fingerprint")
        extra_keys = tuple(meta.extra_keys)
        hashes: list[int] = []
        extend_block_hashes(hashes, list(meta.token_ids), block_size, extra_keys)
        if [f"{h:016x}" for h in hashes] != list(meta.block_hashes) or blocks.shape[0] != len(hashes):
            raise KVBlocksError("block_hashes do not follow from token_ids and extra_keys", "block_hashes")
        if blocks_sha256(self._rows(blocks, (state or {}).get(KV_SCALES))) != meta.sha256:
            raise KVBlocksError("the blocks' checksum does not match (corrupt data)", "sha256")
        if meta.state_blocks:
            self._check_state(meta, state or {}, len(hashes))
        return extra_keys

    def _check_state(self, meta: KVBlockMeta, state: dict[str, torch.Tensor], num_blocks: int) -> None:
        cache = self._state_cache()
        if cache is None:
            raise KVBlocksError("the blocks carry linear-attention state checkpoints but this engine keeps none "
                                "(not a hybrid model, or prefix caching off)", "state_blocks")
        k = len(meta.state_blocks)
        if sorted(set(meta.state_blocks)) != list(meta.state_blocks) or not all(0 <= i < num_blocks
                                                                               for i in meta.state_blocks):
            raise KVBlocksError(f"state_blocks {meta.state_blocks} are not ascending block indices below {num_blocks}",
                                "state_blocks")
        for name, like in (("state_conv", cache.checkpoint_conv), ("state_recurrent", cache.checkpoint_recurrent)):
            want = [k, like.shape[0], *like.shape[2:]]
            got = state.get(name)
            if got is None or list(got.shape) != want or got.dtype != like.dtype:
                raise KVBlocksError(f"{name} must be {like.dtype} {want} for this model, got "
                                    f"{None if got is None else (got.dtype, list(got.shape))}", "state_blocks")
        if _state_sha256(state) != meta.state_sha256:
            raise KVBlocksError("the state checkpoints' checksum does not match (corrupt data)", "state_sha256")

    def import_blocks(self, meta: KVBlockMeta, blocks: torch.Tensor, state: dict[str, torch.Tensor] | None = None
                      ) -> dict:
        """Make the blocks prefix-cache entries of this engine, all or nothing (checked first), and their state
        checkpoints (``state`` as ``export_blocks`` gave it; hybrid models) the prefix cache's checkpoints.

        Returns ``{"num_blocks", "num_imported", "num_already_cached", "num_tokens", "num_state_checkpoints"}``
        (the last: checkpoints installed; one already held is kept).

        Raises:
            KVBlocksError: as ``check_blocks``; or 507 when the pool has too few free blocks (nothing changed).
        """
        extra_keys = self.check_blocks(meta, blocks, state)
        manager = self.kv_cache_manager
        lora = None
        taken = manager.import_prefix(list(meta.token_ids), extra_keys, lora)
        if taken is None:
            raise KVBlocksError(f"the KV pool has too few free blocks for {len(meta.block_hashes)} blocks; retry when "
                                "fewer requests run", "token_ids", 507)
        block_ids, indices = taken
        if block_ids:
            # Blocks just evicted to make room are copied to the lower tiers before they are overwritten.
            offloads, loads = manager.take_kv_transfers()
            if self.kv_store is not None and (offloads or loads):
                self.kv_store.transfer(offloads, loads)
            rows = self._rows(blocks, (state or {}).get(KV_SCALES))  # (num_blocks, block_bytes)
            self.kv_pool.scatter(block_ids, rows[torch.tensor(indices)])
        num_states = 0
        if meta.state_blocks:
            cache = self._state_cache()
            for j, i in enumerate(meta.state_blocks):
                payload = _tensor_bytes(state["state_conv"][j]) + _tensor_bytes(state["state_recurrent"][j])
                num_states += cache.install_checkpoint(int(meta.block_hashes[i], 16), payload)
        return {"num_blocks": len(meta.block_hashes), "num_imported": len(block_ids),
                "num_already_cached": len(meta.block_hashes) - len(block_ids), "num_tokens": len(meta.token_ids),
                "num_state_checkpoints": num_states}


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
