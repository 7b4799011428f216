"""Build a C source file into a shared library on first use and load it with ctypes.

Owns the kernel cache directory and the two environment switches (TOKENMILL_CACHE_DIR,
TOKENMILL_DISABLE_CPU_KERNELS); knows nothing about what the kernels compute. Callers fall back to
torch when this returns None.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# No -ffast-math here: kernels whose results must not depend on the compiler's choice of summation
# order use these as they are; a kernel that tolerates reassociation passes its own flags.
DEFAULT_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

# Headers shared by the kernels (bf16.h); on every kernel's include path and in every cache key.
SHARED_INCLUDE_DIR = Path(__file__).parent / "csrc"


def kernels_disabled() -> bool:
    """True when TOKENMILL_DISABLE_CPU_KERNELS=1: every compiled CPU kernel reports itself unavailable."""
    return os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS", "0") == "1"


def kernel_cache_dir() -> Path:
    """Where built libraries live: $TOKENMILL_CACHE_DIR/kernels, default ~/.cache/tokenmill/kernels."""
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(root) / "kernels"


@functools.cache
def _machine_key(compiler: str | None) -> bytes:
    """The compiler and this CPU's feature flags: ``-march=native`` builds differ between machines, so a
    cache directory shared by two machines must not hand one machine's library to the other."""
    cpu_flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{compiler}|{platform.machine()}|{cpu_flags}".encode()


def _compile(compiler: str, source: Path, target: Path, stem: str, flags: Sequence[str]) -> bool:
    """Build ``source`` into ``target`` through a temporary file and an atomic rename; False (after a
    warning) if the compiler fails. Raises OSError if the cache directory cannot be written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *flags, "-I", str(SHARED_INCLUDE_DIR), str(source), "-o", str(out), "-lm"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            logger.warning("running %s failed: the %s CPU kernel is not built: %s", compiler, stem, exc)
            return False
        if result.returncode != 0:
            logger.warning("building the %s CPU kernel failed, torch is used instead:\n%s", stem, result.stderr)
            return False
        os.replace(out, target)  # atomic: concurrent builders never see a partial file
    return True


def load_c_library(
    source: Path,
    stem: str,
    setup: Callable[[ctypes.CDLL], None],
    flags: Sequence[str] = DEFAULT_FLAGS,
) -> ctypes.CDLL | None:
    """Compile ``source`` (if not cached) with ``$CC``/cc/gcc and ``flags``, load it, and run ``setup`` on it.

    The shared headers in tokenmill/csrc (e.g. bf16.h) are always on the include path: ``-I`` for that
    directory is added to the command line whatever ``flags`` the caller passes. The library is cached
    as ``<cache dir>/<stem>-<hash>.so``, the hash covering the source bytes, the bytes of every ``*.h``
    in tokenmill/csrc (sorted by name), ``flags``, the compiler and this CPU's feature flags. It is
    written by an atomic rename, so concurrent builders never load a partial file, and an edited
    source or shared header is rebuilt.
    ``setup`` declares argtypes/restype of the exported functions.

    Returns None (after logging a warning) when TOKENMILL_DISABLE_CPU_KERNELS=1 (no warning then), when
    no compiler is found, when the cache directory cannot be written, or when compiling or loading fails.
    """
    if kernels_disabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    code = source.read_bytes()
    headers = b"".join(h.read_bytes() for h in sorted(SHARED_INCLUDE_DIR.glob("*.h")))
    key = code + headers + " ".join(flags).encode() + _machine_key(compiler)
    target = kernel_cache_dir() / f"{stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        if compiler is None:
            logger.warning("no C compiler found: the %s CPU kernel is not built, torch is used instead", stem)
            return None
        try:
            if not _compile(compiler, source, target, stem, flags):
                return None
        except OSError as exc:  # the cache directory cannot be created or written
            logger.warning("cannot write the %s CPU kernel under %s (%s): torch is used instead; point "
                           "TOKENMILL_CACHE_DIR at a writable directory", stem, target.parent, exc)
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("loading %s failed, torch is used instead: %s", target, exc)
        return None
    setup(lib)
    return lib
