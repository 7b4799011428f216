"""``tokenmill router``: an OpenAI-compatible front over several workers (tokenmill or any OpenAI server).

``policy.py`` is the contract every routing policy implements (pure Python, no I/O); the front end,
the worker registry, the KV-event index and the policies live in their own modules. Imports go one
way: the router may import ``tokenmill.kv_cache.block_hash`` (pure) but never the engine or the server.
"""
