"""The KV tiers below the engine's primary pool: host RAM and disk (torch is used here, unlike in
``tokenmill.kv_cache``). See ``store.TieredKVStore`` for the flow and ``disk_tier`` for the files."""
from tokenmill.kv_offload.disk_tier import DiskTier
from tokenmill.kv_offload.ram_tier import RamTier
from tokenmill.kv_offload.store import TieredKVStore, build_kv_store

__all__ = ["DiskTier", "RamTier", "TieredKVStore", "build_kv_store"]
