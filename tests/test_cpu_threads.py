"""Thread count from the CPUs this process may use (affinity, cgroup quota) and dtype auto from the CPU."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

from tokenmill import csrc_build
from tokenmill.models.loader import resolve_dtype
from tokenmill.runner import cpu_threads


def test_cgroup_v2_quota_is_read_and_rounded_down(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads._cgroup_v2_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads._cgroup_v2_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    monkeypatch.setattr(cpu_threads, "_cgroup_v2_quota", lambda: 0.5)
    assert cpu_threads.available_cpus() == 1  # at least one, never 0
    monkeypatch.setattr(cpu_threads, "_cgroup_v2_quota", lambda: 1e9)  # a quota above the CPU count
    assert cpu_threads.available_cpus() == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads._cgroup_v1_quota(tmp_path) is None
    (tmp_path / "cpu.cfs_quota_us").write_text("200000\n")
    assert cpu_threads._cgroup_v1_quota(tmp_path) == 2.0


def test_engine_threads_follow_the_affinity_mask():
    """A process pinned to one CPU (taskset) gets one torch thread, whatever os.cpu_count() says."""
    code = ("import os, torch; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from tokenmill.runner.cpu_threads import available_cpus; print(available_cpus(), os.cpu_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1"


def test_dtype_auto_is_float32_without_bf16_arithmetic(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.models.loader")
    monkeypatch.setattr(csrc_build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert not csrc_build.cpu_has_native_bf16()
    assert resolve_dtype("auto", None) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16) == torch.float32
    assert "no bf16 arithmetic" in caplog.text
    assert resolve_dtype("bfloat16", None) == torch.bfloat16  # an explicit choice stands
    assert resolve_dtype("auto", None, torch.device("cuda", 0)) == torch.bfloat16
    for native in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(csrc_build, "cpu_flags", lambda native=native: frozenset({"avx2", native}))
        assert resolve_dtype("auto", None) == torch.bfloat16
    assert resolve_dtype("auto", torch.float32) == torch.float32


def test_importing_tokenmill_shortens_openmp_spins_unless_told_otherwise():
    """GOMP_SPINCOUNT is set before torch loads libgomp (short spins: a busy neighbour core no longer
    stalls every barrier), never over the user's own OpenMP settings, and not once torch is loaded."""
    def spin(code: str, **env) -> str:
        clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                             env={**clean, **env}, capture_output=True, text=True, check=True)
        return out.stdout.split()[-1]

    assert spin("import tokenmill") == cpu_threads.OMP_SPIN_COUNT
    assert spin("import tokenmill", GOMP_SPINCOUNT="7") == "7"
    assert spin("import tokenmill", OMP_WAIT_POLICY="active") == "None"
    assert spin("import torch, tokenmill") == "None"  # too late to matter: left alone
