"""Every TOKENMILL_* environment variable, with a typed accessor for each one Python reads (docs/environment.md).

Each accessor reads ``os.environ`` when called, never at import, so a variable set later (a test's
``monkeypatch.setenv``, a parent process) is obeyed. No other module reads a TOKENMILL_ variable
(tests/test_envs.py checks). Pure Python; imports nothing from tokenmill, never torch.
"""
from __future__ import annotations

import errno
import math
import os
from pathlib import Path

CACHE_DIR = "TOKENMILL_CACHE_DIR"
DISABLE_CPU_KERNELS = "TOKENMILL_DISABLE_CPU_KERNELS"
CPU_ISA = "TOKENMILL_CPU_ISA"
DISABLE_AMX = "TOKENMILL_DISABLE_AMX"
DISABLE_OMP_SPIN_TUNING = "TOKENMILL_DISABLE_OMP_SPIN_TUNING"
DISABLE_MOE_FUSED = "TOKENMILL_DISABLE_MOE_FUSED"
STATS_INTERVAL_S = "TOKENMILL_STATS_INTERVAL_S"
CHECK_INTEGRITY = "TOKENMILL_CHECK_INTEGRITY"
WORKER_API_KEY = "TOKENMILL_WORKER_API_KEY"
CLUSTER_SECRET = "TOKENMILL_CLUSTER_SECRET"
KV_OFFLOAD_DISK_FAULT = "TOKENMILL_KV_OFFLOAD_DISK_FAULT"
FAULT_INJECT_STEP = "TOKENMILL_FAULT_INJECT_STEP"
FUZZ_MAX_EXAMPLES = "TOKENMILL_FUZZ_MAX_EXAMPLES"

# Every variable and what it does: the table of docs/environment.md (tests/test_envs.py keeps them in step).
VARIABLES: dict[str, str] = {
    CACHE_DIR: "root of tokenmill's caches: kernels/ (C kernel builds, kernel plans), gguf/ (GGUF file "
               "indexes, configs, tokenizers), llama.cpp/ (the comparison llama-server); default ~/.cache/tokenmill",
    DISABLE_CPU_KERNELS: "1: build and load no C kernel; every layer runs on torch (as --no-cpu-kernels), and a "
                         "GGUF model's quantized weights need quantization='none'",
    CPU_ISA: "force the ISA path the C kernels are built for (portable, avx2, avx512, avx512_bf16, neon); a path "
             "this CPU cannot run is refused with a warning and the best runnable one is used",
    DISABLE_AMX: "1 (any value but empty or 0): the quantized products never use AMX tiles (VNNI at every row "
                 "count); read by quantization/csrc/qgemm.c itself when it first multiplies, so no accessor here",
    DISABLE_OMP_SPIN_TUNING: "1: importing tokenmill leaves GOMP_SPINCOUNT alone (libgomp's default spin count) "
                             "instead of setting it to 1000",
    DISABLE_MOE_FUSED: "1: a mixture-of-experts layer on CPU routes with torch (select_experts) and runs its experts "
                       "in the torch grouped step instead of the C routing and fused C expert step (the same experts; "
                       "weights and outputs may differ in the last bits; for comparisons)",
    STATS_INTERVAL_S: "seconds between the engine's stats lines, a finite number > 0 (default 10; tests shorten it)",
    CHECK_INTEGRITY: "1: each time the engine goes idle it asserts that every KV block and state slot is free again "
                     "and the pool's indexes are consistent (the test suite sets it; a leak fails the step)",
    WORKER_API_KEY: "the router's credential for its workers (as --worker-api-key, which wins): sent to every "
                    "worker as 'Authorization: Bearer <key>'; start the workers with --api-key <key>",
    CLUSTER_SECRET: "the cluster secret (16 bytes or more) that signs kv_transfer_params, KV transfer frames and KV "
                    "event tags; unset: an explicit secret file, else the per-user file "
                    "$XDG_CONFIG_HOME/tokenmill/cluster.key (created 0600 on first use)",
    KV_OFFLOAD_DISK_FAULT: "test only: ERRNO or ERRNO@BYTES (e.g. EROFS, ENOSPC@65536) makes the disk KV tier's "
                           "writes fail with that error once it has written BYTES (default 0) in this process, "
                           "for fault tests where a real full or read-only filesystem cannot be made",
    FAULT_INJECT_STEP: "test only: N or N,M,... makes the engine's N-th model forward (counted from 1 in this "
                       "process) raise InjectedFault, as a kernel failing for one batch would; the requests of that "
                       "step fail with a 500 and the engine carries on (several in a row: it reports dead)",
    FUZZ_MAX_EXAMPLES: "test only: examples Schemathesis draws per API operation and generation mode in "
                       "tests/test_api_fuzz.py, an integer > 0 (default 8, about a minute per app on 2 cores; "
                       "benchmarks/fuzz_api.py sets more)",
}

