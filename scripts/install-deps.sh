#!/usr/bin/env bash
# Installs kvshard's build and test dependencies from Debian 12 packages.
# Idempotent: quiet and fast when everything is already present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenmpi-dev openmpi-bin
  libxxhash-dev nlohmann-json3-dev libcli11-dev libfmt-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev
  libssl-dev libcbor-dev python3-cbor2 python3-xxhash
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev python3-zmq python3-msgpack
  libcpp-httplib-dev
  python3-dev pybind11-dev python3-numpy python3-pytest
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
