#!/usr/bin/python3
"""The store through the CLI: checkpoints written by this script's own numpy
writer (per-rank shards, one full file, a Hugging Face sharded directory) and
by `scalai synth` are imported, exported under other configs and merged, and
compared tensor by tensor with numpy slicing of the full tensors. Malformed
input is refused with a clear error and leaves the store unchanged; a flipped
byte in a blob is caught by fsck."""
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import (read_safetensors, write_safetensors, rank_shards, random_gpt,  # noqa: E402
                       scalai)

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 5, 48, 12, 6, 96, 101
DIVISOR = 8
PARAMS = ["--param", f"vocab_size={VOCAB}", "--param", "gated_linear_unit=1",
          "--param", f"make_vocab_size_divisible_by={DIVISOR}"]


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def write_ranks(directory, full, config):
    for rank, shard in rank_shards(full, config, True, DIVISOR, LAYERS).items():
        os.makedirs(f"{directory}/rank-{rank:05d}")
        write_safetensors(f"{directory}/rank-{rank:05d}/model.safetensors", shard,
                          {"scalai.step": "7"})


def check_export(store, full, config, out, step=None):
    args = ["export", store, out, "--config", config] + (["--step", str(step)] if step else [])
    run(*args)
    expected = rank_shards(full, config, True, DIVISOR, LAYERS)
    assert sorted(os.listdir(out)) == [f"rank-{r:05d}" for r in sorted(expected)], os.listdir(out)
    for rank, want in expected.items():
        got, meta = read_safetensors(f"{out}/rank-{rank:05d}/model.safetensors")
        assert meta["scalai.rank"] == str(rank) and meta["scalai.config"] == config, meta
        assert sorted(got) == sorted(want), (config, rank, sorted(got), sorted(want))
        for name in want:
            assert got[name].shape == want[name].shape, (config, rank, name)
            assert np.array_equal(got[name], want[name]), (config, rank, name)


