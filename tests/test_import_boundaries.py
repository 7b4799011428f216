"""The architecture's boundaries (docs/architecture.md), checked on the source so a change that crosses one fails:

- the planning packages import no torch (each imported alone in a fresh interpreter);
- one-way imports: ``runner/`` never imports ``spec_decode/``, ``router/`` never imports ``server/`` or
  ``engine/`` (read from every import statement, lazy ones inside functions included);
- nothing outside ``runner/`` touches the KV tensor: the runner's ``kv_cache`` / ``kv_scales`` / ``kv_caches``
  are read only inside ``runner/`` (every other module goes through ``KVPool``).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenmill"

# Packages that plan, route or parse, and must stay importable without torch (a router box has none).
TORCH_FREE = ("scheduler", "kv_cache", "kv_events", "structured_output", "tool_calling", "router", "security")
# Modules of those packages that wrap a third-party library which itself imports torch, loaded only when
# chosen: xgrammar (its Python package imports torch at import time).
TORCH_FREE_EXEMPT = {"tokenmill.structured_output.xgrammar_backend"}
EXTRA_TORCH_FREE = ("tokenmill.kv_transfer.scheduler_side",  # the scheduler half of the KV connector
                    "tokenmill.request", "tokenmill.lora_request")  # the core request types

# (importer package, imported package): never.
FORBIDDEN = (("runner", "spec_decode"), ("router", "server"), ("router", "engine"),
             # moe/ is a layer library: the model files import it, never the other way
             ("moe", "models"), ("moe", "engine"), ("moe", "runner"), ("moe", "server"))

# Attributes that are the runner's KV tensors; read outside runner/ only through the KVPool.
KV_TENSOR_ATTRS = {"kv_cache", "kv_scales", "kv_caches", "state_cache"}


def modules_of(package: str) -> list[str]:
    return sorted(f"tokenmill.{package}.{p.stem}" if p.stem != "__init__" else f"tokenmill.{package}"
                  for p in (PACKAGE / package).glob("*.py"))


@pytest.mark.parametrize("package", TORCH_FREE)
def test_planning_packages_import_no_torch(package):
    modules = [m for m in modules_of(package) if m not in TORCH_FREE_EXEMPT]
    if package == "scheduler":
        modules += EXTRA_TORCH_FREE
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "    if 'torch' in sys.modules:\n"
            "        print(m); break\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {result.stdout.strip()} imports torch"


def imported_modules(path: Path) -> set[str]:
    """Every tokenmill module a file imports (top-level, lazy or under TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("tokenmill.")}


@pytest.mark.parametrize("importer, imported", FORBIDDEN)
def test_one_way_imports(importer, imported):
    crossings = []
    for path in sorted((PACKAGE / importer).rglob("*.py")):
        for module in imported_modules(path):
            if module == f"tokenmill.{imported}" or module.startswith(f"tokenmill.{imported}."):
                crossings.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not crossings, "\n".join(crossings)


def test_nothing_outside_the_runner_touches_the_kv_tensor():
    """``x.runner.kv_cache``, ``runner.kv_scales`` and the like appear only under runner/ (the KVPool's
    clients use ``runner.kv_pool``); a module's own attribute of that name (``self.kv_cache`` of the draft
    model's private cache) is not the runner's."""
    reads = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "runner":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in KV_TENSOR_ATTRS):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if name == "runner":
                reads.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} reads runner.{node.attr}")
    assert not reads, "\n".join(reads)


@pytest.mark.parametrize("module", ["kv_transfer/config.py", "spec_decode/config.py", "config_error.py"])
def test_feature_configs_do_not_import_the_engine_config(module):
    """``config.py`` names ``KVTransferConfig`` / ``SpeculativeConfig``; they build on the leaf ``config_error.py``,
    never on ``config.py`` (no cycle, not even a lazy one)."""
    assert "tokenmill.config" not in imported_modules(PACKAGE / module)
