#!/usr/bin/env bash
# Saving a 1.93 GiB step (tp=2,pp=2,dp=1: four shard files, written by four
# processes at once with 1 MiB writes, each ending with fsync) four ways in
# the same run, onto the same filesystem:
#   direct           dd into a plain directory
#   O_DIRECT         dd oflag=direct into a plain directory: the disk's own
#                    rate, without the page cache (for orientation)
#   passthrough_ll   dd through libfuse's passthrough_ll example (built from
#                    the examples Debian's libfuse3-dev ships) into a plain
#                    directory
#   scalai           dd into ckpt/step-N/rank-R/model.safetensors of a mount;
#                    timed until the step has committed (`latest` moved)
# Rounds alternate the order; each write starts after a sync and a pause,
# since this VM's disk lags by seconds in write-back. CONFIG picks the
# saved config among those whose saving ranks are ranks 0..3: the default,
# or tp=2,pp=1,dp=2,fsdp=2 (a sharded step: each rank saves its chunks).
# SCALAI=path/to/scalai measures another build (a "before"). Run by hand:
#   [CONFIG=tp=2,pp=1,dp=2,fsdp=2] tools/bench_save.sh [WORKDIR] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
scalai=${SCALAI:-$PWD/build/tools/scalai}
[[ -x $scalai ]] || { echo "build first: meson setup build && meson compile -C build" >&2; exit 2; }
work=${1:-$(mktemp -d /var/tmp/scalai-save-bench.XXXXXX)}
rounds=${2:-3}
config=${CONFIG:-tp=2,pp=2,dp=1}
mkdir -p "$work"
cleanup() {
  for m in "$work"/mnt "$work"/pt; do mountpoint -q "$m" 2>/dev/null && umount -l "$m"; done
  rm -rf "$work"
}
trap cleanup EXIT
pt=$work/passthrough_ll
gcc -O2 /usr/share/doc/libfuse3-dev/examples/passthrough_ll.c $(pkg-config --cflags --libs fuse3) -o "$pt"

model="layers=18,hidden=2048,heads=16,vocab=32000"
"$scalai" synth "$work/ckpt" --layout megatron-core-gpt --model "$model" --config "$config" --seed 1
"$scalai" init "$work/store" --layout megatron-core-gpt --param vocab_size=32000 >/dev/null
"$scalai" import "$work/store" "$work/ckpt" --config "$config" --step 1 >/dev/null
ranks=(00000 00001 00002 00003)
[[ $(ls "$work/ckpt") == $(printf 'rank-%s\n' "${ranks[@]}") ]] || { echo "$config: its saving ranks are not ranks 0..3" >&2; exit 2; }
bytes=$(cat "$work"/ckpt/rank-*/model.safetensors | wc -c)
gib=$(echo "$bytes / 1073741824" | bc -l)
cat "$work"/ckpt/rank-*/model.safetensors > /dev/null  # sources in the page cache

settle() { sync; sleep 3; }
# Writes the four shards into DIR/rank-R<SUFFIX> at once, with dd's extra
# flags FLAGS; prints seconds.
write_all() {
  local dir=$1 suffix=$2 flags=${3:-} t0 t1
  t0=$(date +%s.%N)
  for r in "${ranks[@]}"; do
    # shellcheck disable=SC2086
    dd if="$work/ckpt/rank-$r/model.safetensors" of="$dir/rank-$r$suffix" bs=1M conv=fsync $flags status=none &
  done
  wait
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc -l
}

mkdir -p "$work/mnt" "$work/pt" "$work/plain" "$work/under"
"$pt" -o source="$work/under" "$work/pt"
"$scalai" mount "$work/store" "$work/mnt" >/dev/null
declare -a direct odirect ptll mount
step=2
for ((round = 0; round < rounds; ++round)); do
  order=(direct odirect ptll mount)
  ((round % 2)) && order=(mount ptll odirect direct)
  for what in "${order[@]}"; do
    rm -rf "$work"/plain/* "$work"/under/*
    settle
    case $what in
      direct) direct+=("$(write_all "$work/plain" "")") ;;
      odirect) odirect+=("$(write_all "$work/plain" "" oflag=direct)") ;;
      ptll) ptll+=("$(write_all "$work/pt" "")") ;;
      mount)
        for r in "${ranks[@]}"; do mkdir -p "$work/mnt/ckpt/step-$(printf %08d $step)/rank-$r"; done
        mount+=("$(write_all "$work/mnt/ckpt/step-$(printf %08d $step)" "/model.safetensors")")
        [[ $(readlink "$work/mnt/ckpt/latest") == step-$(printf %08d $step) ]] || { echo "step $step did not commit" >&2; cat "$work/mnt/status" >&2; exit 1; }
        step=$((step + 1)) ;;
    esac
  done
done
"$scalai" umount "$work/mnt"
umount "$work/pt"
"$scalai" fsck "$work/store" >/dev/null

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
rate() { printf '%.2f GiB/s' "$(echo "$gib / $1" | bc -l)"; }
d=$(median "${direct[@]}"); o=$(median "${odirect[@]}"); p=$(median "${ptll[@]}"); m=$(median "${mount[@]}")
printf 'saving %.2f GiB under %s (4 shards by 4 processes, 1 MiB writes, fsync each), median of %d\n' "$gib" "$config" "$rounds"
printf '%-34s %6.2f s  %s   runs: %s\n' "direct (dd into a directory)" "$d" "$(rate "$d")" "${direct[*]}"
printf '%-34s %6.2f s  %s   runs: %s\n' "O_DIRECT (dd oflag=direct)" "$o" "$(rate "$o")" "${odirect[*]}"
printf '%-34s %6.2f s  %s   runs: %s\n' "passthrough_ll" "$p" "$(rate "$p")" "${ptll[*]}"
printf '%-34s %6.2f s  %s   runs: %s\n' "scalai mount, until committed" "$m" "$(rate "$m")" "${mount[*]}"
printf 'scalai vs passthrough_ll: %.2fx   scalai vs direct: %.2fx   scalai vs O_DIRECT: %.2fx\n' \
  "$(echo "$p / $m" | bc -l)" "$(echo "$d / $m" | bc -l)" "$(echo "$o / $m" | bc -l)"
