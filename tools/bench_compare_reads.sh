#!/usr/bin/env bash
# Reads through the mount by two scalai binaries in the same run: this
# build's and another (e.g. the commit before a change, built in a git
# worktree), each on its own store of the same 1.93 GiB checkpoint, rounds
# alternating, the blobs in the page cache, the first read after each mount
# (`dd`, 1 MiB blocks, every rank's model.safetensors). Prints each round and
# the medians. Run by hand:
#   git worktree add /tmp/before HEAD~1 && (cd /tmp/before && meson setup build && ninja -C build tools/scalai)
#   tools/bench_compare_reads.sh /tmp/before/build/tools/scalai [WORKDIR] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
new=$PWD/build/tools/scalai
other=${1:?usage: tools/bench_compare_reads.sh OTHER_SCALAI [WORKDIR] [ROUNDS]}
work=${2:-$(mktemp -d /var/tmp/scalai-compare-reads.XXXXXX)}
rounds=${3:-5}
mkdir -p "$work"
cleanup() {
  for m in "$work"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount -l "$m"; done
  rm -rf "$work"
}
trap cleanup EXIT
model="layers=18,hidden=2048,heads=16,vocab=32000"
"$new" synth "$work/ckpt" --layout megatron-core-gpt --model "$model" --config tp=2,pp=2,dp=1 --seed 1 >/dev/null
declare -A bin=([this]=$new [other]=$other)
for b in this other; do
  "${bin[$b]}" init "$work/$b" --layout megatron-core-gpt --param vocab_size=32000 >/dev/null
  "${bin[$b]}" import "$work/$b" "$work/ckpt" --config tp=2,pp=2,dp=1 >/dev/null
  mkdir -p "$work/mnt-$b"
done
rm -rf "$work/ckpt"
declare -A times
for ((round = 1; round <= rounds; round++)); do
  for b in this other; do
    cat "$work/$b"/blobs/* >/dev/null  # the blobs in the page cache
    "${bin[$b]}" mount "$work/$b" "$work/mnt-$b" >/dev/null
    t0=$(date +%s.%N)
    for f in "$work/mnt-$b"/ckpt/latest/rank-*/model.safetensors; do
      dd if="$f" of=/dev/null bs=1M status=none
    done
    t1=$(date +%s.%N)
    "${bin[$b]}" umount "$work/mnt-$b"
    t=$(echo "$t1 - $t0" | bc -l)
    times[$b]+="$t "
    printf 'round %d  %-5s %.3f s\n' "$round" "$b" "$t"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
m_this=$(echo "${times[this]}" | median)
m_other=$(echo "${times[other]}" | median)
printf 'median: this build %.3f s, the other %.3f s: this build takes %.2fx the time\n' \
  "$m_this" "$m_other" "$(echo "$m_this / $m_other" | bc -l)"
