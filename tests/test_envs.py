"""tokenmill/envs.py is the only reader of TOKENMILL_* variables, docs/environment.md names each one, the
accessors read the environment when called, and the OpenMP spin count set at import is named in the
startup line and can be turned off (TOKENMILL_DISABLE_OMP_SPIN_TUNING=1)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tokenmill import envs
from tokenmill.cli.startup_line import startup_line
from tokenmill.runner import cpu_threads

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tokenmill"
NAME = re.compile(r"TOKENMILL_[A-Z0-9_]+")


def _environ_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each ``os.environ.get(NAME)``, ``os.environ[NAME]``, ``NAME in os.environ``,
    ``os.getenv(NAME)`` with a string constant NAME."""
    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    def const(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value))
                or node.func.attr == "getenv"):
            name = const(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            name = const(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            name = const(node.left)
        if name is not None:
            found.append((node.lineno, name))
    return found


def test_no_module_but_envs_reads_a_tokenmill_variable():
    """Neither a direct read (``os.environ.get("TOKENMILL_...")``) nor a name kept as a constant to read
    later: outside envs.py a TOKENMILL_ name appears only inside prose (docstrings, messages)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "envs.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(REPO)
        offenders += [f"{rel}:{line} reads {name}" for line, name in _environ_reads(tree) if name.startswith("TOKENMILL_")]
        offenders += [f"{rel}:{node.lineno} keeps the name {node.value!r}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)]
    assert not offenders, "read TOKENMILL_ variables through tokenmill/envs.py:\n" + "\n".join(offenders)


def test_the_read_finder_sees_each_way_of_reading():
    code = ('import os\nos.environ.get("TOKENMILL_A")\nos.environ["TOKENMILL_B"]\n"TOKENMILL_C" in os.environ\n'
            'os.getenv("TOKENMILL_D", "x")\nos.environ.get("HOME")\n')
    assert sorted(name for _, name in _environ_reads(ast.parse(code))) == [
        "HOME", "TOKENMILL_A", "TOKENMILL_B", "TOKENMILL_C", "TOKENMILL_D"]


def test_every_variable_named_in_the_package_is_in_envs_and_in_the_docs():
    """Any TOKENMILL_ name in the Python sources, or read by a C source's getenv, is one of envs.VARIABLES;
    docs/environment.md's table has exactly those."""
    mentioned = {m for path in PACKAGE.rglob("*.py") for m in NAME.findall(path.read_text())}
    read_by_c = {m for path in PACKAGE.rglob("csrc/*") if path.suffix in (".c", ".h")
                 for m in re.findall(r'getenv\("(TOKENMILL_[A-Z0-9_]+)"\)', path.read_text())}
    assert read_by_c, "qgemm.c's TOKENMILL_DISABLE_AMX is no longer found: update this test"
    assert (mentioned | read_by_c) <= set(envs.VARIABLES), sorted((mentioned | read_by_c) - set(envs.VARIABLES))
    documented = set(re.findall(r"^\| `(TOKENMILL_[A-Z0-9_]+)` \|", (REPO / "docs" / "environment.md").read_text(),
                                re.MULTILINE))
    assert documented == set(envs.VARIABLES)
    assert "docs/environment.md" in (REPO / "README.md").read_text()


def test_accessors_read_the_environment_when_called(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.CACHE_DIR, raising=False)
    assert envs.cache_dir() == Path.home() / ".cache" / "tokenmill"
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.setenv(envs.CACHE_DIR, "")  # empty: the default, as before envs.py
    assert envs.cache_dir() == Path.home() / ".cache" / "tokenmill"
    monkeypatch.delenv(envs.CPU_ISA, raising=False)
    assert envs.cpu_isa() is None
    monkeypatch.setenv(envs.CPU_ISA, " AVX2 ")
    assert envs.cpu_isa() == "avx2"
    for accessor, name in ((envs.disable_cpu_kernels, envs.DISABLE_CPU_KERNELS),
                           (envs.disable_omp_spin_tuning, envs.DISABLE_OMP_SPIN_TUNING)):
        monkeypatch.delenv(name, raising=False)
        assert accessor() is False
        monkeypatch.setenv(name, "1")
        assert accessor() is True
        monkeypatch.setenv(name, "0")
        assert accessor() is False


def test_the_cache_users_follow_the_variable(monkeypatch, tmp_path):
    from tokenmill import csrc_build
    from tokenmill.bench.llama_server import default_binary_path
    from tokenmill.models import gguf_cache

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    assert csrc_build.kernel_cache_dir() == tmp_path / "kernels"
    assert gguf_cache.cache_root() == tmp_path / "gguf"
    assert default_binary_path().is_relative_to(tmp_path / "llama.cpp")
    monkeypatch.setenv(envs.DISABLE_CPU_KERNELS, "1")
    assert csrc_build.kernels_disabled()


def _import_tokenmill(**env: str) -> tuple[str, str]:
    """GOMP_SPINCOUNT and ``omp_spin_note()`` after ``import tokenmill`` in a fresh process whose environment
    has no OpenMP settings (this one's GOMP_SPINCOUNT was set by its own import), plus ``env``."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", envs.DISABLE_OMP_SPIN_TUNING)}
    code = ("import os, tokenmill; from tokenmill.runner.cpu_threads import omp_spin_note; "
            "print(os.environ.get('GOMP_SPINCOUNT')); print(omp_spin_note())")
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=120).stdout.splitlines()
    return out[-2], out[-1]


def test_spin_count_is_set_at_import_and_named_unless_opted_out():
    spins, note = _import_tokenmill()
    assert spins == cpu_threads.OMP_SPIN_COUNT
    assert note == ("GOMP_SPINCOUNT=1000 set by tokenmill "
                    "(TOKENMILL_DISABLE_OMP_SPIN_TUNING=1 keeps libgomp's default)")
    assert _import_tokenmill(TOKENMILL_DISABLE_OMP_SPIN_TUNING="1") == ("None", "None")
    assert _import_tokenmill(GOMP_SPINCOUNT="7") == ("7", "None")  # the user's own setting: not ours to name


@pytest.mark.parametrize("spins_set", [True, False])
def test_startup_line_names_the_spin_count_only_when_tokenmill_set_it(monkeypatch, spins_set):
    monkeypatch.setattr(cpu_threads, "_omp_spins_set", spins_set)
    engine = SimpleNamespace(
        loaded=SimpleNamespace(dtype=torch.float32, quantization="none", model_path="/models/tiny"),
        device=torch.device("cpu"), runner=SimpleNamespace(kernel_choice="torch ops"))
    line = startup_line(engine)
    assert line.startswith("tokenmill: tiny, float32 on cpu, ISA ")
    suffix = "kernels: torch ops; GOMP_SPINCOUNT=1000 set by tokenmill (TOKENMILL_DISABLE_OMP_SPIN_TUNING=1 keeps"
    assert (suffix in line) == spins_set, line
    assert line.endswith("kernels: torch ops") != spins_set, line


def test_generate_startup_line_names_the_spin_count(tmp_path_factory):
    """`tokenmill generate` as a user runs it, with no OpenMP settings of their own: the note ends the startup
    line (the opt-out is checked on ``import tokenmill`` above)."""
    from tests.tiny_models import make_tiny_model

    tiny = str(make_tiny_model("llama", tmp_path_factory.mktemp("envs")))
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", envs.DISABLE_OMP_SPIN_TUNING)}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "generate", "hi", "--model", tiny,
                           "--dtype", "float32", "--kv-cache-memory", "0.05", "--max-tokens", "2",
                           "--temperature", "0", "--num-threads", "1"],
                          env=clean, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(s for s in done.stderr.splitlines() if s.startswith("tokenmill: "))
    assert line.endswith("; GOMP_SPINCOUNT=1000 set by tokenmill (TOKENMILL_DISABLE_OMP_SPIN_TUNING=1 keeps "
                         "libgomp's default)"), line
