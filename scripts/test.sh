#!/usr/bin/env bash
# Set up, then run the whole test suite. Extra args go to pytest (then it runs them in one process).
# `--quick` runs only QUICK_TESTS instead: scheduler, KV cache, sampling, small kernels, config checks and the
# detokenizer; no model weights; about 30 seconds.
# With no args the suite runs as one pytest-xdist worker per core (at most 4), one test file per worker at
# a time (--dist loadfile, so module fixtures such as servers start once), then SERIAL_TESTS alone: most
# files leave a core idle (one-thread work, process start-up, HTTP waits), so this takes about 15-20 minutes
# on a quiet 2-core machine (2026-12-07: 14.2-19.5 min, then 1.3-1.7 min for SERIAL_TESTS) instead of about 29.
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
# Run with no other test file beside them: a server and an offline engine compared on seeded samples.
SERIAL_TESTS=(
  tests/test_server_structured_output.py
)
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- "${QUICK_TESTS[@]}" "$@"
fi
bash scripts/setup.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
fi
workers=$(nproc 2>/dev/null || echo 1)
[ "$workers" -gt 4 ] && workers=4
ignores=()
for t in "${SERIAL_TESTS[@]}"; do ignores+=(--ignore "$t"); done
status=0
if [ "$workers" -gt 1 ]; then
  .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -n "$workers" --dist loadfile "${ignores[@]}" \
    || status=$?
else
  .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${ignores[@]}" || status=$?
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 "${SERIAL_TESTS[@]}" || status=$?
exit "$status"
