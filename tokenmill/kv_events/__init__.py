"""KV cache events: what each engine reports about the blocks it holds, for a KV-aware router.

``events`` (types, msgpack wire format) and ``collector`` are pure Python; ``publisher`` adds ZeroMQ.
None of them imports torch. See docs/kv_events.md.
"""
from tokenmill.kv_events.collector import KVEventCollector
from tokenmill.kv_events.events import (
    MEDIUM_DISK,
    MEDIUM_POOL,
    MEDIUM_RAM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_vllm_batch,
)

__all__ = ["MEDIUM_DISK", "MEDIUM_POOL", "MEDIUM_RAM", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent",
           "KVEventBatch", "KVEventCollector", "decode_batch", "encode_batch", "encode_vllm_batch"]
