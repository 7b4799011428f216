#!/usr/bin/env bash
# The one GPU session script: kernels, CUDA tests, bf16 equality with transformers, graphs on vs off,
# the decode benchmark, and hybrid (Gated DeltaNet) models on CUDA. Run from the repo root:
# `bash benchmarks/gpu/h200_check.sh`; `STAGES="hybrid" bash ...` runs only the stages named.
# Needs no network and no install: python3 with torch, triton, numpy, transformers, safetensors,
# tokenizers, tqdm, pytest (all in the H200 image). The hybrid stage also wants fla-core (pure
# Python, not in the image; einops, its one dependency, is): carry its wheel in .whl/ (here:
# `echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps -d .whl fla-core==0.6.0`,
# then name `.whl` in the run's carry); the stage installs it into a private folder on its own
# PYTHONPATH (installed for every stage, fla would also become transformers' own Qwen3-Next kernel).
# Without it the stage runs the CUDA path on the torch reference and fla's kernel tests skip.
# Each stage has its own time limit; the stages run well under them (the first four in under 8
# minutes). Prints labelled results; with $OUT set, writes $OUT/h200_summary.json and
# $OUT/h200_log.txt.
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

STAGES=${STAGES:-kernels cuda_tests equality benchmark hybrid}
want() { [[ " $STAGES " == *" $1 "* ]]; }

# Limits add up to 10m10s (7m40s without hybrid); the stages are expected to take well under them.
want kernels && stage kernels 90 $PY benchmarks/gpu/kernel_check.py
want cuda_tests && stage cuda_tests 100 $PY -m pytest -q -p no:cacheprovider -x tests/test_cuda_runner_logic.py \
    tests/test_triton_elementwise.py tests/test_moe_triton.py
want equality && stage equality 120 $PY benchmarks/gpu/greedy_equality.py --json "$WORK/equality.json"
want benchmark && stage benchmark 150 $PY benchmarks/gpu/decode_benchmark.py --json "$WORK/benchmark.json"
if want hybrid; then
    # Hybrid models (issue 20, docs/hybrid_models.md "CUDA"): fla's chunked and fused recurrent kernels under
    # tokenmill's calling convention against the torch reference, the prefill rounds, and a float32 CUDA engine
    # (decode CUDA graphs carrying the state update, and eager) against the CPU engine and transformers.
    FLA_PATH=
    if ls .whl/fla_core-*.whl >/dev/null 2>&1 && ! $PY -c "import fla" 2>/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$WORK/fla_site" .whl/fla_core-*.whl \
            && FLA_PATH="$WORK/fla_site:"
    fi
    PYTHONPATH="$FLA_PATH$PYTHONPATH" $PY -c "from tokenmill.linear_attention import fla_ops;
print('hybrid stage: fla-core', fla_ops.version() or 'NOT available: the torch reference runs, kernel tests skip')"
    stage hybrid 150 env PYTHONPATH="$FLA_PATH$PYTHONPATH" $PY -m pytest -q -p no:cacheprovider -rs -s \
        tests/test_hybrid_fla.py
fi

echo; echo "== summary ($(( $(date +%s) - START ))s) =="
overall=0
for name in $STAGES; do
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
