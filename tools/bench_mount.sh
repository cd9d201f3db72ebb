#!/usr/bin/env bash
# Sequential reads (1 MiB blocks) of every rank's model.safetensors through the
# mount, by one reader and by eight at once, against the strongest peers in
# the same run: libfuse's own passthrough_ll example (built from the examples
# Debian's libfuse3-dev ships) serving the same blob files in its fastest
# mode (cache=never: it splices each read from the blob straight into the
# reader's buffer), and `dd` of the blobs themselves; once with the blobs in
# the page cache and once after dropping it. Also times `ls -lR` of a
# 64-rank, 300-tensor step. Run by hand, as root (it drops the page cache):
#   tools/bench_mount.sh [WORKDIR]
# SCALAI=path/to/scalai measures another build (a "before") with this script.
# ROUNDS=N (default 3) takes every figure N times and reports the median with
# the range: on a virtual machine one figure can vary twofold between runs.
# SETTLE=S (default 4) is the pause before each figure (see settle below);
# SETTLE=0 measures right after the step before, as this script used to.
# COPY_BLOBS=1 gives each assembled figure a store whose blobs are copied,
# not hard-linked (as this script did until 2026-12-06).
set -euo pipefail
cd "$(dirname "$0")/.."
scalai=${SCALAI:-$PWD/build/tools/scalai}
[[ -x $scalai ]] || { echo "build first: meson setup build && meson compile -C build" >&2; exit 2; }
work=${1:-$(mktemp -d /var/tmp/scalai-mount-bench.XXXXXX)}
mkdir -p "$work"
cleanup() {
  for m in "$work"/mnt "$work"/pt "$work"/mnt2; do mountpoint -q "$m" 2>/dev/null && umount -l "$m"; done
  rm -rf "$work"
}
trap cleanup EXIT
pt=$work/passthrough_ll
gcc -O2 /usr/share/doc/libfuse3-dev/examples/passthrough_ll.c $(pkg-config --cflags --libs fuse3) -o "$pt"

