#!/usr/bin/env bash
# Set up, then generate with the embedded SmolLM2-135M-Instruct model. Extra args go to `tokenmill generate`.
# The default question is answered greedily (--temperature 0), so it prints the same answer on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- "What is the capital of France? Answer in one sentence." --chat --max-tokens 48 --temperature 0
fi
exec .venv/bin/tokenmill generate "$@"
