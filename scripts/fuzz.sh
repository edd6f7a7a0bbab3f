#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (ASan + UBSan) into build-fuzz/ and runs each for
# FUZZ_SECONDS (default 60) over its corpus in fuzz/corpus/<target>/ (new inputs go to a scratch
# copy; the repo's corpus is only read). Exits non-zero on the first finding.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ not found (scripts/install-deps.sh installs it); not fuzzing" >&2
  exit 1
fi
seconds=${FUZZ_SECONDS:-60}
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DKVSHARD_SANITIZE=ON -DKVSHARD_BUILD_FUZZ=ON -DKVSHARD_BUILD_TESTS=OFF \
  -DKVSHARD_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target fuzz_all
targets=0
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for src in fuzz/*.cpp; do
  name=$(basename "$src" .cpp)
  mkdir -p "$scratch/$name"
  echo "fuzz: $name for ${seconds}s"
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
    "build-fuzz/fuzz/$name" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
    -print_final_stats=1 "$scratch/$name" "fuzz/corpus/$name" 2>&1 | tail -n 12
  targets=$((targets + 1))
done
echo "fuzz: every target ran ${seconds}s with no finding"
echo "fuzz: $targets passed, 0 failed"
