#!/usr/bin/env bash
# The main job's demo: installs what it needs, builds Scalai, writes a small
# synthetic GPT checkpoint under one parallel config, keeps it in a store,
# shows what changing tp, pp and dp moves and the resharded shards, mounts it,
# reconfigures it while mounted, saves a step through it, and ends with a
# PyTorch job trained through a mount across three reconfigurations, with a
# report and a plot of its loss against an uninterrupted run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/install-deps.sh
if [[ ! -d build/meson-private ]]; then meson setup -Dwrap_mode=nodownload build >/dev/null; fi
meson compile -C build >/dev/null

scalai=build/tools/scalai
work=$(mktemp -d /tmp/scalai-demo.XXXXXX)
trap 'mountpoint -q "$work/mnt" && umount -l "$work/mnt"; rm -rf "$work"' EXIT
model="layers=8,hidden=512,heads=8,groups=4,vocab=32000,gated_linear_unit=1"

if [[ -t 1 ]]; then bold=$'\033[1m' plain=$'\033[0m'; else bold='' plain=''; fi
step() { printf '\n%s$ %s%s\n' "$bold" "$*" "$plain"; "$@"; }

echo "== A Megatron-Core GPT (8 layers, SwiGLU, GQA) saved under tp=2,pp=2,dp=2 =="
step "$scalai" synth "$work/ckpt" --layout megatron-core-gpt --model "$model" \
  --config tp=2,pp=2,dp=2 --dtype bf16 --seed 1
step ls -l "$work/ckpt"/rank-00000 "$work/ckpt"/rank-00005

echo
echo "== Keep it in a store: import, inspect, verify =="
step "$scalai" init "$work/job" --layout megatron-core-gpt --param vocab_size=32000 \
  --param gated_linear_unit=1 --param num_attention_heads=8 --param num_query_groups=4
step "$scalai" import "$work/job" "$work/ckpt" --config tp=2,pp=2,dp=2 --step 100
step "$scalai" fsck "$work/job"

echo
echo "== Its data: 10000 JSONL lines read in place, a global batch of 32, 2 epochs =="
/usr/bin/python3 -c "
import json, random
r = random.Random(5)
with open('$work/web.jsonl', 'w') as f:
    for i in range(10000):
        f.write(json.dumps({'doc': i, 'text': ' '.join(r.choice(['tp', 'pp', 'dp', 'mount', 'shard']) for _ in range(r.randrange(2, 9)))}) + '\\n')"
step "$scalai" dataset add "$work/job" web --format jsonl --global-batch 32 --epochs 2 \
  "$work/web.jsonl"
step "$scalai" inspect "$work/job"

echo
echo "== Shrink to 4 GPUs as tp=4,pp=1,dp=1: what moves? =="
step "$scalai" plan --layout megatron-core-gpt --model "$model" \
  --from tp=2,pp=2,dp=2 --to tp=4,pp=1,dp=1

echo "== The same job with its state sharded FSDP-style: halving dp moves only the chunks whose owner changed =="
step "$scalai" plan --layout megatron-core-gpt --model "$model" \
  --from tp=2,pp=1,dp=4,fsdp=4 --to tp=2,pp=1,dp=2,fsdp=2

echo
echo "== tp=8 would cut the 4 query groups in halves, which no framework can load: refused =="
step "$scalai" plan "$work/job" --to tp=8,pp=1,dp=1 || true

step "$scalai" export "$work/job" "$work/tp4" --config tp=4,pp=1,dp=1
step ls -l "$work/tp4"/rank-00000

if [[ -e /dev/fuse ]]; then
  echo
  echo "== Mount it under tp=4,pp=1,dp=2: every rank's shard as files, computed on read =="
  mkdir -p "$work/mnt"
  step "$scalai" mount "$work/job" "$work/mnt" --config tp=4,pp=1,dp=2
  step ls "$work/mnt" "$work/mnt/ckpt/latest"
  step ls -l "$work/mnt/ckpt/latest/rank-00005"
  step /usr/bin/python3 -c "import json; print(json.load(open('$work/mnt/ckpt/latest/rank-00005/rank.json'))['tensors']['output_layer.weight'])"
  echo
  echo "== The data as each data-parallel rank reads it, from step 100's position (100 x 32) =="
  step find "$work/mnt/data" -maxdepth 3
  step cat "$work/mnt/data/web/dataset.json" "$work/mnt/data/web/rank-00001/rank.json"
  step sh -c "od -An -tu8 -N32 '$work/mnt/data/web/rank-00001/sample-ids.u64'; head -n 2 '$work/mnt/data/web/rank-00001/samples.jsonl'; cat '$work/mnt/data/web/rank-00001/samples/0'; echo"
  echo
  echo "== Two GPUs fail: shrink to tp=1,pp=2,dp=1 while mounted. Views switch at once; =="
  echo "== the new shards are written in the background, only the bytes that must move =="
  echo "== (plan reads the store's catalog beside the mount that serves it) =="
  step "$scalai" plan "$work/job" --to tp=1,pp=2,dp=1
  step sh -c "echo tp=1,pp=2,dp=1 > '$work/mnt/config'; cat '$work/mnt/status'; ls '$work/mnt/ckpt/latest'"
  step "$scalai" reconfigure "$work/mnt" tp=1,pp=2,dp=1 --wait
  step cat "$work/mnt/status"
  echo "== One data-parallel rank now reads every sample of each batch, from the same position =="
  step sh -c "ls '$work/mnt/data/web'; cat '$work/mnt/data/web/rank-00000/rank.json'; od -An -tu8 -N64 '$work/mnt/data/web/rank-00000/sample-ids.u64'"
  step "$scalai" reconfigure "$work/mnt" tp=1,pp=2,dp=4 --wait
  echo
  echo "== The job saves step 200 through the mount: each rank writes its extra/ files, then =="
  echo "== its model.safetensors; the step commits when every dp_rank 0 rank closed a valid one =="
  cat > "$work/save.sh" <<'EOF'
