"""RL rollout support: weights updated in place, pause/resume, sleep/wake, weight versions (docs/rl.md).

``checkpoint.py`` reads and checks a new checkpoint against the served model (all or nothing);
``engine_ops.py`` does the engine-thread work (copy the weights, flush or fence the KV tiers, free
and restore the KV pool and weights). The server's gate (pause, sleep, one weight version per
request) is ``tokenmill/server/rl_gate.py``; the HTTP routes ``tokenmill/server/serving_rl.py``.
"""
from tokenmill.rl.checkpoint import WeightUpdateError

__all__ = ["WeightUpdateError"]
