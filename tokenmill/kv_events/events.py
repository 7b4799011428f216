"""KV cache event types and their wire encoding (msgpack), shared by the engine's publisher and the
router's index.

Pure Python (msgpack only); never imports torch. Field names follow vLLM's KV events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``medium``); ``medium`` is the tier: ``pool`` (the primary KV
pool), ``ram`` (the host-RAM tier) or ``disk`` (the disk tier).

Why msgpack rather than JSON: block hashes are unsigned 64-bit integers, which many JSON readers
(JavaScript, anything that parses numbers as doubles) round above 2**53; msgpack keeps them exact,
writes token ids in 1-5 bytes instead of up to 6 characters plus a separator, and is what vLLM and
Dynamo speak, so their consumers have a decoder at hand. Events are msgpack maps (self-describing;
a reader skips fields and event types it does not know).

``encode_vllm_batch`` writes vLLM's own ``KVEventBatch`` instead (``"format": "vllm"``), for consumers that
decode vLLM's events; ``decode_batch`` reads both, and vLLM's newer map-shaped events too.
"""
from __future__ import annotations

from dataclasses import dataclass

import dataclasses
import functools

import msgpack

from tokenmill.security import sign

MEDIUM_POOL = "pool"
MEDIUM_RAM = "ram"
MEDIUM_DISK = "disk"
MEDIUMS = (MEDIUM_POOL, MEDIUM_RAM, MEDIUM_DISK)

# vLLM's ``medium`` for each tier: "GPU" is vLLM's primary pool (also on a CPU engine: the pool where
# attention reads), "CPU" its CPU offloading tier; vLLM names no disk tier, so "DISK".
VLLM_MEDIUMS = {MEDIUM_POOL: "GPU", MEDIUM_RAM: "CPU", MEDIUM_DISK: "DISK"}
_MEDIUM_FROM_VLLM = {name: medium for medium, name in VLLM_MEDIUMS.items()}

# The replay reply ends with this sequence number (-1 as a signed 8-byte integer) and an empty payload.
END_OF_REPLAY = b"\xff" * 8


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now held in ``medium``.

    In the primary pool (``token_ids`` given) the hashes are a chain: ``block_hashes[i]`` is the child
    of ``block_hashes[i - 1]`` and the first one's parent is ``parent_block_hash`` (None: the first
    block of a prompt); ``token_ids`` are the blocks' tokens, ``block_size`` each, and ``extra_keys``
    (cache salt, adapter digest) went into every hash. On the wire ``extra_keys`` and ``lora_name`` are
    keyed tags (``redact``), never the values. In the lower tiers the tier knows hashes only:
    ``token_ids`` and ``parent_block_hash`` are None and ``block_hashes`` is just a set of blocks.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...] | None
    block_size: int
    medium: str
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer held in ``medium`` (evicted, or dropped as unreadable)."""

    block_hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of ``medium`` is gone (None: of every tier, e.g. the engine shut down)."""

    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


KEY_TAG_PURPOSE = "kv_events.extra_key"


@functools.lru_cache(maxsize=4096)  # a few salts and adapters recur in every step's events
def key_tag(secret: bytes, value: str) -> str:
    """The keyed tag that stands for a cache salt, adapter name or other extra key on the wire: hex
    HMAC-SHA256 under the cluster secret (tokenmill.security), so a consumer holding the secret can
    match a value it knows (``key_tag(secret, salt) in event.extra_keys``) and nobody else learns it."""
    return sign(secret, KEY_TAG_PURPOSE, value)


def redact(event: KVEvent, secret: bytes) -> KVEvent:
    """``event`` as published: a ``BlockStored``'s ``extra_keys`` and ``lora_name`` replaced by their
    ``key_tag``s (``lora_id``, the engine's slot number, and the block hashes stay; other events unchanged)."""
    if not isinstance(event, BlockStored) or (not event.extra_keys and event.lora_name is None):
        return event
    return dataclasses.replace(
        event, extra_keys=tuple(key_tag(secret, str(k)) for k in event.extra_keys),
        lora_name=None if event.lora_name is None else key_tag(secret, event.lora_name))


def _event_to_wire(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": event.block_hashes, "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids, "block_size": event.block_size, "medium": event.medium,
                "lora_id": event.lora_id, "lora_name": event.lora_name, "extra_keys": event.extra_keys}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared", "medium": event.medium}