# What each saving worker does: its extra/ files first, then its shard.
ckpt=$1 rank=$2
mkdir -p "$ckpt/step-00000200/rank-$rank/extra"
echo "{\"rng_state\": \"of rank $rank\"}" > "$ckpt/step-00000200/rank-$rank/extra/rng.json"
cp "$ckpt/step-00000100/rank-$rank/model.safetensors" "$ckpt/step-00000200/rank-$rank/"
EOF
  step cat "$work/save.sh"
  step sh -c "sh '$work/save.sh' '$work/mnt/ckpt' 00000 & sh '$work/save.sh' '$work/mnt/ckpt' 00004 & wait
    ls -l '$work/mnt/ckpt'; cat '$work/mnt/status'"
  step sh -c "ls -l '$work/mnt/ckpt/latest/rank-00004' '$work/mnt/ckpt/latest/rank-00004/extra'; cat '$work/mnt/ckpt/latest/rank-00004/extra/rng.json'"
  echo "== A shard that does not fit its rank fails its close, and status says why =="
  step sh -c "mkdir -p '$work/mnt/ckpt/step-00000300/rank-00000'
    cp '$work/mnt/ckpt/step-00000200/rank-00004/model.safetensors' '$work/mnt/ckpt/step-00000300/rank-00000/' || cat '$work/mnt/status'"
  step rm -r "$work/mnt/ckpt/step-00000300"
  echo "== While the job trains on, an evaluation job exports step 200 as one Hugging Face model =="
  step "$scalai" export "$work/job" "$work/eval" --merged
  step ls -l "$work/eval"
  step "$scalai" umount "$work/mnt"
  step "$scalai" fsck "$work/job"

  echo
  echo "== A byte flipped on disk is never served, nor copied into a new shard: the read fails =="
  echo "== (EIO) and status names the blob, its step and the chunk; the other ranks read on =="
  step "$scalai" init "$work/job2" --layout megatron-core-gpt --param vocab_size=32000 \
    --param gated_linear_unit=1 --param num_attention_heads=8 --param num_query_groups=4
  step "$scalai" import "$work/job2" "$work/ckpt" --config tp=2,pp=2,dp=2 --step 100
  blob=$(ls "$work/job2/blobs" | head -n 1)
  step sh -c "printf '\\377' | dd of='$work/job2/blobs/$blob' bs=1 seek=5000000 conv=notrunc status=none"
  step "$scalai" mount "$work/job2" "$work/mnt"
  step sh -c "for r in '$work/mnt/ckpt/latest'/rank-*; do cat \$r/model.safetensors > /dev/null && echo \${r##*/} ok; done; cat '$work/mnt/status'"
  step "$scalai" reconfigure "$work/mnt" tp=4,pp=1,dp=1 --wait || true
  step "$scalai" umount "$work/mnt"
  step "$scalai" fsck "$work/job2" || true
fi

echo
echo "== Grow to 16 GPUs as tp=2,pp=2,dp=4: new ranks fetch, the store writes nothing =="
step "$scalai" plan --layout megatron-core-gpt --model "$model" \
  --from tp=2,pp=2,dp=2 --to tp=2,pp=2,dp=4

if [[ -e /dev/fuse ]]; then
  echo
  echo "== The whole mission: a PyTorch GPT (tensor, pipeline and data parallel; float64, gloo on =="
  echo "== CPU) reads its data and saves and loads its checkpoints only through a Scalai mount,  =="
  echo "== while its config changes three times; beside it, the same job trained uninterrupted  =="
  step /usr/bin/python3 tests/e2e/scenario.py "$scalai" --report --plot build/e2e-loss.png
  echo "the loss curves: build/e2e-loss.png"
fi
