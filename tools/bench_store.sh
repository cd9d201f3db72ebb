#!/usr/bin/env bash
# Import and export speed of a ~2 GiB checkpoint against `cp -r` + `sync` of the
# same files, in the same run, on the same filesystem. Run by hand:
#   tools/bench_store.sh [WORKDIR]       (default: a temporary dir under /var/tmp)
# Prints one line per measurement and the ratios (>= 1.0: faster than cp).
# Each timed command starts after a sync and a pause, so that the writeback of
# the one before (this VM disk lags by seconds) does not land on it.
set -euo pipefail
cd "$(dirname "$0")/.."
scalai=build/tools/scalai
[[ -x $scalai ]] || { echo "build first: meson setup build && meson compile -C build" >&2; exit 2; }
work=${1:-$(mktemp -d /var/tmp/scalai-bench.XXXXXX)}
trap 'rm -rf "$work"' EXIT
model="layers=18,hidden=2048,heads=16,vocab=32000"
config="tp=2,pp=2,dp=1"

"$scalai" synth "$work/ckpt" --layout megatron-core-gpt --model "$model" --config "$config" --seed 1
bytes=$(du -sb "$work/ckpt" | cut -f1)
sync

seconds() { local t0 t1; sync; sleep 3; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l; }
best() { printf '%s\n' "$@" | sort -g | head -n1; }
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }

cp_sync() { cp -r "$work/ckpt" "$work/cp"; sync; }
import_once() { "$scalai" init "$work/store" --layout megatron-core-gpt --param vocab_size=32000 >/dev/null
                "$scalai" import "$work/store" "$work/ckpt" --config "$config"; }
export_same() { "$scalai" export "$work/store" "$work/out" --config "$config"; }
export_other() { "$scalai" export "$work/store" "$work/out" --config tp=4,pp=1,dp=1; }

cp_t=() imp_t=() exp_t=() oth_t=()
for round in 1 2 3 4 5; do
  rm -rf "$work/cp" "$work/store" "$work/out"; sync
  cp_t+=("$(seconds cp_sync)")
  imp_t+=("$(seconds import_once)")
  # Import streams its blobs to disk and drops them from the page cache;
  # cp's source is cached, so the exports start from cached blobs too.
  cat "$work"/store/blobs/* > /dev/null
  exp_t+=("$(seconds export_same)"); rm -rf "$work/out"; sync
  oth_t+=("$(seconds export_other)")
done
cp_b=$(best "${cp_t[@]}") imp_b=$(best "${imp_t[@]}") exp_b=$(best "${exp_t[@]}") oth_b=$(best "${oth_t[@]}")
gib=$(echo "$bytes / 1073741824" | bc -l)
cp_m=$(median "${cp_t[@]}") imp_m=$(median "${imp_t[@]}") exp_m=$(median "${exp_t[@]}") oth_m=$(median "${oth_t[@]}")
printf 'checkpoint: %.2f GiB in %s (%s), best of 5\n' "$gib" "$config" "$model"
printf '%-34s %7.2f s  %6.2f GiB/s\n' "cp -r + sync (reference)" "$cp_b" "$(echo "$gib / $cp_b" | bc -l)"
printf '%-34s %7.2f s  %6.2f GiB/s  %.2fx cp\n' "scalai import" "$imp_b" "$(echo "$gib / $imp_b" | bc -l)" "$(echo "$cp_b / $imp_b" | bc -l)"
printf '%-34s %7.2f s  %6.2f GiB/s  %.2fx cp\n' "scalai export (same config)" "$exp_b" "$(echo "$gib / $exp_b" | bc -l)" "$(echo "$cp_b / $exp_b" | bc -l)"
printf '%-34s %7.2f s  %6.2f GiB/s  %.2fx cp\n' "scalai export (tp=4,pp=1: resharded)" "$oth_b" "$(echo "$gib / $oth_b" | bc -l)" "$(echo "$cp_b / $oth_b" | bc -l)"
printf 'medians: cp %.2f s, import %.2f s (%.2fx), export %.2f s (%.2fx), resharded export %.2f s (%.2fx)\n' \
  "$cp_m" "$imp_m" "$(echo "$cp_m / $imp_m" | bc -l)" "$exp_m" "$(echo "$cp_m / $exp_m" | bc -l)" \
  "$oth_m" "$(echo "$cp_m / $oth_m" | bc -l)"
