"""KV blocks leaving and entering an engine: session save/restore today; prefill/decode transfer
connectors build on the same block export/import (``blocks.py``). Imports the engine's KV cache
bookkeeping and torch; nothing in the engine imports this package except through its entry points."""
