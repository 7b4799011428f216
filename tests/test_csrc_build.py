"""Building and caching the C kernels: an unwritable cache directory falls back to torch with a warning."""
from __future__ import annotations

import logging

import pytest

from tokenmill.csrc_build import load_c_library
from tokenmill.layers import batch_invariant


def test_unwritable_cache_dir_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(not_a_dir))
    caplog.set_level(logging.WARNING, logger="tokenmill.csrc_build")
    lib = load_c_library(batch_invariant._SOURCE, "batch_invariant", batch_invariant._setup, batch_invariant._FLAGS)
    assert lib is None
    assert "TOKENMILL_CACHE_DIR" in caplog.text and "torch is used instead" in caplog.text


def test_library_name_depends_on_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    names = []
    for compiler in ("cc", "gcc"):
        monkeypatch.setenv("CC", compiler)
        lib = load_c_library(batch_invariant._SOURCE, "batch_invariant", batch_invariant._setup, batch_invariant._FLAGS)
        if lib is None:
            pytest.skip(f"no working compiler {compiler!r} here")
        names.append({p.name for p in (tmp_path / "kernels").glob("*.so")})
    assert len(names[1]) == 2  # a second library, not the first one reused


def test_isa_paths_follow_the_cpu_flags(monkeypatch):
    """Paths are chosen from /proc/cpuinfo, not from what the compiler would assume: portable always,
    avx2 only with avx2+fma+f16c, avx512_bf16 only on top of the AVX-512 set, and an override that this
    CPU cannot run falls back to the best runnable path (a library built for it would die on SIGILL)."""
    import platform

    from tokenmill import csrc_build

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    flags = {
        "avx2 only": {"avx2", "fma", "f16c", "sse4_2"},
        "avx512 without bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
        "zen4": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
        "no avx2": {"sse4_2", "avx"},
    }
    expected = {
        "avx2 only": ("portable", "avx2"),
        "avx512 without bf16": ("portable", "avx2", "avx512"),
        "zen4": ("portable", "avx2", "avx512", "avx512_bf16"),
        "no avx2": ("portable",),
    }
    for name, cpu in flags.items():
        monkeypatch.setattr(csrc_build, "cpu_flags", lambda cpu=cpu: frozenset(cpu))
        assert csrc_build.supported_isas() == expected[name], name
    monkeypatch.setattr(csrc_build, "cpu_flags", lambda: frozenset(flags["avx2 only"]))
    assert csrc_build.missing_cpu_flags("avx512_bf16") == ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"]
    csrc_build._selected_isa.cache_clear()
    try:
        monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx512")
        assert csrc_build.selected_isa() == "avx2"
        monkeypatch.setenv("TOKENMILL_CPU_ISA", "portable")
        assert csrc_build.selected_isa() == "portable"
        monkeypatch.delenv("TOKENMILL_CPU_ISA")
        assert csrc_build.selected_isa() == "avx2"
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        monkeypatch.setattr(csrc_build, "cpu_flags", lambda: frozenset({"fp", "asimd", "crc32"}))
        assert csrc_build.supported_isas() == ("portable", "neon")
        assert "an x86_64 CPU" in csrc_build.missing_cpu_flags("avx2")[0]
    finally:
        csrc_build._selected_isa.cache_clear()


def test_a_path_this_cpu_cannot_run_is_not_built(tmp_path, monkeypatch):
    from tokenmill import csrc_build

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    missing = [isa for isa in csrc_build.ISAS if not csrc_build.isa_supported(isa)]
    assert missing  # no CPU runs both the x86 paths and NEON
    for isa in missing:
        assert load_c_library(batch_invariant._SOURCE, "batch_invariant", batch_invariant._setup,
                              batch_invariant._FLAGS, isa) is None
    assert not list((tmp_path / "kernels").glob("*.so")) if (tmp_path / "kernels").exists() else True


def test_clibrary_builds_once_per_process_and_reports_a_missing_build(tmp_path, monkeypatch):
    """``built`` calls ``load`` once and keeps its answer (None too); ``get`` raises the given message
    then; ``load`` is not cached; flags given as a function get the resolved ISA path."""
    from tokenmill import csrc_build
    from tokenmill.csrc_build import CLibrary

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    asked = []

    def flags(isa: str) -> tuple[str, ...]:
        asked.append(isa)
        return batch_invariant._FLAGS

    library = CLibrary(batch_invariant._SOURCE, "batch_invariant", batch_invariant._setup, flags)
    lib = library.built()
    if lib is None:
        pytest.skip("the C kernels cannot be built here")
    assert library.built() is lib and library.get() is lib and library.available()
    assert asked == [csrc_build.selected_isa()]  # built once
    assert library.load("portable").bi_isa().decode() == "portable" and asked[-1] == "portable"

    monkeypatch.setenv("TOKENMILL_DISABLE_CPU_KERNELS", "1")
    missing = CLibrary(batch_invariant._SOURCE, "batch_invariant", batch_invariant._setup, unavailable="no kernels")
    assert missing.built() is None and not missing.available()
    with pytest.raises(RuntimeError, match="^no kernels$"):
        missing.get()
    monkeypatch.delenv("TOKENMILL_DISABLE_CPU_KERNELS")
    assert missing.built() is None  # the first answer is kept for the process
    assert "batch_invariant CPU kernels are unavailable" in CLibrary(batch_invariant._SOURCE, "batch_invariant",
                                                                      batch_invariant._setup).unavailable