def _event_from_wire(item: dict) -> KVEvent | None:
    kind = item.get("type")
    if kind == "BlockStored":
        token_ids = item.get("token_ids")
        return BlockStored(tuple(item["block_hashes"]), item.get("parent_block_hash"),
                           None if token_ids is None else tuple(token_ids), item["block_size"], item["medium"],
                           item.get("lora_id"), item.get("lora_name"), tuple(item.get("extra_keys") or ()))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(item["block_hashes"]), item["medium"])
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(item.get("medium"))
    return None  # a newer publisher's event type: skipped


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One engine step's events. ``instance`` is a random id drawn when the publisher starts: a
    subscriber that sees it change knows the engine restarted (its sequence numbers start again at 0
    and its pool and RAM tier are empty); None in vLLM's format, which has no such id.
    ``data_parallel_rank``: vLLM's field (None in tokenmill's format)."""

    ts: float
    events: list[KVEvent]
    instance: int | None
    data_parallel_rank: int | None = None


def encode_batch(ts: float, events: list[KVEvent], instance: int = 0) -> bytes:
    """One engine step's events as a msgpack map ``{"ts": unix seconds, "instance": int, "events": [...]}``."""
    return msgpack.packb({"ts": ts, "instance": instance, "events": [_event_to_wire(e) for e in events]})


def encode_vllm_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """One engine step's events exactly as vLLM's publisher encodes its ``KVEventBatch`` (msgspec structs with
    ``array_like=True, omit_defaults=True``, the events a ``tag=True`` union; vllm/distributed/kv_events.py
    up to v0.23, which every vLLM event consumer reads):

    - batch: ``[ts, [event, ...], data_parallel_rank]``
    - ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``
      (vLLM's trailing ``extra_keys`` and group fields keep their defaults, so msgspec leaves them out)
    - ``["BlockRemoved", block_hashes, medium]``
    - ``["AllBlocksCleared"]``

    ``medium`` is vLLM's name of the tier (``VLLM_MEDIUMS``). A lower tier's store has ``token_ids`` ``[]``
    (vLLM's field is a list, never null). vLLM's ``AllBlocksCleared`` names no tier, so clearing any tier
    is sent as one: a consumer forgets more than it must, never keeps a block that is gone. The events
    should already be ``redact``ed: ``lora_name`` is then the adapter's keyed tag, never its name."""
    return msgpack.packb([ts, [_event_to_vllm(e) for e in events], data_parallel_rank])


def _event_to_vllm(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash,
                () if event.token_ids is None else event.token_ids, event.block_size, event.lora_id,
                VLLM_MEDIUMS.get(event.medium, event.medium), event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, VLLM_MEDIUMS.get(event.medium, event.medium)]
    return ["AllBlocksCleared"]


# Field order of vLLM's array-like events after the tag (later fields, if any, are ignored).
_VLLM_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                "lora_name"),
                "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _event_from_vllm(item: list | dict) -> KVEvent | None:
    """One vLLM event: a tagged array (vLLM up to v0.23, ``encode_vllm_batch``) or a map with its tag under
    ``type`` (later vLLM). A missing ``medium`` (vLLM before it had one) is the primary pool."""
    if isinstance(item, dict):
        kind, fields = item.get("type"), item
    else:
        kind = item[0] if item else None
        fields = dict(zip(_VLLM_FIELDS.get(kind, ()), item[1:]))
    if kind not in _VLLM_FIELDS:
        return None  # an event type this reader does not know: skipped
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(None)
    medium = fields.get("medium")
    medium = MEDIUM_POOL if medium is None else _MEDIUM_FROM_VLLM.get(str(medium).upper(), str(medium))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(fields["block_hashes"]), medium)
    token_ids = fields.get("token_ids")
    return BlockStored(tuple(fields["block_hashes"]), fields.get("parent_block_hash"),
                       tuple(token_ids) if token_ids else None, int(fields["block_size"]), medium,
                       fields.get("lora_id"), fields.get("lora_name"))


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch of an ``encode_batch`` payload (a map), or of a vLLM ``KVEventBatch`` (an array:
    ``encode_vllm_batch``, or a vLLM engine's, with array- or map-shaped events). Unknown event types are
    dropped.

    Raises:
        ValueError: not a batch.
    """
    try:
        batch = msgpack.unpackb(payload)
        if isinstance(batch, list):
            events = [e for e in map(_event_from_vllm, batch[1]) if e is not None]
            rank = batch[2] if len(batch) > 2 else None
            return KVEventBatch(float(batch[0]), events, None, rank)
        events = [e for e in map(_event_from_wire, batch["events"]) if e is not None]
        return KVEventBatch(float(batch["ts"]), events, int(batch.get("instance", 0)))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


def encode_seq(seq: int) -> bytes:
    """A batch's sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