DEFAULT_STATS_INTERVAL_S = 10.0


def _flag(name: str) -> bool:
    """True when ``name`` is set to exactly "1"."""
    return os.environ.get(name, "0").strip() == "1"


def cache_dir() -> Path:
    """$TOKENMILL_CACHE_DIR if set and not empty, else ~/.cache/tokenmill."""
    return Path(os.environ.get(CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill"))


def disable_cpu_kernels() -> bool:
    """True when TOKENMILL_DISABLE_CPU_KERNELS=1: every compiled CPU kernel reports itself unavailable."""
    return _flag(DISABLE_CPU_KERNELS)


def cpu_isa() -> str | None:
    """TOKENMILL_CPU_ISA lower-cased, or None when unset or empty (csrc_build checks the path)."""
    return os.environ.get(CPU_ISA, "").strip().lower() or None


def check_integrity() -> bool:
    """True when TOKENMILL_CHECK_INTEGRITY=1: the engine checks its KV pool whenever it goes idle."""
    return _flag(CHECK_INTEGRITY)


def disable_moe_fused() -> bool:
    """True when TOKENMILL_DISABLE_MOE_FUSED=1: MoE layers on CPU keep the torch grouped expert step."""
    return _flag(DISABLE_MOE_FUSED)


def disable_omp_spin_tuning() -> bool:
    """True when TOKENMILL_DISABLE_OMP_SPIN_TUNING=1: ``import tokenmill`` does not set GOMP_SPINCOUNT."""
    return _flag(DISABLE_OMP_SPIN_TUNING)


def stats_interval_s() -> float:
    """Seconds between stats lines: $TOKENMILL_STATS_INTERVAL_S if set and not empty, else 10.

    Raises:
        ValueError: the variable is not a finite number > 0.
    """
    text = os.environ.get(STATS_INTERVAL_S, "").strip()
    if not text:
        return DEFAULT_STATS_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{STATS_INTERVAL_S} must be a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{STATS_INTERVAL_S} must be a finite number of seconds > 0, got {text}")
    return value


def worker_api_key() -> str | None:
    """$TOKENMILL_WORKER_API_KEY, or None when unset or empty (the router's default --worker-api-key)."""
    return os.environ.get(WORKER_API_KEY, "").strip() or None


def cluster_secret() -> str | None:
    """$TOKENMILL_CLUSTER_SECRET, or None when unset or empty (``tokenmill.security.load_cluster_secret``)."""
    return os.environ.get(CLUSTER_SECRET, "").strip() or None


def kv_offload_disk_fault() -> tuple[int, int] | None:
    """$TOKENMILL_KV_OFFLOAD_DISK_FAULT as (errno, bytes written before the fault), or None when unset or empty.

    Raises:
        ValueError: not ``ERRNO`` or ``ERRNO@BYTES`` with a known errno name and BYTES >= 0.
    """
    text = os.environ.get(KV_OFFLOAD_DISK_FAULT, "").strip()
    if not text:
        return None
    name, _, after = text.partition("@")
    code = getattr(errno, name.strip().upper(), None)
    try:
        after_bytes = int(after) if after.strip() else 0
    except ValueError:
        after_bytes = -1
    if not isinstance(code, int) or after_bytes < 0:
        raise ValueError(f"{KV_OFFLOAD_DISK_FAULT} must be ERRNO or ERRNO@BYTES (e.g. ENOSPC@65536), got {text!r}")
    return code, after_bytes


def fault_inject_steps() -> frozenset[int]:
    """$TOKENMILL_FAULT_INJECT_STEP as the set of model forwards (1 = the first) that raise ``InjectedFault``;
    empty when unset or empty (read once, when an engine is built).

    Raises:
        ValueError: not a comma-separated list of integers >= 1.
    """
    text = os.environ.get(FAULT_INJECT_STEP, "").strip()
    if not text:
        return frozenset()
    try:
        steps = frozenset(int(part) for part in text.split(","))
    except ValueError:
        steps = frozenset({0})
    if min(steps) < 1:
        raise ValueError(f"{FAULT_INJECT_STEP} must be N or N,M,... with integers >= 1, got {text!r}")
    return steps


DEFAULT_FUZZ_MAX_EXAMPLES = 8


def fuzz_max_examples() -> int:
    """$TOKENMILL_FUZZ_MAX_EXAMPLES if set and not empty, else 8: the API fuzzer's examples per operation.

    Raises:
        ValueError: not an integer > 0.
    """
    text = os.environ.get(FUZZ_MAX_EXAMPLES, "").strip()
    if not text:
        return DEFAULT_FUZZ_MAX_EXAMPLES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{FUZZ_MAX_EXAMPLES} must be an integer > 0, got {text!r}")
    return value
