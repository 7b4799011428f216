"""How many CPU threads the engine may use: the CPUs this process may run on, capped by its cgroup quota.

``os.cpu_count()`` counts the machine's CPUs, not this process's: under ``taskset``/cpusets or a
container CPU quota a larger thread count only adds threads that wait for each other at every
parallel region (each C kernel and torch op ends in a barrier, and a descheduled thread stalls it).
Also shortens OpenMP's idle spins at ``import tokenmill`` (opt out: TOKENMILL_DISABLE_OMP_SPIN_TUNING=1).
Pure Python; reads /proc and /sys only.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from tokenmill import envs

# Spin iterations of an idle OpenMP thread before it sleeps (libgomp's GOMP_SPINCOUNT; its default
# is 300,000). Measured (benchmarks/cpu_contention.py, RESULTS.md): with another process keeping one
# of 2 cores busy, batch-1 decode falls to a quarter with the default and keeps about three quarters
# with short spins, because a spinning thread holds its core while the barrier waits for a
# descheduled one; on a quiet machine the short spin costs little.
OMP_SPIN_COUNT = "1000"

_omp_spins_set = False  # whether prefer_short_omp_spins set GOMP_SPINCOUNT in this process


def prefer_short_omp_spins() -> bool:
    """Set GOMP_SPINCOUNT to ``OMP_SPIN_COUNT`` unless the user set it or OMP_WAIT_POLICY, or opted out
    (TOKENMILL_DISABLE_OMP_SPIN_TUNING=1). Effective only before torch (and with it libgomp) is loaded, so
    tokenmill calls it at import; returns whether it took effect (``omp_spin_note`` then says so)."""
    global _omp_spins_set
    if (envs.disable_omp_spin_tuning() or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
            or "torch" in sys.modules):
        return False
    os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    _omp_spins_set = True
    return True


def omp_spin_note() -> str | None:
    """For the startup line and log: what ``prefer_short_omp_spins`` changed and how to opt out; None if nothing."""
    if not _omp_spins_set:
        return None
    return (f"GOMP_SPINCOUNT={OMP_SPIN_COUNT} set by tokenmill "
            f"({envs.DISABLE_OMP_SPIN_TUNING}=1 keeps libgomp's default)")


def _cgroup_v2_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by cgroup v2's ``cpu.max`` ("quota period"; "max" = unlimited) of this process's group."""
    try:
        rel = next((line.split("::", 1)[1].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
    except OSError:
        rel = "/"
    directory, quotas = root / rel.lstrip("/"), []
    while True:  # the tightest limit on the way up to the root
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if directory == root or root not in directory.parents:
            return min(quotas) if quotas else None
        directory = directory.parent


def _cgroup_v1_quota(root: Path = Path("/sys/fs/cgroup/cpu")) -> float | None:
    """CPUs allowed by cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 = unlimited)."""
    try:
        quota = int((root / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus() -> int:
    """CPUs this process can actually use: its affinity mask (``os.sched_getaffinity``), capped by the
    cgroup CPU quota rounded down (at least 1)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = _cgroup_v2_quota() or _cgroup_v1_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)
