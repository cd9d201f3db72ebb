#!/usr/bin/env bash
# Installs what the build needs, builds Scalai and runs every test. Its last
# line is "N passed, N failed", counted from meson's test log; the exit status
# is 0 only when nothing failed and something ran.
set -uo pipefail
cd "$(dirname "$0")/.."

bash tools/install-deps.sh || exit 1
# Every library comes from Debian (install-deps.sh): the wraps in subprojects/
# are fallbacks for other machines, never downloaded by a build (meson.build's
# default, restated here for a build directory configured otherwise).
if [[ -d build/meson-private ]]; then
  meson setup --reconfigure -Dwrap_mode=nodownload build >/dev/null || exit 1
else
  meson setup -Dwrap_mode=nodownload build || exit 1
fi
meson compile -C build || exit 1

rm -f build/meson-logs/testlog.json
# The "gpu" suite needs a GPU; elsewhere it is left out, not failed.
gpu_suite=(--no-suite gpu)
if nvidia-smi -L >/dev/null 2>&1; then gpu_suite=(); fi
meson test -C build --print-errorlogs --num-processes "$(nproc)" \
  "${gpu_suite[@]}" "$@"

/usr/bin/python3 - build/meson-logs/testlog.json <<'PY'
import json, sys
passed = failed = skipped = 0
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    lines = []
for line in lines:
    result = json.loads(line)["result"]
    if result in ("OK", "EXPECTEDFAIL"):
        passed += 1
    elif result == "SKIP":
        skipped += 1
    else:
        failed += 1
if passed == 0 and failed == 0:
    failed = 1  # nothing ran: that is a failure, not a pass
print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
sys.exit(1 if failed else 0)
PY
