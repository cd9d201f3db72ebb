#!/usr/bin/env bash
# Installs Scalai's build and test dependencies from Debian 12's packages.
# Idempotent: packages already present are skipped, so a second run is quick.
set -euo pipefail

packages=(
  meson ninja-build pkg-config g++
  libabsl-dev librocksdb-dev libfuse3-dev fuse3
  nlohmann-json3-dev libcli11-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  etcd-server etcd-client openssl iperf3
  libzip-dev libre2-dev
  python3-numpy python3-torch python3-matplotlib clang-format git tar
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "scalai: installing ${missing[*]}" >&2
  if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
