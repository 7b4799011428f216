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
    and its pool and RAM tier are empty)."""

    ts: float
    events: list[KVEvent]
    instance: int


def encode_batch(ts: float, events: list[KVEvent], instance: int = 0) -> bytes:
    """One engine step's events as a msgpack map ``{"ts": unix seconds, "instance": int, "events": [...]}``."""
    return msgpack.packb({"ts": ts, "instance": instance, "events": [_event_to_wire(e) for e in events]})


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch of an ``encode_batch`` payload (unknown event types are dropped).

    Raises:
        ValueError: not a batch.
    """
    try:
        batch = msgpack.unpackb(payload)
        events = [e for e in map(_event_from_wire, batch["events"]) if e is not None]
        return KVEventBatch(float(batch["ts"]), events, int(batch.get("instance", 0)))
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


def encode_seq(seq: int) -> bytes:
    """A batch's sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
