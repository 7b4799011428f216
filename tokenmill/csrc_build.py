"""Build a C source file into a shared library on first use and load it with ctypes.

Owns the kernel cache directory, the choice of instruction-set path (ISA) the kernels are built for,
and what the environment switches mean (TOKENMILL_CACHE_DIR, TOKENMILL_DISABLE_CPU_KERNELS, TOKENMILL_CPU_ISA,
read through tokenmill/envs.py);
knows nothing about what the kernels compute. Callers fall back to torch when this returns None.

ISA paths: the path is picked from the features this CPU reports (/proc/cpuinfo), never from what
the build machine's compiler would assume (no ``-march=native``): each path is a fixed set of
compiler flags, and every C source selects its code with the macros those flags define
(``__AVX512F__``, ``__AVX2__``/``__FMA__``, ``__ARM_NEON``; ``TM_PORTABLE`` forces plain C loops).
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
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenmill import envs

logger = logging.getLogger(__name__)

# No -ffast-math here: kernels whose results must not depend on the compiler's choice of summation
# order use these as they are; a kernel that tolerates reassociation passes its own flags. The ISA
# path's flags (ISA_FLAGS) are appended by load_c_library.
DEFAULT_FLAGS: tuple[str, ...] = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")

# Instruction-set paths, from the most portable to the fastest on each architecture.
ISAS: tuple[str, ...] = ("portable", "avx2", "avx512", "avx512_bf16", "neon")
_X86_AVX2 = ("avx2", "fma", "f16c")
_X86_AVX512 = (*_X86_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
# The /proc/cpuinfo feature flags a path needs, per architecture (platform.machine()).
ISA_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": _X86_AVX2,
    "avx512": _X86_AVX512,
    "avx512_bf16": (*_X86_AVX512, "avx512_bf16"),
    "neon": ("asimd",),
}
_ISA_ARCH = {"avx2": "x86_64", "avx512": "x86_64", "avx512_bf16": "x86_64", "neon": "aarch64"}
# Compiler flags per path. "portable" defines TM_PORTABLE so the sources skip every SIMD section,
# even on aarch64 where NEON is part of the base ISA.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": ("-DTM_PORTABLE",),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16"),
    "neon": (),
}

# (kernel stem, ISA path) of every library loaded in this process: what a test run exercised.
loaded_kernels: set[tuple[str, str]] = set()

# Headers shared by the kernels (bf16.h); on every kernel's include path and in every cache key.
SHARED_INCLUDE_DIR = Path(__file__).parent / "csrc"


def kernels_disabled() -> bool:
    """True when TOKENMILL_DISABLE_CPU_KERNELS=1: every compiled CPU kernel reports itself unavailable."""
    return envs.disable_cpu_kernels()


def kernel_cache_dir() -> Path:
    """Where built libraries live: $TOKENMILL_CACHE_DIR/kernels, default ~/.cache/tokenmill/kernels."""
    return envs.cache_dir() / "kernels"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them ("flags" on x86, "Features" on ARM);
    empty where the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("model name" on x86), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_supported(isa: str) -> bool:
    """True if this machine can run code built for ``isa`` (one of ISAS).

    Raises:
        ValueError: ``isa`` is not one of ISAS.
    """
    if isa not in ISAS:
        raise ValueError(f"unknown CPU ISA path {isa!r}; choose one of {', '.join(ISAS)}")
    if isa == "portable":
        return True
    return platform.machine() == _ISA_ARCH[isa] and all(f in cpu_flags() for f in ISA_CPU_FLAGS[isa])


def supported_isas() -> tuple[str, ...]:
    """Every ISA path this CPU can run, most portable first ("portable" is always there)."""
    return tuple(isa for isa in ISAS if isa_supported(isa))


def missing_cpu_flags(isa: str) -> list[str]:
    """The feature flags ``isa`` needs that this CPU does not report (for skip and error messages)."""
    if isa == "portable":
        return []
    if platform.machine() != _ISA_ARCH[isa]:
        return [f"an {_ISA_ARCH[isa]} CPU (this is {platform.machine()})"]
    return [f for f in ISA_CPU_FLAGS[isa] if f not in cpu_flags()]


# Feature flags that mean bf16 arithmetic in hardware: AVX512_BF16 or AMX-BF16 (x86), BF16 (ARMv8.6).
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
NATIVE_BF16_FLAGS_TEXT = "avx512_bf16 or amx_bf16 on x86, bf16 on ARM"


def cpu_has_native_bf16() -> bool:
    """True if this CPU reports bf16 arithmetic (``NATIVE_BF16_FLAGS_TEXT``); without it torch emulates
    bf16 with conversions and its bf16 GEMMs are several times slower than float32 ones."""
    return any(flag in cpu_flags() for flag in _NATIVE_BF16_FLAGS)


@functools.cache
def _selected_isa(override: str) -> str:
    best = supported_isas()[-1]
    if not override:
        return best
    if override not in ISAS or not isa_supported(override):
        why = "unknown" if override not in ISAS else f"needs {', '.join(missing_cpu_flags(override))}"
        logger.warning("TOKENMILL_CPU_ISA=%s cannot run here (%s): the %s path is used; choose one of %s",
                       override, why, best, ", ".join(supported_isas()))
        return best
    return override


def selected_isa() -> str:
    """The ISA path kernels are built for: TOKENMILL_CPU_ISA if set and runnable here (a warning and
    the best path otherwise), else the fastest path this CPU supports."""
    return _selected_isa(envs.cpu_isa() or "")


def c_compiler() -> str | None:
    """The C compiler kernels are built with: ``$CC``, else ``cc``, else ``gcc`` (None: none found)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """True when ``c_compiler()`` compiles a tiny file with ``flags`` (e.g. an older gcc lacks -mamx-tile).
    A success is remembered under the kernel cache directory (keyed like the libraries), so later
    processes on this machine do not run the compiler again."""
    compiler = c_compiler()
    if compiler is None:
        return False
    marker = kernel_cache_dir() / "accepts" / hashlib.sha256(" ".join(flags).encode() + _machine_key(compiler)).hexdigest()[:16]
    if marker.exists():
        return True
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int tm_probe(void) { return 0; }\n")
        try:
            done = subprocess.run([compiler, *flags, "-c", str(src), "-o", str(Path(tmp) / "probe.o")],
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
    if done.returncode != 0:
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # an unwritable cache only means probing again next time
    return True


@functools.cache
def _machine_key(compiler: str | None) -> bytes:
    """The compiler and this CPU's feature flags: a cache directory shared by two machines must not hand
    one machine's library (built for its ISA path, with its compiler) to the other."""
    return f"{compiler}|{platform.machine()}|{' '.join(sorted(cpu_flags()))}".encode()


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
    isa: str | None = None,
) -> ctypes.CDLL | None:
    """Compile ``source`` (if not cached) with ``$CC``/cc/gcc, ``flags`` and the ISA path's flags, load
    it, and run ``setup`` on it.

    ``isa`` is one of ISAS (default: ``selected_isa()``); a path this CPU cannot run returns None
    (a library built for it would die on an illegal instruction).

    The shared headers in tokenmill/csrc (e.g. bf16.h) are always on the include path: ``-I`` for that
    directory is added to the command line whatever ``flags`` the caller passes. The library is cached
    as ``<cache dir>/<stem>-<hash>.so``, the hash covering the source bytes, the bytes of every ``*.h``
    in tokenmill/csrc (sorted by name), ``flags``, the compiler and this CPU's feature flags. It is
    written by an atomic rename, so concurrent builders never load a partial file, and an edited
    source or shared header is rebuilt.
    ``setup`` declares argtypes/restype of the exported functions.

    Returns None (after logging a warning) when TOKENMILL_DISABLE_CPU_KERNELS=1 or ``isa`` cannot run
    here (no warning then), when no compiler is found, when the cache directory cannot be written, or
    when compiling or loading fails.

    Raises:
        ValueError: ``isa`` is not one of ISAS.
    """
    isa = selected_isa() if isa is None else isa
    if kernels_disabled() or not isa_supported(isa):
        return None
    flags = (*flags, *ISA_FLAGS[isa])
    compiler = c_compiler()
    code = source.read_bytes()
    # the shared headers and the kernel's own (headers beside its source, e.g. qgemm.c's qg_tiles_kq.h)
    headers = b"".join(h.read_bytes() for h in (*sorted(SHARED_INCLUDE_DIR.glob("*.h")), *sorted(source.parent.glob("*.h"))))
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
    loaded_kernels.add((stem, isa))
    return lib


