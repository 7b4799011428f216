#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (CPU only, Release) from the llama.cpp source vendored in the
# llama-cpp-python sdist, for `tokenmill bench compare --peer llama-server` (issue 18). Idempotent:
# a second run only prints the path, and an interrupted one resumes its build. Prints the binary's path
# as its last line.
#
#   bash scripts/build_llama_server.sh             # nice 19, -j$(nproc); tens of minutes on a shared 2-core machine
#   JOBS=1 NICE=19 bash scripts/build_llama_server.sh
#
# The sdist comes from the package index through pip (no other download: the web UI and every optional
# fetch are switched off). The binary is built for this CPU (GGML_NATIVE) and lives in
# $TOKENMILL_CACHE_DIR/llama.cpp/<version>-<cpu key>/bin/llama-server (default ~/.cache/tokenmill), where the
# CPU key is a hash of /proc/cpuinfo's feature flags, so a machine with another CPU gets its own build.
# Needs cmake, a C/C++ compiler and make (apt-get install cmake build-essential).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# The version and the cache path come from tokenmill/bench/llama_server.py, the one place that knows them.
VERSION=${LLAMA_CPP_PYTHON_VERSION:-$("$PY" -c 'from tokenmill.bench.llama_server import LLAMA_CPP_PYTHON_VERSION as v; print(v)')}
BIN=$("$PY" -c 'import sys; from tokenmill.bench.llama_server import default_binary_path as p; print(p(sys.argv[1]))' "$VERSION")
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
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
PREFIX=$(dirname "$(dirname "$BIN")")
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
echo "building llama-server (Release, CPU only, -j$JOBS, nice $NICE) into $PREFIX" >&2
nice -n "$NICE" cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release "${NO_AMX[@]}" \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$WORK/cmake.log" 2>&1 \
  || { tail -40 "$WORK/cmake.log" >&2; exit 1; }
nice -n "$NICE" cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log" >&2; exit 1; }
mkdir -p "$PREFIX/bin"
install -m 755 "$WORK/build/bin/llama-server" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"   # atomic: a half-copied binary is never at $BIN
# What bench compare reads to know this binary has no AMX code, so it needs no --no-repack guard.
echo "amx=$([ ${#NO_AMX[@]} -gt 0 ] && echo off || echo none-on-this-cpu)" > "$PREFIX/build-info.txt"
rm -rf "$WORK"
"$BIN" --version >&2 2>&1 || true
echo "$BIN"
