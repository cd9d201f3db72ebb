#!/bin/bash
# Coverage-guided fuzzing of Scalai's parsers (tests/fuzz/parser_targets.cc)
# with clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer.
#   tools/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
# Builds in build-fuzz/ (clang, from Debian's clang package), keeps each
# target's corpus in build-fuzz/corpus/TARGET, and stops at the first
# finding, leaving libFuzzer's crash-* file with the input that caused it.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
dir=build-fuzz
if ! command -v clang++ > /dev/null; then
  echo "fuzz.sh: needs clang (apt-get install clang)" >&2
  exit 2
fi
if [ ! -f "$dir/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$dir" -Dfuzz=true -Dcuda=disabled \
    -Dwerror=false -Db_sanitize=address,undefined -Db_lundef=false \
    -Dcpp_args=-fsanitize=fuzzer-no-link -Dwrap_mode=nodownload > /dev/null
fi
ninja -C "$dir" tests/fuzz/parser_fuzz
fuzzer=$dir/tests/fuzz/parser_fuzz
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(parallel_config model_spec layout safetensors pickle
           megatron_index cluster_file)
fi
for target in "${targets[@]}"; do
  corpus=$dir/corpus/$target
  mkdir -p "$corpus"
  SCALAI_FUZZ_TARGET=$target SCALAI_FUZZ_SEEDS=$corpus "$fuzzer"
  echo "== $target: $seconds s"
  log=$dir/$target.log
  if ! SCALAI_FUZZ_TARGET=$target "$fuzzer" "$corpus" \
      -max_total_time="$seconds" -max_len=65536 -timeout=10 \
      -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$dir/$target-" > "$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz.sh: $target failed; the input is in $(ls "$dir/$target"-* 2>/dev/null || echo '(none)'), the log in $log" >&2
    exit 1
  fi
  grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
  echo "   corpus: $(ls "$corpus" | wc -l) inputs"
done
