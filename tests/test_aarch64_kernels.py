"""The kernels' NEON paths, built for aarch64 and run under user-mode QEMU (tests/csrc/aarch64_check.c).

Each kernel source is cross-compiled twice, with the NEON path's flags and with the portable ones (the
flags its Python loader uses), and the driver compares the two builds: SiLU, the GEMM and RMSNorm
bit for bit, paged decode against a float64 reference and for batch invariance, NaN/inf where the
portable build has them, the GGUF quantized-weight products (qgemm) bit for bit on every format. A passing kernel is listed under "neon" in the session's ISA report.
Skipped unless ``aarch64-linux-gnu-gcc`` and ``qemu-aarch64`` are on PATH (Debian: the packages
gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tokenmill import csrc_build
from tokenmill.attention import cpu_decode
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.quantization import qgemm

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
DRIVER = Path(__file__).parent / "csrc" / "aarch64_check.c"

# stem (as in the driver's KERNELS table) -> (source, the flags its loader passes to load_c_library)
KERNELS = {
    "silu_and_mul": (silu_and_mul_kernel._SOURCE, silu_and_mul_kernel._FLAGS),
    "paged_decode": (cpu_decode._SOURCE, cpu_decode._FLAGS),
    "batch_invariant": (batch_invariant._SOURCE, batch_invariant._FLAGS),
    "qgemm": (qgemm._SOURCE, qgemm._FLAGS),
}

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS_CC} and {QEMU} on PATH (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)",
)


def cross_compile(args: list[str]) -> None:
    result = subprocess.run([CROSS_CC, "-I", str(csrc_build.SHARED_INCLUDE_DIR), *args], capture_output=True, text=True)
    assert result.returncode == 0, f"{CROSS_CC} {' '.join(args)} failed:\n{result.stderr}"


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("aarch64") / "aarch64_check"
    cross_compile(["-O2", "-std=c11", "-D_GNU_SOURCE", str(DRIVER), "-o", str(exe), "-ldl", "-lm"])
    return exe


@pytest.mark.parametrize("stem", sorted(KERNELS))
def test_neon_build_matches_portable_build(stem, driver, tmp_path):
    source, flags = KERNELS[stem]
    for isa in ("neon", "portable"):
        cross_compile([*flags, *csrc_build.ISA_FLAGS[isa], str(source), "-o", str(tmp_path / f"{stem}-{isa}.so"), "-lm"])
    result = subprocess.run([QEMU, "-L", SYSROOT, str(driver), str(tmp_path), stem],
                            capture_output=True, text=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip().splitlines()[-1].startswith("verdict: PASS")
    csrc_build.loaded_kernels.add((stem, "neon"))  # exercised for real, under QEMU
