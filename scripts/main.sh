#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh >/dev/null
./build/kvshard plan --model llama-3.1-405b --hardware h100-sxm --gpus 16 --context 131072
