#!/usr/bin/python3
"""rank.json says exactly where each rank's bytes lie (issue 25). For both
presets, a GPT with GQA and a vocabulary padded for tp (Megatron's with
SwiGLU, its fc1 cut in two blocks; Llama's with tied embeddings, its last
stage's lm_head.weight being the embedding), imported whole, is mounted and switched through
at least 100 random configs each (tp 1/2/4, pp 1-4 with uneven stages, dp
1-3). Under each, every rank's rank.json and tensors/NAME bytes are used to
rebuild every global tensor: each piece's bytes must equal the full tensor
at the piece's global offset, padding pieces must be zeros lying past the
true rows, and together the ranks must cover every element. Exits 77 only
where /dev/fuse is missing."""
import json
import os
import random
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, test_seed  # noqa
from reference import read_safetensors, scalai  # noqa

BIN = sys.argv[1]
CONFIGS = 100
LAYERS, HEADS, GROUPS, VOCAB = 4, 8, 4, 250
PRESETS = {
    "megatron-core-gpt": ["--param", "gated_linear_unit=1", "--param", "make_vocab_size_divisible_by=8"],
    # Tied embeddings: the last stage's lm_head.weight is model.embed_tokens.
    "hf-llama": ["--param", "tied=1"],
}


def random_config(rng):
    tp, pp, dp = rng.choice([1, 2, 4]), rng.randint(1, LAYERS), rng.randint(1, 3)
    config = f"tp={tp},pp={pp},dp={dp}"
    if pp > 1 and rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, LAYERS), pp - 1))
        stages = [b - a for a, b in zip([0] + cuts, cuts + [LAYERS])]
        config += ",stages=" + ":".join(map(str, stages))
    return config


def dtype_of(name):
    return {"F32": np.float32, "F16": np.float16, "F64": np.float64}[name]


def check_config(mnt, full, config):
    step = f"{mnt}/ckpt/latest"
    covered = {name: np.zeros(x.shape, dtype=bool) for name, x in full.items()}
    padded = 0
    for rank in sorted(os.listdir(step)):
        with open(f"{step}/{rank}/rank.json") as f:
            info = json.load(f)
        assert info["config"] == config, (info["config"], config)
        for local, t in info["tensors"].items():
            with open(f"{step}/{rank}/tensors/{local}", "rb") as f:
                x = np.frombuffer(f.read(), dtype=dtype_of(t["dtype"])).reshape(t["shape"])
            want = full[t["global_name"]]
            assert list(want.shape) == t["global_shape"], (rank, local)
            assert t["global_offset"] == t["pieces"][0]["global_offset"], (rank, local)
            for p in t["pieces"]:
                lo = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["shape"]))
                piece = x[lo]
                if p.get("padding"):
                    # Padding rows: zeros, past the true rows.
                    assert not piece.any(), (config, rank, local, p)
                    assert p["global_offset"][0] >= want.shape[0], (config, rank, local, p)
                    padded += 1
                    continue
                go = tuple(slice(o, o + n) for o, n in zip(p["global_offset"], p["shape"]))
                assert want[go].shape == piece.shape, (config, rank, local, p)
                assert np.array_equal(want[go], piece), (config, rank, local, p)
                covered[t["global_name"]][go] = True
    for name, c in covered.items():
        assert c.all(), (config, name, "not every element is held by some rank")
    return padded


def main():
    require_fuse()
    rng = random.Random(test_seed())
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        for preset, params in PRESETS.items():
            src, store, mnt = f"{tmp}/{preset}/src", f"{tmp}/{preset}/store", f"{tmp}/{preset}/mnt"
            os.makedirs(mnt)
            model = f"layers={LAYERS},hidden=64,heads={HEADS},groups={GROUPS},ffn=128,vocab={VOCAB}"
            if preset == "megatron-core-gpt":
                model += ",gated_linear_unit=1"
            else:
                model += ",tied=1"
            scalai(BIN, "synth", src, "--full", "--layout", preset, "--model", model,
                   "--dtype", "f32", "--seed", "7")
            scalai(BIN, "init", store, "--layout", preset, "--param", f"vocab_size={VOCAB}",
                   "--param", f"num_attention_heads={HEADS}", "--param",
                   f"num_query_groups={GROUPS}", *params)
            scalai(BIN, "import", store, f"{src}/model.safetensors", "--config", "tp=1,pp=1,dp=1")
            full, _ = read_safetensors(f"{src}/model.safetensors")
            scalai(BIN, "mount", store, mounts.add(mnt))
            padded = 0
            for _ in range(CONFIGS):
                config = random_config(rng)
                with open(f"{mnt}/config", "w") as f:
                    f.write(config + "\n")
                padded += check_config(mnt, full, config)
            assert padded > 0, "no config padded the vocabulary"
            print(f"{preset}: {CONFIGS} random configs, every global tensor rebuilt from "
                  f"rank.json; {padded} padding pieces checked")
            scalai(BIN, "umount", mnt)
            mounts.discard(mnt)
    print("rank_json_test: ok")


if __name__ == "__main__":
    main()
