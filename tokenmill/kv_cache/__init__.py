"""Paged KV-cache bookkeeping: blocks, the free list, prefix-cache hashes and the manager.

Pure CPU bookkeeping; never imports torch. The tensors themselves live in the model runner.
"""
from tokenmill.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tokenmill.kv_cache.kv_cache_manager import KVCacheManager

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager"]