# Eight stored shards (tp=4,pp=2), about 2 GiB. Every figure is the first
# read after a fresh mount, so that the FUSE file's own page cache is empty.
model="layers=18,hidden=2048,heads=16,vocab=32000"
"$scalai" synth "$work/ckpt" --layout megatron-core-gpt --model "$model" --config tp=4,pp=2,dp=1 --seed 1 >/dev/null
"$scalai" init "$work/store" --layout megatron-core-gpt --param vocab_size=32000 >/dev/null
"$scalai" import "$work/store" "$work/ckpt" --config tp=4,pp=2,dp=1 >/dev/null
rm -rf "$work/ckpt"
blobs=("$work"/store/blobs/*)
bytes=$(du -cb "${blobs[@]}" | tail -1 | cut -f1)
gib=$(echo "$bytes / 1073741824" | bc -l)

# One reader: every file given in turn, 1 MiB at a time. Eight readers: one
# file each, all at once (eight copies of the one file when given one).
# Prints seconds.
now() { date +%s.%N; }
one_reader() { local t0; t0=$(now); for f in "$@"; do dd if="$f" of=/dev/null bs=1M status=none; done
               echo "$(now) - $t0" | bc -l; }
eight_readers() { local t0 files=("$@") i; t0=$(now)
  for i in 0 1 2 3 4 5 6 7; do dd if="${files[$((i % ${#files[@]}))]}" of=/dev/null bs=1M status=none & done
  wait; echo "$(now) - $t0" | bc -l; }
# Figures for eight readers of one file count the bytes eight readers get.
cold() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# Every figure starts from memory that has been free a while, as on a
# machine that has been running. On a VM whose balloon reports free pages
# to the host (free page reporting, as here), pages freed in the last
# second or two are still backed by the host and cheap to fill again, while
# older free pages cost a trip to the hypervisor each at first touch (0.4
# GB/s here, against 8 GB/s for just-freed ones): without a pause, what the
# step before freed (an unmount, drop_caches) decides the next figure more
# than the reader.
settle() { sleep "${SETTLE:-4}"; }
# The blobs of the store being measured (measure's `store`) in the cache.
warm() { cat "$store"/blobs/* >/dev/null; }

mkdir -p "$work/mnt" "$work/pt"
# A copy of store $1 at $2: its catalog copied, its blobs linked (or
# copied, with COPY_BLOBS=1), synced.
copy_store() {
  mkdir "$2"
  find "$1" -mindepth 1 -maxdepth 1 ! -name blobs -exec cp -a {} "$2/" \;
  if [[ ${COPY_BLOBS:-0} == 1 ]]; then cp -a "$1/blobs" "$2/blobs"; else cp -al "$1/blobs" "$2/blobs"; fi
  sync
}
ranks() { ls -d "$work"/mnt/ckpt/latest/rank-*/model.safetensors; }
# $1: what to measure (one|eight|same), $2: cold|warm, $3: config or "pt".
measure() {
  local how=$1 cache=$2 what=$3 files store=$work/store
  if [[ $what == "$assembled" ]]; then
    # Mounting under another config starts storing the step under it
    # (materialization, running beside the reads as it would after a
    # reconfiguration), which replaces the blobs: each time on a new copy
    # of the store whose blobs are hard links (blobs are never written
    # once stored; the new ones are new files), so that it reads the same
    # pages as the stored figures and the references. On this VM, reading
    # freshly copied blobs through the mount took assembled shards two to
    # three times as long, and stored ones longer too (docs/benchmarks.md).
    # COPY_BLOBS=1 copies them, as before.
    rm -rf "$work/copy" && copy_store "$work/store" "$work/copy" && store=$work/copy
  fi
  $cache
  settle
  if [[ $what == pt ]]; then
    "$pt" -o source="$work/source",cache=never "$work/pt"
    files=("$work"/pt/*)
  elif [[ $what == dd ]]; then
    files=("${blobs[@]}")
  else
    "$scalai" mount "$store" "$work/mnt" --config "$what" >/dev/null
    mapfile -t files < <(ranks)
  fi
  case $how in
    one) one_reader "${files[@]}" ;;
    eight) eight_readers "${files[@]}" ;;
    same) eight_readers "${files[0]}" ;;
  esac
  if [[ $what == pt ]]; then umount "$work/pt"; elif [[ $what != dd ]]; then "$scalai" umount "$work/mnt"; fi
}

stored=tp=4,pp=2,dp=1
assembled=tp=8,pp=1,dp=1
# passthrough_ll serves the stored step's blobs alone.
mkdir -p "$work/source" && ln "${blobs[@]}" "$work/source/"
first_file_gib=$(echo "$(stat -c %s "${blobs[0]}") / 1073741824" | bc -l)
rounds=${ROUNDS:-3}
# all[key]: every round's seconds, space-separated.
declare -A all
for ((round = 1; round <= rounds; round++)); do
  for cache in warm cold; do
    for what in dd pt $stored $assembled; do
      all[$cache,one,$what]+=" $(measure one $cache $what)"
      all[$cache,eight,$what]+=" $(measure eight $cache $what)"
    done
    # Eight readers of one stored rank (data-parallel replicas reading one
    # shard), against eight readers of its blob through passthrough_ll.
    for what in pt $stored dd; do
      all[$cache,same,$what]+=" $(measure same $cache $what)"
    done
  done
done
# t[key]: the median; range[key]: "min-max" of the rounds.
declare -A t range
for key in "${!all[@]}"; do
  mapfile -t sorted < <(printf '%s\n' ${all[$key]} | sort -g)
  n=${#sorted[@]}
  if ((n % 2)); then t[$key]=${sorted[n / 2]}
  else t[$key]=$(echo "(${sorted[n / 2 - 1]} + ${sorted[n / 2]}) / 2" | bc -l); fi
  range[$key]=$(printf '%.2f-%.2f' "${sorted[0]}" "${sorted[n - 1]}")
done

rate() { printf '%5.2f GiB/s' "$(echo "$2 / $1" | bc -l)"; }
ratio() { printf '%5.2fx' "$(echo "$2 / $1" | bc -l)"; }
printf 'reading %.2f GiB (8 shard files of a tp=4,pp=2 step), 1 MiB blocks, first read after mount\n' "$gib"
printf 'median of %d rounds (range in seconds); ratios of the medians; %s s pause before each\n' "$rounds" "${SETTLE:-4}"
for cache in warm cold; do
  if [[ $cache == warm ]]; then
    title="blobs in the page cache" against="vs page cache"
  else
    title="cold cache (drop_caches first)" against="vs dd (cold)"
  fi
  printf '\n%-52s %8s %-11s %-11s  %-18s%s\n' "$title" time range rate "vs passthrough_ll" "$against"
  for how in one eight same; do
    size=$gib; [[ $how == same ]] && size=$(echo "$first_file_gib * 8" | bc -l)
    whats=(dd pt $stored $assembled); [[ $how == same ]] && whats=(dd pt $stored)
    for what in "${whats[@]}"; do
      case $what in
        dd) label="dd of the blobs" ;; pt) label="passthrough_ll, cache=never" ;;
        $stored) label="scalai, stored shards" ;; *) label="scalai, assembled ($assembled)" ;;
      esac
      case $how in one) label="1 reader:  $label" ;; eight) label="8 readers: $label" ;; same) label="8 on 1:    $label" ;; esac
      secs=${t[$cache,$how,$what]}
      line=$(printf '%-52s %6.2f s %-11s %s' "$label" "$secs" "(${range[$cache,$how,$what]})" "$(rate "$secs" "$size")")
      if [[ $what != dd && $what != pt ]]; then
        line+="  $(ratio "$secs" "${t[$cache,$how,pt]}")            $(ratio "$secs" "${t[$cache,$how,dd]}")"
      fi
      echo "$line"
    done
  done
done

# ls -lR of a 64-rank step with 300 tensors a rank.
"$scalai" init "$work/wide" --layout megatron-core-gpt --param vocab_size=1024 >/dev/null
"$scalai" synth "$work/wide-ckpt" --layout megatron-core-gpt --config tp=1,pp=1,dp=1 \
  --model layers=30,hidden=64,heads=4,vocab=1024,bias=1 --dtype f32 >/dev/null
"$scalai" import "$work/wide" "$work/wide-ckpt" --config tp=1,pp=1,dp=1 >/dev/null
mkdir -p "$work/mnt2"
"$scalai" mount "$work/wide" "$work/mnt2" --config tp=1,pp=1,dp=64 >/dev/null
tensors=$(ls "$work/mnt2/ckpt/latest/rank-00000/tensors" | wc -l)
t0=$(date +%s.%N); files=$(ls -lR "$work/mnt2" | wc -l); t1=$(date +%s.%N)
"$scalai" umount "$work/mnt2"
printf 'ls -lR of a 64-rank step, %d tensors a rank (%d lines): %.3f s\n' "$tensors" "$files" "$(echo "$t1 - $t0" | bc -l)"
