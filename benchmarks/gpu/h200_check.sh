#!/usr/bin/env bash
# The one GPU session script: kernels, CUDA tests, bf16 equality with transformers, graphs on vs off,
# and the decode benchmark. Run from the repo root: `bash benchmarks/gpu/h200_check.sh`.
# Needs no network and no install: python3 with torch, triton, numpy, transformers, safetensors,
# tokenizers, tqdm, pytest (all in the H200 image). Each stage has its own time limit; the whole
# script is sized to finish in under 8 minutes. Prints labelled results; with $OUT set, writes
# $OUT/h200_summary.json and $OUT/h200_log.txt.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
WORK=$(mktemp -d)
LOG=${OUT:+$OUT/h200_log.txt}
LOG=${LOG:-$WORK/log.txt}
exec > >(tee -a "$LOG") 2>&1

START=$(date +%s)
echo "== h200_check $(date -u +%FT%TZ) =="
missing=$($PY - <<'EOF'
import importlib.util
need = ["torch", "triton", "numpy", "transformers", "safetensors", "tokenizers", "tqdm", "pytest", "yaml", "jinja2"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "FATAL: python packages missing: $missing (carry them as wheels, see /work/.library/device/README.md)"
    exit 2
fi
$PY -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device';
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '|', torch.cuda.get_device_name())" || { echo "FATAL: no usable CUDA device"; exit 2; }

declare -A STATUS
stage() {  # stage NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo; echo "== [$name] (limit ${limit}s) =="
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    STATUS[$name]="$rc $(( $(date +%s) - t0 ))"
    echo "== [$name] exit $rc in $(( $(date +%s) - t0 ))s =="
}

# Limits add up to 7m40s; the stages are expected to take well under them.
stage kernels 90 $PY benchmarks/gpu/kernel_check.py
stage cuda_tests 100 $PY -m pytest -q -p no:cacheprovider -x tests/test_cuda_runner_logic.py \
    tests/test_triton_elementwise.py
stage equality 120 $PY benchmarks/gpu/greedy_equality.py --json "$WORK/equality.json"
stage benchmark 150 $PY benchmarks/gpu/decode_benchmark.py --json "$WORK/benchmark.json"

echo; echo "== summary ($(( $(date +%s) - START ))s) =="
overall=0
for name in kernels cuda_tests equality benchmark; do
    read -r rc secs <<<"${STATUS[$name]}"
    [ "$rc" = 0 ] || overall=1
    verdict=$([ "$rc" = 0 ] && echo PASS || { [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo TIMEOUT || echo FAIL; })
    echo "  $name: $verdict (exit $rc, ${secs}s)"
    echo "$name $rc $secs" >>"$WORK/status.txt"
done
$PY - "$WORK" "${OUT:-}" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), sys.argv[2]
summary = {"stages": {}}
for line in (work / "status.txt").read_text().splitlines():
    name, rc, secs = line.split()
    summary["stages"][name] = {"exit": int(rc), "seconds": int(secs)}
for name in ("equality", "benchmark"):
    path = work / f"{name}.json"
    if path.exists():
        summary[name] = json.loads(path.read_text())
if out:
    Path(out, "h200_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}/h200_summary.json")
EOF
rm -rf "$WORK"
exit $overall
