"""RL rollout support: weights updated in place, pause/resume, sleep/wake, weight versions (docs/rl.md).

``checkpoint.py`` reads and checks a new checkpoint against the served model (all or nothing);
``engine_ops.py`` does the engine-thread work (copy the weights, flush the KV tiers, free and
restore the KV pool and weights); ``control.py`` is the server's gate (pause, sleep, in-flight
requests) and orchestration. The HTTP routes live in ``tokenmill/server/serving_rl.py``.
"""
from tokenmill.rl.checkpoint import WeightUpdateError

__all__ = ["WeightUpdateError"]