def check_merged(store, full, out, step):
    run("export", store, out, "--merged", "--step", str(step), "--max-file-bytes", "20000")
    index = json.load(open(f"{out}/model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(full)
    files = set(index["weight_map"].values())
    assert len(files) > 1, files
    got = {}
    for f in files:
        tensors, _ = read_safetensors(f"{out}/{f}")
        for name in tensors:
            assert index["weight_map"][name] == f
        got.update(tensors)
    for name, x in full.items():
        assert np.array_equal(got[name], x), name


def snapshot(store):
    """What must not change when an import is refused."""
    return run("inspect", store, "--json").stdout, sorted(os.listdir(f"{store}/blobs"))


def expect_refused(store, src, config, message):
    before = snapshot(store)
    p = run("import", store, src, "--config", config, "--step", "999", expect=1)
    assert p.stderr.count("\n") == 1, p.stderr
    assert message in p.stderr, f"expected {message!r} in {p.stderr!r}"
    assert snapshot(store) == before, "a refused import changed the store"


def corrupt_cases(tmp, full, store):
    """Each malformed per-rank checkpoint, with the words its error must carry."""
    good = f"{tmp}/good"
    write_ranks(good, full, "tp=2,pp=1,dp=1")
    cases = []

    def case(name, message, mutate, config="tp=2,pp=1,dp=1"):
        d = f"{tmp}/bad-{name}"
        shutil.copytree(good, d)
        mutate(d)
        cases.append((d, config, message))

    def patch_header(d, fn, rank=1):
        path = f"{d}/rank-{rank:05d}/model.safetensors"
        raw = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        text = fn(raw[8:8 + n].decode()).encode()
        open(path, "wb").write(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    def replace_first(old, new):
        return lambda h: h.replace(old, new, 1)

    case("json", "not valid JSON", lambda d: patch_header(d, lambda h: h.rstrip()[:-2]))
    case("dtype", 'unknown dtype "F33"', lambda d: patch_header(d, replace_first('"F32"', '"F33"')))
    case("length", "runs past the end of the file",
         lambda d: open(f"{d}/rank-00001/model.safetensors", "r+b").write((1 << 20).to_bytes(8, "little")))
    case("truncated", "past the data section",
         lambda d: os.truncate(f"{d}/rank-00001/model.safetensors",
                               os.path.getsize(f"{d}/rank-00001/model.safetensors") - 4))

    def overlap(h):
        j = json.loads(h)
        names = [k for k in j if k != "__metadata__"]
        j[names[1]]["data_offsets"][0] -= 4
        j[names[1]]["data_offsets"][1] -= 4
        return json.dumps(j)
    case("overlap", "overlap tensor", lambda d: patch_header(d, overlap))

    def duplicate(h):
        return h.rstrip()[:-1] + ', "decoder.final_layernorm.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'
    case("duplicate", "appears twice", lambda d: patch_header(d, duplicate))

    def bad_shape(h):
        j = json.loads(h)
        e = j["decoder.layers.0.mlp.linear_fc2.weight"]
        e["shape"] = [e["shape"][0] // 2, e["shape"][1] * 2]
        return json.dumps(j)
    case("shape", "tensor decoder.layers.0.mlp.linear_fc2.weight: expected [48, 48]",
         lambda d: patch_header(d, bad_shape))
    case("missing-rank", "rank-00001/model.safetensors is missing",
         lambda d: shutil.rmtree(f"{d}/rank-00001"))
    case("extra-rank", "rank-00002: an extra rank", lambda d: shutil.copytree(
        f"{d}/rank-00001", f"{d}/rank-00002"))

    def dtype_mismatch(d):
        t, meta = read_safetensors(f"{d}/rank-00001/model.safetensors")
        t = {k: (v.astype(np.float16) if k.endswith("fc2.weight") else v) for k, v in t.items()}
        write_safetensors(f"{d}/rank-00001/model.safetensors", t, meta)
    case("dtype-mismatch", "is F16, expected F32", dtype_mismatch)

    def absent_on_peer(d):
        t, meta = read_safetensors(f"{d}/rank-00001/model.safetensors")
        del t["decoder.layers.2.mlp.linear_fc2.weight"]
        write_safetensors(f"{d}/rank-00001/model.safetensors", t, meta)
    case("absent", "tensor decoder.layers.2.mlp.linear_fc2.weight is missing", absent_on_peer)

    def replica_differs(d):
        shutil.copytree(f"{d}/rank-00000", f"{d}/rank-00002")
        t, meta = read_safetensors(f"{d}/rank-00002/model.safetensors")
        t["decoder.final_layernorm.weight"] = t["decoder.final_layernorm.weight"] + 1
        write_safetensors(f"{d}/rank-00002/model.safetensors", t, meta)
    case("replica", "differs from its replica", replica_differs, config="tp=2,pp=1,dp=2")
    return cases


def main():
    rng = np.random.default_rng(3)
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    # Usage errors exit 2 and say what is wrong.
    p = run("initt", "/tmp/nowhere", expect=2)
    assert 'unknown command "initt"' in p.stderr and "init, import" in p.stderr, p.stderr
    p = run("init", expect=2)
    assert "STORE is required" in p.stderr, p.stderr
    with tempfile.TemporaryDirectory() as tmp:
        # Per-rank shards from the independent writer, uneven stages.
        src = f"{tmp}/ranks"
        write_ranks(src, full, "tp=3,pp=2,dp=2,stages=2:3")
        store = f"{tmp}/store"
        run("init", store, "--layout", "megatron-core-gpt", *PARAMS)
        assert (os.stat(store).st_mode & 0o777) == 0o700
        out = run("import", store, src, "--config", "tp=3,pp=2,dp=2,stages=2:3").stdout
        assert "imported step 7" in out, out  # the step from scalai.step metadata
        for i, config in enumerate(["tp=1,pp=1,dp=1", "tp=2,pp=3,dp=1", "tp=6,pp=1,dp=2",
                                    "tp=3,pp=2,dp=1,stages=2:3", "tp=1,pp=5,dp=1"]):
            check_export(store, full, config, f"{tmp}/export-{i}")
        check_merged(store, full, f"{tmp}/merged", 7)

        # A full model in one file, then as a Hugging Face sharded directory.
        write_safetensors(f"{tmp}/full.safetensors", full)
        run("import", store, f"{tmp}/full.safetensors", "--config", "tp=1,pp=1,dp=1",
            "--step", "8")
        check_export(store, full, "tp=2,pp=2,dp=1", f"{tmp}/from-full", step=8)
        hf = f"{tmp}/hf"
        os.makedirs(hf)
        names = list(full)
        parts = [names[:10], names[10:20], names[20:]]
        weight_map = {}
        for i, part in enumerate(parts):
            fname = f"model-{i + 1:05d}-of-00003.safetensors"
            write_safetensors(f"{hf}/{fname}", {n: full[n] for n in part})
            weight_map.update({n: fname for n in part})
        json.dump({"metadata": {}, "weight_map": weight_map},
                  open(f"{hf}/model.safetensors.index.json", "w"))
        run("import", store, hf, "--config", "tp=1,pp=1,dp=1", "--step", "9")
        check_export(store, full, "tp=3,pp=1,dp=1", f"{tmp}/from-hf", step=9)
        run("fsck", store)

        inspect = json.loads(run("inspect", store, "--json").stdout)
        assert [s["step"] for s in inspect["steps"]] == [7, 8, 9], inspect
        assert inspect["config"] == "tp=3,pp=2,dp=2,stages=2:3", inspect
        assert inspect["model"]["tensors"] == len(full)
        p = run("import", store, src, "--config", "tp=3,pp=2,dp=2,stages=2:3", expect=1)
        assert "step 7 already exists" in p.stderr, p.stderr
        plan = json.loads(run("plan", store, "--to", "tp=3,pp=2,dp=4,stages=2:3", "--json").stdout)
        assert plan["from"] == "tp=3,pp=2,dp=2,stages=2:3" and plan["bytes_to_write"] == 0, plan

        # Malformed input: a clear error, an unchanged store.
        for d, config, message in corrupt_cases(tmp, full, store):
            expect_refused(store, d, config, message)
        os.remove(f"{hf}/model-00002-of-00003.safetensors")
        expect_refused(store, hf, "tp=1,pp=1,dp=1", "names model-00002-of-00003.safetensors, which is missing")
        run("fsck", store)

        # A flipped byte in a blob.
        blobs = sorted(os.listdir(f"{store}/blobs"))
        victim = f"{store}/blobs/{blobs[0]}"
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) - 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        p = run("fsck", store, expect=1)
        assert blobs[0] in p.stderr and "checksum" in p.stderr, p.stderr
        with open(victim, "r+b") as f:  # back as it was
            f.seek(os.path.getsize(victim) - 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        run("fsck", store)

        # Shards written by scalai synth, against slicing of its --full model.
        synth_model = (f"layers={LAYERS},hidden={HIDDEN},heads={HEADS},groups={GROUPS},"
                       f"ffn={FFN},vocab={VOCAB},gated_linear_unit=1,"
                       f"make_vocab_size_divisible_by={DIVISOR}")
        for what in (["--config", "tp=2,pp=2,dp=1"], ["--full"]):
            run("synth", f"{tmp}/synth{what[0]}", "--layout", "megatron-core-gpt", "--model",
                synth_model, "--dtype", "f32", "--seed", "9", *what)
        synth_full, _ = read_safetensors(f"{tmp}/synth--full/model.safetensors")
        synth_store = f"{tmp}/synth-store"
        run("init", synth_store, "--layout", "megatron-core-gpt", *PARAMS)
        run("import", synth_store, f"{tmp}/synth--config", "--config", "tp=2,pp=2,dp=1")
        check_export(synth_store, synth_full, "tp=3,pp=1,dp=1", f"{tmp}/synth-export")

        # A fresh store infers the model from shards, and says what does not fit.
        fresh = f"{tmp}/fresh"
        run("init", fresh, "--layout", "megatron-core-gpt", *PARAMS)
        p = run("import", fresh, src, "--config", "tp=3,pp=2,dp=2", expect=1)
        assert "stages hold 2:3 layers but tp=3,pp=2,dp=2 splits 5 layers as 3:2" in p.stderr, p.stderr
        no_vocab = f"{tmp}/no-vocab"
        run("init", no_vocab, "--layout", "megatron-core-gpt", "--param", "gated_linear_unit=1")
        p = run("import", no_vocab, src, "--config", "tp=3,pp=2,dp=2,stages=2:3", expect=1)
        assert "vocab_size must be set" in p.stderr, p.stderr
        assert json.loads(run("inspect", fresh, "--json").stdout)["steps"] == []

        # A second writer is kept out while one holds the store; readers
        # (inspect, export) read beside it.
        lock_holder = __import__("subprocess").Popen(
            ["/usr/bin/python3", "-c",
             f"import fcntl,time;f=open('{store}/LOCK','w');fcntl.flock(f,fcntl.LOCK_EX);"
             "print('locked',flush=True);time.sleep(30)"], stdout=-1)
        lock_holder.stdout.readline()
        p = run("import", store, src, "--config", "tp=3,pp=2,dp=2,stages=2:3", "--step", "10",
                expect=1)
        assert "in use by another scalai process" in p.stderr, p.stderr
        check_export(store, full, "tp=1,pp=1,dp=1", f"{tmp}/held-out")
        assert json.loads(run("inspect", store, "--json").stdout)["steps"], "inspect beside a holder"
        lock_holder.kill()
        # init refuses a non-empty directory.
        p = run("init", store, "--layout", "megatron-core-gpt", expect=1)
        assert "not empty" in p.stderr, p.stderr
    print("store CLI test: ok")


if __name__ == "__main__":
    main()