class CLibrary:
    """One C source's library: ``load`` builds it for any ISA path, ``built`` is this process's build
    (made on the first call, then cached), ``get`` the same or an error, ``available`` whether it exists.

    ``flags`` are the source's own compiler flags (``load_c_library`` adds the ISA path's), or a function
    of the ISA path returning them. Tests pin another path's build in place of this process's with
    ``monkeypatch.setattr(library, "built", lambda: other_build)``: ``get`` and ``available`` ask ``built``.
    """

    def __init__(self, source: Path, stem: str, setup: Callable[[ctypes.CDLL], None],
                 flags: Sequence[str] | Callable[[str], Sequence[str]] = DEFAULT_FLAGS,
                 unavailable: str = "") -> None:
        """``unavailable``: the RuntimeError message of ``get`` when there is no build (default: one
        naming ``stem`` and the usual causes)."""
        self.source = source
        self.stem = stem
        self.setup = setup
        self.flags = flags
        self.unavailable = unavailable or (f"the {stem} CPU kernels are unavailable (no C compiler, build failed, "
                                           "or TOKENMILL_DISABLE_CPU_KERNELS=1)")
        self._lock = threading.Lock()
        self._built: ctypes.CDLL | None = None
        self._tried = False

    def load(self, isa: str | None = None) -> ctypes.CDLL | None:
        """Build (or reuse from the disk cache) the library for ``isa`` (default: ``selected_isa()``); None if
        unavailable (see ``load_c_library``). Not cached in the process: tests compare the paths' builds.

        Raises:
            ValueError: ``isa`` is not one of ISAS.
        """
        if callable(self.flags):
            isa = selected_isa() if isa is None else isa
            return load_c_library(self.source, self.stem, self.setup, self.flags(isa), isa)
        return load_c_library(self.source, self.stem, self.setup, self.flags, isa)

    def built(self) -> ctypes.CDLL | None:
        """This process's build (``load()`` on the first call, cached after, None included)."""
        with self._lock:
            if not self._tried:
                self._built = self.load()
                self._tried = True
            return self._built

    def get(self) -> ctypes.CDLL:
        """This process's build.

        Raises:
            RuntimeError: with ``unavailable`` as the message, when there is none.
        """
        lib = self.built()
        if lib is None:
            raise RuntimeError(self.unavailable)
        return lib

    def available(self) -> bool:
        """True if the library can be used in this process (builds it on the first call)."""
        return self.built() is not None
