#!/usr/bin/env bash
# Configures and builds kvshard into build/ (Release) or, with --asan, build-asan/ (ASan + UBSan).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build
flags=(-DCMAKE_BUILD_TYPE=Release)
if [ "${1:-}" = "--asan" ]; then
  dir=build-asan
  flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSHARD_SANITIZE=ON -DKVSHARD_BUILD_BENCH=OFF)
fi
jobs=$(nproc)
cmake -S . -B "$dir" -G Ninja "${flags[@]}" >/dev/null
cmake --build "$dir" -j "$jobs"
