#!/usr/bin/env bash
# Every check of the GPU backend in one run, for a machine with an NVIDIA
# GPU: installs what the build needs, builds the GPU test and scalai, runs
# the "gpu" test suite, then `scalai gpu-bench`. Output goes to stdout and,
# when $OUT is set, to $OUT/gpu_check.log.
#
#   bash tools/gpu_check.sh            # on the GPU machine, from the repo root
set -uo pipefail
cd "$(dirname "$0")/.."
log=/dev/null
if [[ -n "${OUT:-}" ]]; then log="$OUT/gpu_check.log"; fi
{
  nvidia-smi -L || { echo "gpu_check: no GPU answers nvidia-smi"; exit 1; }
  # A machine without the network may lack none of them; try the build.
  bash tools/install-deps.sh >/dev/null ||
    echo "gpu_check: could not install dependencies; building with what is here"
  build=build-gpu
  if [[ -d $build/meson-private ]]; then
    meson setup --reconfigure $build -Dcuda=enabled >/dev/null || exit 1
  else
    meson setup $build -Dcuda=enabled >/dev/null || exit 1
  fi
  meson compile -C $build tests/gpu/gpu_backend_test tools/scalai || exit 1
  status=0
  $build/tests/gpu/gpu_backend_test || status=1
  $build/tools/scalai gpu-bench --size-mib 2048 || status=1
  echo "gpu_check: exit $status"
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
