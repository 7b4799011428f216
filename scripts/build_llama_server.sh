#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` and `llama-quantize` (CPU only, Release) from the llama.cpp source
# vendored in the llama-cpp-python sdist, for `tokenmill bench compare --peer llama-server` (issue 18) and
# for making quantized GGUF files to test and benchmark with (issue 40, benchmarks/real_models.sh).
# Idempotent: a second run only prints the path, and an interrupted one resumes its build. Prints
# llama-server's path as its last line.
#
#   bash scripts/build_llama_server.sh             # nice 19, -j$(nproc); tens of minutes on a shared 2-core machine
#   JOBS=1 NICE=19 bash scripts/build_llama_server.sh
#   EXTRA_TARGETS="llama-bench llama-perplexity" bash scripts/build_llama_server.sh   # more llama.cpp tools, same build
#
# The sdist comes from the package index through pip (no other download: the web UI and every optional
# fetch are switched off). The binaries are built for this CPU (GGML_NATIVE) and live in
# $TOKENMILL_CACHE_DIR/llama.cpp/<version>-<cpu key>/bin/ (default ~/.cache/tokenmill), where the CPU key is
# a hash of /proc/cpuinfo's feature flags, so a machine with another CPU gets its own build. Beside them,
# <prefix>/convert/ keeps the same llama.cpp's HF-to-GGUF converter with the gguf-py it imports:
#
#   PYTHONPATH=<prefix>/convert/gguf-py python <prefix>/convert/convert_hf_to_gguf.py HF_DIR --outtype f16 --outfile X.gguf
#   <prefix>/bin/llama-quantize X.gguf Y.gguf Q4_K_M
#
# A cache made by an older version of this script (llama-server only) is completed: the missing pieces
# are built or copied. Needs cmake, a C/C++ compiler and make (apt-get install cmake build-essential).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# The version and the cache path come from tokenmill/bench/llama_server.py, the one place that knows them.
VERSION=${LLAMA_CPP_PYTHON_VERSION:-$("$PY" -c 'from tokenmill.bench.llama_server import LLAMA_CPP_PYTHON_VERSION as v; print(v)')}
BIN=$("$PY" -c 'import sys; from tokenmill.bench.llama_server import default_binary_path as p; print(p(sys.argv[1]))' "$VERSION")
PREFIX=$(dirname "$(dirname "$BIN")")
# Every binary this build makes, llama-server first; EXTRA_TARGETS adds other llama.cpp cmake targets.
TARGETS=(llama-server llama-quantize ${EXTRA_TARGETS:-})
CONVERT="$PREFIX/convert"
# complete: every target is installed and runs, and the converter with its gguf-py is kept.
complete() {
  binaries_built && converter_kept
}
# converter_kept: convert_hf_to_gguf.py is in $CONVERT with the packages it imports from its own tree.
converter_kept() {
  [ -f "$CONVERT/convert_hf_to_gguf.py" ] && [ -d "$CONVERT/gguf-py/gguf" ] && [ -d "$CONVERT/conversion" ]
}
binaries_built() {
  local t
  for t in "${TARGETS[@]}"; do
    [ -x "$PREFIX/bin/$t" ] || return 1
  done
  "$BIN" --version >/dev/null 2>&1
}
if complete; then
  echo "$BIN"
  exit 0
fi
if ! command -v cmake >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "installing cmake with apt-get" >&2
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends cmake; } >&2
  else
    echo "error: cmake is missing (and no apt-get to install it)" >&2
    exit 1
  fi
fi
# The sources and the build tree stay beside the binary until it is installed, so an interrupted build
# (a stopped session) resumes where it was; they are removed once the binary is in place.
WORK="$PREFIX/work"
mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "downloading the llama-cpp-python $VERSION sdist" >&2
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$WORK/dl" >&2
  mv "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || tar -xzf "$SDIST" -C "$WORK"
[ -f "$SRC/CMakeLists.txt" ] || { echo "error: no vendored llama.cpp in the sdist ($SRC)" >&2; exit 1; }
NICE=${NICE:-19}
JOBS=${JOBS:-$(nproc)}
# No AMX code: with GGML_NATIVE on an AMX CPU ggml builds its AMX matmul, which crashed llama-server on
# this project's Intel Xeon VMs (general protection fault in ggml_backend_amx_mul_mat), even with
# --no-repack under load. Explicit -mno-* flags win over -march=native in GCC and Clang.
NO_AMX=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
if ! binaries_built; then
  echo "building ${TARGETS[*]} (Release, CPU only, -j$JOBS, nice $NICE) into $PREFIX" >&2
  nice -n "$NICE" cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release "${NO_AMX[@]}" \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$WORK/cmake.log" 2>&1 \
    || { tail -40 "$WORK/cmake.log" >&2; exit 1; }
  nice -n "$NICE" cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$JOBS" >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log" >&2; exit 1; }
  mkdir -p "$PREFIX/bin"
  # llama-server last, so that a build interrupted while installing is not taken for a complete one by
  # tokenmill (which looks only at llama-server); each copy is atomic: a half-copied binary is never in bin/.
  for t in "${TARGETS[@]:1}" llama-server; do
    install -m 755 "$WORK/build/bin/$t" "$PREFIX/bin/$t.tmp"
    mv -f "$PREFIX/bin/$t.tmp" "$PREFIX/bin/$t"
  done
fi
if ! converter_kept; then
  # The converter and what it imports from its own tree (the gguf-py it was written against, its
  # per-architecture `conversion` package, chat templates where the sdist has them), copied out of the
  # source tree before that is removed.
  [ -f "$SRC/convert_hf_to_gguf.py" ] && [ -d "$SRC/gguf-py/gguf" ] && [ -d "$SRC/conversion" ] \
    || { echo "error: no convert_hf_to_gguf.py with gguf-py and conversion/ in $SRC" >&2; exit 1; }
  echo "keeping llama.cpp's convert_hf_to_gguf.py and gguf-py in $CONVERT" >&2
  rm -rf "$CONVERT.tmp"
  mkdir -p "$CONVERT.tmp"
  cp "$SRC/convert_hf_to_gguf.py" "$SRC/LICENSE" "$CONVERT.tmp/"
  cp -r "$SRC/gguf-py" "$SRC/conversion" "$CONVERT.tmp/"
  if [ -d "$SRC/models/templates" ]; then
    mkdir -p "$CONVERT.tmp/models" && cp -r "$SRC/models/templates" "$CONVERT.tmp/models/"
  fi
  rm -rf "$CONVERT"
  mv "$CONVERT.tmp" "$CONVERT"   # the whole directory at once: converter_kept never sees half of it
fi
# What bench compare reads to know this binary has no AMX code, so it needs no --no-repack guard.
echo "amx=$([ ${#NO_AMX[@]} -gt 0 ] && echo off || echo none-on-this-cpu)" > "$PREFIX/build-info.txt"
rm -rf "$WORK"
"$BIN" --version >&2 2>&1 || true
echo "$BIN"
