#!/usr/bin/env bash
# Set up, then run the whole test suite (about 10 minutes on a quiet 2-core machine). Extra args go to pytest.
# `--quick` runs only QUICK_TESTS instead: scheduler, KV cache, sampling, small kernels, config checks and the
# detokenizer; no model weights; about 30 seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK_TESTS=(
  tests/test_scheduler.py
  tests/test_kv_cache.py
  tests/test_sampling.py
  tests/test_bench_metrics.py
  tests/test_attention.py
  tests/test_bench_client.py
  tests/test_config_validation.py
  tests/test_detokenizer.py
)
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- "${QUICK_TESTS[@]}" "$@"
fi
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
