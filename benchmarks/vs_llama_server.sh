#!/usr/bin/env bash
# Issue 18's three workloads, tokenmill against llama.cpp's own llama-server, each in one
# `tokenmill bench compare --peer llama-server` run (same GGUF, same threads, same requests through the
# same client; docs/bench_compare.md), for each activation dtype in DTYPES. Prints the tables and
# writes each run's JSON to OUT. Needs the binary: bash scripts/build_llama_server.sh (or LLAMA_SERVER=PATH).
#
#   bash benchmarks/vs_llama_server.sh                       # float32 and bfloat16, 2 threads
#   DTYPES=bfloat16 WORKLOADS="batch1 c32" bash benchmarks/vs_llama_server.sh
#
# Workloads: batch1 = 4 requests one at a time (64-token random prompt, 128 new tokens; decode tok/s is
# the per-request rate after the first token); c32 = 32 such requests at once (llama-server -np 32);
# sharegpt = 200 ShareGPT prompts with their reference output lengths, SHAREGPT_CONCURRENCY in flight
# (llama-server -np the same). Runs vary 10-20% on a shared CPU: compare within a run only.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/vs_llama_server}
THREADS=${THREADS:-2}
DTYPES=${DTYPES:-float32 bfloat16}
WORKLOADS=${WORKLOADS:-batch1 c32 sharegpt}
SHAREGPT_CONCURRENCY=${SHAREGPT_CONCURRENCY:-64}
PEER=llama-server${LLAMA_SERVER:+=$LLAMA_SERVER}
# Extra llama-server arguments (bench compare adds --no-repack by itself on AMX CPUs; see its docs).
PEER_ARGS=${PEER_ARGS:-}
mkdir -p "$OUT"
for dtype in $DTYPES; do
  base=(.venv/bin/tokenmill bench compare --peer "$PEER" --num-threads "$THREADS" --dtype "$dtype" --disable-tqdm
        ${PEER_ARGS:+"--peer-args=$PEER_ARGS"})
  for workload in $WORKLOADS; do
    case $workload in
      batch1) args=(--dataset random --random-input-len 64 --random-output-len 128 --num-prompts 4 --max-concurrency 1) ;;
      c32) args=(--dataset random --random-input-len 64 --random-output-len 128 --num-prompts 32 --max-concurrency 32) ;;
      sharegpt) args=(--dataset sharegpt --num-prompts 200 --max-concurrency "$SHAREGPT_CONCURRENCY") ;;
      *) echo "unknown workload $workload (batch1, c32, sharegpt)" >&2; exit 2 ;;
    esac
    echo "== $workload, --dtype $dtype: ${base[*]} ${args[*]}"
    "${base[@]}" "${args[@]}" --result-file "$OUT/$workload-$dtype.json"
  done
done
