#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, and runs every test:
# the whole CTest suite (unit and mpirun tests) on the Release build, then the unit tests again
# under AddressSanitizer + UndefinedBehaviorSanitizer, then the fuzz targets for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
bash scripts/build.sh --asan
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -L unit
# The libFuzzer targets (config.json, safetensors headers, traces, hardware JSON, size flags), each
# for 60 s under ASan + UBSan with clang; any finding fails the run.
bash scripts/fuzz.sh
