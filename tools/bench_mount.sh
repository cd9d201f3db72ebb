#!/usr/bin/env bash
# Sequential reads (1 MiB blocks) of every rank's model.safetensors through the
# mount, against libfuse's own passthrough_ll example (built from the examples
# Debian's libfuse3-dev ships) serving the same blob files in the same caching
# mode (page cache), and `dd` of the blobs themselves, all in the same run.
# Also times `ls -lR` of a 64-rank, 300-tensor step. Run by hand:
#   tools/bench_mount.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
scalai=$PWD/build/tools/scalai
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

model="layers=18,hidden=2048,heads=16,vocab=32000"
"$scalai" synth "$work/ckpt" --layout megatron-core-gpt --model "$model" --config tp=2,pp=2,dp=1 --seed 1
"$scalai" init "$work/store" --layout megatron-core-gpt --param vocab_size=32000 >/dev/null
"$scalai" import "$work/store" "$work/ckpt" --config tp=2,pp=2,dp=1 >/dev/null
bytes=$(du -sb "$work/store/blobs" | cut -f1)
gib=$(echo "$bytes / 1073741824" | bc -l)

# Reads every file given, 1 MiB at a time; prints seconds.
read_all() { local t0 t1; t0=$(date +%s.%N); for f in "$@"; do dd if="$f" of=/dev/null bs=1M status=none; done
             t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l; }
rate() { printf '%6.2f GiB/s' "$(echo "$gib / $1" | bc -l)"; }

mkdir -p "$work/mnt" "$work/pt"
direct=$(read_all "$work"/store/blobs/*)
"$pt" -o source="$work/store/blobs",cache=auto "$work/pt"
ptll=$(read_all "$work"/pt/*)
umount "$work/pt"
"$scalai" mount "$work/store" "$work/mnt" >/dev/null
same=$(read_all "$work"/mnt/ckpt/latest/rank-*/model.safetensors)
"$scalai" umount "$work/mnt"
"$scalai" mount "$work/store" "$work/mnt" --config tp=4,pp=1,dp=1 >/dev/null
other=$(read_all "$work"/mnt/ckpt/latest/rank-*/model.safetensors)
"$scalai" umount "$work/mnt"

printf 'reading %.2f GiB (4 shard files), 1 MiB blocks, first read after mount\n' "$gib"
printf '%-46s %6.2f s %s\n' "dd of the blobs (page cache)" "$direct" "$(rate "$direct")"
printf '%-46s %6.2f s %s\n' "passthrough_ll, cache=auto" "$ptll" "$(rate "$ptll")"
printf '%-46s %6.2f s %s  %.2fx passthrough_ll\n' "scalai mount, stored config (from blobs)" "$same" "$(rate "$same")" "$(echo "$ptll / $same" | bc -l)"
printf '%-46s %6.2f s %s  %.2fx passthrough_ll\n' "scalai mount, tp=4,pp=1 (assembled)" "$other" "$(rate "$other")" "$(echo "$ptll / $other" | bc -l)"

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
