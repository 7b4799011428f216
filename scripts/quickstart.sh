#!/usr/bin/env bash
# Set up, then generate with the embedded SmolLM2-135M-Instruct model. Extra args go to `tokenmill generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- "What is the capital of France? Answer in one sentence." --chat --max-tokens 48
fi
exec .venv/bin/tokenmill generate "$@"
