#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the serving benchmark's peer, from the llama.cpp sources vendored in the
# llama-cpp-python sdist (the package registry serves it; the version is the one the other benchmarks use).
# Usage: benchmarks/build_llama_server.sh OUT_DIR [PYTHON]
#   The binary ends up in OUT_DIR/bin/llama-server; nothing is done when it is already there.
# It is linked statically (BUILD_SHARED_LIBS=OFF) so the binary does not depend on the temporary build tree.
# Extra compiler flags come from LLAMA_CFLAGS (the Makefile passes its no-AMX flags: some VMs advertise AMX
# in CPUID without enabling its register state, and a native build then dies with SIGILL on its first tile op).
set -euo pipefail
version=0.3.36
out=$(mkdir -p "$1" && cd "$1" && pwd)
python=${2:-python3}
if [ -x "$out/bin/llama-server" ]; then
    echo "$out/bin/llama-server (already built)"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cflags=${LLAMA_CFLAGS:-}
echo "configuring llama.cpp (log: $work/cmake.log)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
      -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" > "$work/cmake.log" 2>&1 \
    || { tail -n 40 "$work/cmake.log"; exit 1; }
echo "building llama-server (about 10 minutes on 2 cores)"
cmake --build "$work/build" --target llama-server -j 2 > "$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log"; exit 1; }
mkdir -p "$out/bin"
cp "$work/build/bin/llama-server" "$out/bin/llama-server.tmp"
mv "$out/bin/llama-server.tmp" "$out/bin/llama-server"
echo "$out/bin/llama-server"
