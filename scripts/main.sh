#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh >/dev/null
./build/kvshard run --model tiny --prefill tp=8 --decode tp=4 --prompts 4 --prompt-len 64 --gen 16 --verify
