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
