#!/usr/bin/python3
"""Tied input and output embeddings (issue 25), as Megatron
(share_embeddings_and_output_weights) and Hugging Face (tie_word_embeddings)
save them: the model stores the input embedding once; a last pipeline stage
that does not hold it (pp > 1) holds it as output_layer.weight / lm_head.weight
too. For each preset, a tied model saved by `scalai synth` under pp=2
imports into a store made with `--param tied=1`; through the mount the last
stage's ranks show the output name with exactly the first stage's
embedding bytes (also under another tp), rank.json names the embedding as
its global tensor, a pp=1 config shows no output tensor, and `export
--merged` writes the framework's own tied file: the embedding and no output
tensor, equal to the unsharded model. The two copies must agree: an
import, or a save through the mount, whose last stage holds a different
output tensor is refused and commits nothing. Exits 77 only where
/dev/fuse is missing."""
import errno
import glob
import json
import shutil
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse  # noqa
from reference import read_safetensors, scalai, write_safetensors  # noqa

BIN = sys.argv[1]
VOCAB = 250
PRESETS = {
    # preset: (input name, output name, extra init params)
    "megatron-core-gpt": ("embedding.word_embeddings.weight", "output_layer.weight",
                          ["--param", "make_vocab_size_divisible_by=8"]),
    "hf-llama": ("model.embed_tokens.weight", "lm_head.weight", []),
}


def names(path):
    tensors, _ = read_safetensors(path)
    return tensors


def check_views(mnt, config, tp, pp, dp, inp, out):
    with open(f"{mnt}/config", "w") as f:
        f.write(config + "\n")
    step = f"{mnt}/ckpt/latest"
    for rank in range(tp * pp * dp):
        tp_rank, pp_rank = rank % tp, rank // (tp * dp)
        got = names(f"{step}/rank-{rank:05d}/model.safetensors")
        if pp > 1 and pp_rank == pp - 1:
            first = names(f"{step}/rank-{tp_rank:05d}/model.safetensors")
            assert out in got and inp not in got, (config, rank, sorted(got))
            assert np.array_equal(got[out], first[inp]), (config, rank)
            with open(f"{step}/rank-{rank:05d}/rank.json") as f:
                assert json.load(f)["tensors"][out]["global_name"] == inp
        else:
            assert out not in got, (config, rank, sorted(got))


def main():
    require_fuse()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        for preset, (inp, out, params) in PRESETS.items():
            d = f"{tmp}/{preset}"
            src, full, store, mnt, merged = (f"{d}/src", f"{d}/full", f"{d}/store",
                                             f"{d}/mnt", f"{d}/merged")
            os.makedirs(mnt)
            model = f"layers=4,hidden=64,heads=8,groups=4,ffn=128,vocab={VOCAB},tied=1"
            synth = ["--layout", preset, "--model", model, "--dtype", "f32", "--seed", "5"]
            scalai(BIN, "synth", src, "--config", "tp=2,pp=2,dp=1", *synth)
            scalai(BIN, "synth", full, "--full", *synth)
            want = names(f"{full}/model.safetensors")
            assert inp in want and out not in want, sorted(want)
            last = names(f"{src}/rank-00002/model.safetensors")
            assert out in last and inp not in last, sorted(last)
            scalai(BIN, "init", store, "--layout", preset, "--param", f"vocab_size={VOCAB}",
                   "--param", "tied=1", *params)
            # The two copies must agree: an import whose last stage differs
            # is refused, naming both files.
            bad = f"{d}/bad"
            shutil.copytree(src, bad)
            last, meta = read_safetensors(f"{bad}/rank-00002/model.safetensors")
            last[out] = last[out] + 1
            write_safetensors(f"{bad}/rank-00002/model.safetensors", last, meta)
            p = scalai(BIN, "import", store, bad, "--config", "tp=2,pp=2,dp=1", "--step", "100",
                       expect=1)
            assert "rank-00002" in p.stderr and "differs from" in p.stderr, p.stderr
            print(f"{preset}: a last stage whose {out} differs: {p.stderr.strip()}")
            scalai(BIN, "import", store, src, "--config", "tp=2,pp=2,dp=1", "--step", "100")
            scalai(BIN, "mount", store, mounts.add(mnt))
            # The same through the mount: the step does not commit.
            for rank in range(4):
                d200 = f"{mnt}/ckpt/step-00000200/rank-{rank:05d}"
                os.makedirs(d200)
                with open(f"{(bad if rank == 2 else src)}/rank-{rank:05d}/model.safetensors",
                          "rb") as f:
                    data = f.read()
                try:
                    with open(f"{d200}/model.safetensors", "wb") as f:
                        f.write(data)
                    assert rank < 3, "a step with differing tied copies committed"
                except OSError as e:
                    assert rank == 3 and e.errno == errno.EIO, (rank, e)
            with open(f"{mnt}/status") as f:
                assert "tied embeddings must be equal" in json.load(f)["error"]
            assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000100"
            shutil.rmtree(f"{mnt}/ckpt/step-00000200")
            for config, tp, pp, dp in (("tp=2,pp=2,dp=1", 2, 2, 1), ("tp=1,pp=2,dp=2", 1, 2, 2),
                                       ("tp=4,pp=4,dp=1", 4, 4, 1), ("tp=2,pp=1,dp=1", 2, 1, 1)):
                check_views(mnt, config, tp, pp, dp, inp, out)
            print(f"{preset}: the last stage holds {out} = the first stage's {inp} "
                  "under pp=2 and pp=4, none under pp=1")
            scalai(BIN, "umount", mnt)
            mounts.discard(mnt)
            scalai(BIN, "export", store, merged, "--merged")
            got = {}
            for path in glob.glob(f"{merged}/*.safetensors"):
                got.update(names(path))
            assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
            for name, x in want.items():
                assert np.array_equal(got[name], x), name
            print(f"{preset}: export --merged is the tied model: {inp} and no {out}")
    print("tied_test: ok")


if __name__ == "__main__":
    main()
