#!/usr/bin/env bash
# Popular models' real shapes, every common quantized format, tokenmill against llama.cpp's llama-server
# (issue 40, item 5). Random-weight models with the published configs of Llama-3.2-1B, Qwen2.5-1.5B,
# SmolLM2-1.7B and Qwen3-1.7B (more by name, the MoE shapes olmoe-1b-7b and deepseek-v2-lite among them:
# `.venv/bin/python benchmarks/real_models.py shapes`) are
# made with transformers, converted by llama.cpp's own convert_hf_to_gguf.py to F16 and quantized by its
# llama-quantize to Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0, once, under
# ${TOKENMILL_CACHE_DIR:-~/.cache/tokenmill}/real_models/<shape>/<shape>-<FORMAT>.gguf (about 10 GB per
# shape). Then each file goes through `tokenmill bench compare --peer llama-server` (same file, same
# threads, same requests) on three workloads, REPEATS times (each run is tokenmill then llama-server, so
# the engines alternate); the report gives medians, the tokenmill/llama-server ratio measured within each
# run (median over runs), and each decode rate's share of the memory-bandwidth roofline (bytes a decode
# step reads, from the GGUF's tensors, / this machine's read bandwidth, measured at the start).
# Everything is in benchmarks/real_models.py's docstring.
#
#   bash benchmarks/real_models.sh                                   # everything: hours on a 2-core machine
#   SHAPES=llama3.2-1b FORMATS=Q4_K_M WORKLOADS=batch1 REPEATS=1 bash benchmarks/real_models.sh   # quick
#   MAKE_ONLY=1 SHAPES="llama3.2-1b smollm2-1.7b" bash benchmarks/real_models.sh                   # files only
#   ENGINES=llama-server bash benchmarks/real_models.sh              # llama-server alone (no tokenmill)
#   bash benchmarks/real_models.sh report                            # the tables again, from OUT
#
# Settings (environment): SHAPES, FORMATS (also F16), WORKLOADS (batch1 c32 ttft512), REPEATS (3),
# THREADS (2), ENGINES (both | llama-server), OUT (benchmarks/out/real_models: each run's JSON, the
# footprints, the bandwidth), TOKENMILL_ARGS (extra bench compare flags, e.g. "--dtype bfloat16"),
# PEER_ARGS (extra llama-server flags), LLAMA_SERVER (another llama-server binary), LLAMA_CPP_TOOLS (a
# prefix with bin/llama-quantize and convert/ instead of scripts/build_llama_server.sh's cached build,
# which is built first when missing: JOBS, NICE as for that script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run bash scripts/setup.sh first" >&2; exit 1; }
if [ -z "${LLAMA_CPP_TOOLS:-}" ]; then
  bash scripts/build_llama_server.sh >/dev/null   # llama-server, llama-quantize and the converter; idempotent
fi
CMD=${1:-run}
[ $# -gt 0 ] && shift
exec "$PY" benchmarks/real_models.py "$CMD" "$@"
