#!/usr/bin/python3
"""Megatron-LM's own checkpoints in (issue 21): checkpoints written with the
real torch.save in Megatron's structure (iter_NNNNNNN/mp_rank_TT[_PPP]/
model_optim_rng.pt, latest_checkpointed_iteration.txt; a SwiGLU, GQA model;
args, iteration, checkpoint_version, Adam state with fp32 master copies in
Megatron's param groups in either order Megatron has used, RNG state) for tp/pp of 1, 2 and 4 import into a
store, and so does one saved without optimizer state. Through the mount, under the saved config and under others, every
rank's tensors, its optimizer state included, equal the numpy reference's
direct cut; the rest of each file is an extra file that torch.load reads
back equal to the original. `export --format megatron` under another tp and
pp writes files torch.load reads, in Megatron's nesting, with the direct
cut's tensors, the Adam state in Megatron's param groups and the original's
non-tensor state; imported again, they give the same bytes; it refuses
non-tensor state damaged on the disk. Bad input is refused with one line naming it
and leaves the store without a step: a pickle that calls os.system or an
unlisted global (and nothing ran), a truncated zip, a storage shorter than
its tensor, a missing rank file, ranks that disagree on a shape, args that
disagree with the config. Exits 77 only where /dev/fuse is missing."""
import argparse
import collections
import io
import json
import os
import random
import shutil
import sys
import tempfile
import zipfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, flip, require_fuse, test_seed  # noqa
from reference import random_gpt, rank_shards, scalai  # noqa
from views import check_bytes  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 64, 8, 2, 96, 203, 8
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]
ITERATION = 1200
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "fp32_param")


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def with_optimizer_state(full):
    """The model and its optimizer state, each state tensor a function of its
    parameter, as the shards name them."""
    out = dict(full)
    for name, x in full.items():
        out[f"optimizer.exp_avg.{name}"] = x * 2
        out[f"optimizer.exp_avg_sq.{name}"] = x * x
        out[f"optimizer.fp32_param.{name}"] = x + 0.5
    return out


def megatron_groups(model, decayed_first=False):
    """Megatron's param groups as [(decays, names)]: weight-decayed (neither
    bias nor 1-D) and the rest, in the order their first parameter appears
    (Megatron-Core), or the decayed group first (older Megatron)."""
    keys, groups = [], {}
    for name, x in model.items():
        decays = not (name.endswith(".bias") or x.ndim == 1)
        if decays not in groups:
            keys.append(decays)
            groups[decays] = []
        groups[decays].append(name)
    if decayed_first:
        keys.sort(reverse=True)
    return [(k, groups[k]) for k in keys]


def rank_file(shard, tp, pp, seed, decayed_first):
    """One rank's model_optim_rng.pt contents, as Megatron saves them."""
    model = collections.OrderedDict(
        (k, torch.from_numpy(np.array(v))) for k, v in shard.items()
        if not k.startswith("optimizer."))
    groups = megatron_groups(model, decayed_first)
    with_optimizer = any(k.startswith("optimizer.") for k in shard)
    state, param_groups, masters, number = {}, [], [], 0
    for decays, names in (groups if with_optimizer else []):
        params = []
        for name in names:
            state[number] = {
                "step": torch.tensor(float(ITERATION)),
                "exp_avg": torch.from_numpy(np.array(shard[f"optimizer.exp_avg.{name}"])),
                "exp_avg_sq": torch.from_numpy(np.array(shard[f"optimizer.exp_avg_sq.{name}"])),
            }
            params.append(number)
            number += 1
        param_groups.append({"lr": 3e-4, "weight_decay": 0.1 if decays else 0.0,
                             "betas": (0.9, 0.95), "eps": 1e-8, "params": params})
        masters.append([torch.from_numpy(np.array(shard[f"optimizer.fp32_param.{n}"]))
                        for n in names])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    saved = {
        "args": argparse.Namespace(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
            num_query_groups=GROUPS, ffn_hidden_size=FFN, swiglu=True,
            group_query_attention=True, params_dtype=torch.float32,
            padded_vocab_size=VOCAB, seq_length=128, lr=3e-4, iteration=ITERATION),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model,
        "optimizer": {
            "optimizer": {"state": state, "param_groups": param_groups},
            "fp32_from_fp16_params": masters,
            "grad_scaler": {"scale": torch.tensor(65536.0), "growth_tracker": 7},
        },
        "opt_param_scheduler": {"num_steps": ITERATION * 32, "max_lr": 3e-4},
        "rng_state": [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.get_rng_state()[:16],
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()[:8]},
        }],
        "num_floating_point_operations_so_far": 123456789,
    }
    if not with_optimizer:  # saved with --no-save-optim
        del saved["optimizer"], saved["opt_param_scheduler"]
    return saved


def rank_dir(t, p, pp):
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def write_checkpoint(root, full, tp, pp, seed, decayed_first=False, protocol=2):
    """Megatron's directory for tp, pp, pickled with `protocol` (torch.save's
    default is 2); returns {rank dir: saved dict}."""
    shards = rank_shards(full, f"tp={tp},pp={pp},dp=1", True, DIVISOR, LAYERS)
    saved = {}
    for p in range(pp):
        for t in range(tp):
            d = f"{root}/iter_{ITERATION:07d}/{rank_dir(t, p, pp)}"
            os.makedirs(d)
            saved[rank_dir(t, p, pp)] = rank_file(shards[p * tp + t], tp, pp, seed + p * tp + t,
                                              decayed_first)
            torch.save(saved[rank_dir(t, p, pp)], f"{d}/model_optim_rng.pt",
                       pickle_protocol=protocol)
    with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
        f.write(f"{ITERATION}\n")
    return saved


def same(a, b, where):
    """Non-tensor state equal, tensors equal, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and np.array_equal(a, b) and a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        same(vars(a), vars(b), where)
    else:
        assert a == b and type(a) is type(b), (where, a, b)


def check_remainder(mnt, saved, tp, pp):
    """Each saving rank's extra file: the original without the tensors that
    became shards."""
    for p in range(pp):
        for t in range(tp):
            rank = p * tp + t
            path = f"{mnt}/ckpt/latest/rank-{rank:05d}/extra/megatron/model_optim_rng.pt"
            got = torch.load(path)
            want = saved[rank_dir(t, p, pp)]
            for key in ("args", "checkpoint_version", "iteration", "rng_state",
                        "opt_param_scheduler", "num_floating_point_operations_so_far"):
                same(want[key], got[key], f"rank {rank} {key}")
            assert got["model"] == collections.OrderedDict(), got["model"]
            opt, want_opt = got["optimizer"], want["optimizer"]
            same(want_opt["grad_scaler"], opt["grad_scaler"], "grad_scaler")
            same(want_opt["optimizer"]["param_groups"], opt["optimizer"]["param_groups"],
                 "param_groups")
            for number, s in opt["optimizer"]["state"].items():
                assert list(s) == ["step"], (rank, number, list(s))
                same(want_opt["optimizer"]["state"][number]["step"], s["step"], "step")
            assert all(m is None for g in opt["fp32_from_fp16_params"] for m in g)


def round_trip(tmp, store, everything, saved, tp, pp):
    """`export --format megatron` under tp, pp: files torch.load reads, in
    Megatron's nesting, with the direct cut's tensors, each parameter's Adam
    state in its param group, the original's non-tensor state (args but for
    the new sizes); imported again, the same bytes."""
    out = f"{store}-export-{tp}-{pp}"
    config = f"tp={tp},pp={pp},dp=1"
    run("export", store, out, "--config", config, "--format", "megatron")
    assert open(f"{out}/latest_checkpointed_iteration.txt").read() == f"{ITERATION}\n"
    want = rank_shards(everything, config, True, DIVISOR, LAYERS)
    original = next(iter(saved.values()))
    for p in range(pp):
        for t in range(tp):
            got = torch.load(f"{out}/iter_{ITERATION:07d}/{rank_dir(t, p, pp)}/model_optim_rng.pt")
            where = f"{config} rank {rank_dir(t, p, pp)}"
            assert list(got) == list(original), (where, list(got))
            args = dict(vars(original["args"]), tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp)
            same(argparse.Namespace(**args), got["args"], f"{where} args")
            assert got["iteration"] == ITERATION and got["checkpoint_version"] == 3.0
            assert any(_equal(got["rng_state"], s["rng_state"]) for s in saved.values()), where
            shard = want[p * tp + t]
            model = got["model"]
            assert isinstance(model, collections.OrderedDict)
            assert sorted(model) == sorted(k for k in shard if not k.startswith("optimizer.")), where
            for name, x in model.items():
                assert np.array_equal(x.numpy(), shard[name]), (where, name)
            opt = got["optimizer"]
            decayed_first = original["optimizer"]["optimizer"]["param_groups"][0][
                "weight_decay"] != 0
            groups = megatron_groups(model, decayed_first)
            assert len(opt["optimizer"]["param_groups"]) == len(groups), where
            for g, (decays, names) in enumerate(groups):
                group = opt["optimizer"]["param_groups"][g]
                old = next(o for o in original["optimizer"]["optimizer"]["param_groups"]
                           if (o["weight_decay"] != 0) == decays)
                assert {k: v for k, v in group.items() if k != "params"} == \
                    {k: v for k, v in old.items() if k != "params"}, (where, group)
                for j, (name, number) in enumerate(zip(names, group["params"])):
                    state = opt["optimizer"]["state"][number]
                    assert list(state) == ["step", "exp_avg", "exp_avg_sq"], list(state)
                    assert torch.equal(state["step"], torch.tensor(float(ITERATION)))
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert np.array_equal(state[key].numpy(),
                                              shard[f"optimizer.{key}.{name}"]), (where, name)
                    assert np.array_equal(opt["fp32_from_fp16_params"][g][j].numpy(),
                                          shard[f"optimizer.fp32_param.{name}"]), (where, name)
            same(original["optimizer"]["grad_scaler"], opt["grad_scaler"], where)
    again = f"{out}-store"
    run("init", again, *LAYOUT)
    run("import", again, out, "--config", config)
    mnt = f"{out}-mnt"
    os.makedirs(mnt)
    run("mount", again, mnt)
    try:
        check_bytes(mnt, everything, config, LAYERS, DIVISOR)
    finally:
        run("umount", mnt)


def _equal(a, b):
    try:
        same(a, b, "")
        return True
    except AssertionError:
        return False


def import_fails(store, src, config, why):
    p = run("import", store, src, "--config", config, expect=1)
    line = p.stderr.strip()
    assert why in line and "\n" not in line, (why, line)
    print("  ", line)
    steps = json.loads(run("inspect", store, "--json").stdout)["steps"]
    assert steps == [], steps
    return line


def rewrite_zip(path, change):
    """The zip at `path` with each record passed through change(name, bytes)."""
    with zipfile.ZipFile(path) as z:
        records = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(name, change(name, data))


def bad_inputs(tmp, full, seed):
    store = f"{tmp}/bad-store"
    run("init", store, *LAYOUT)
    good, plain = f"{tmp}/bad-good", f"{tmp}/bad-plain"
    write_checkpoint(good, with_optimizer_state(full), 2, 1, seed)
    write_checkpoint(plain, full, 2, 1, seed)  # without optimizer state
    rank1 = f"iter_{ITERATION:07d}/mp_rank_01/model_optim_rng.pt"

    def variant(name, change_rank1=None, remove=None, base=good):
        path = f"{tmp}/bad-{name}"
        shutil.copytree(base, path)
        if change_rank1:
            change_rank1(f"{path}/{rank1}")
        if remove:
            os.remove(f"{path}/{remove}")
        return path

    marker = f"{tmp}/ran"

    def evil(global_line):
        def change(path):
            # A pickle whose unpickling calls the global with a shell command.
            command = f"touch {marker}".encode()
            pickle = (b"\x80\x02c" + global_line + b"\nX" + len(command).to_bytes(4, "little")
                      + command + b"\x85R.")
            rewrite_zip(path, lambda n, d: pickle if n.endswith("/data.pkl") else d)
        return change

    line = import_fails(store, variant("system", evil(b"posix\nsystem")), "tp=2,pp=1,dp=1",
                        "global posix.system")
    assert rank1 in line, line
    import_fails(store, variant("os", evil(b"os\nsystem")), "tp=2,pp=1,dp=1", "global os.system")
    import_fails(store, variant("enum", evil(b"megatron.core.enums\nModelType")),
                 "tp=2,pp=1,dp=1", "global megatron.core.enums.ModelType")
    assert not os.path.exists(marker), "a refused pickle ran"

    def truncate(path):
        size = os.path.getsize(path)
        os.truncate(path, size // 2)
    import_fails(store, variant("truncated", truncate), "tp=2,pp=1,dp=1", rank1)

    def short_storage(path):
        rewrite_zip(path, lambda n, d: d[:-4] if n.endswith("/data/0") else d)
    import_fails(store, variant("short", short_storage), "tp=2,pp=1,dp=1",
                 "storage 0 holds")

    import_fails(store, variant("missing", remove=rank1), "tp=2,pp=1,dp=1",
                 "mp_rank_01/model_optim_rng.pt is missing")

    def other_shape(path):
        saved = torch.load(path)
        name = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
        saved["model"][name] = torch.zeros(HIDDEN + 2)
        torch.save(saved, path)
    import_fails(store, variant("shape", other_shape, base=plain), "tp=2,pp=1,dp=1",
                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")

    import_fails(store, good, "tp=4,pp=1,dp=1",
                 "args.tensor_model_parallel_size is 2; the config tp=4,pp=1,dp=1 says 4")
    print("refused: os.system and posix.system (nothing ran), an unlisted global, a "
          "truncated zip, a short storage, a missing rank, a differing shape, args "
          "against the config; the store kept no step")


def remainder_damage_refused(tmp, store):
    """A rank's non-tensor state (a blob that is not safetensors) damaged on
    the disk: `export --format megatron` refuses it, naming the blob, and
    writes nothing."""
    def is_safetensors(path):
        with open(path, "rb") as f:
            return f.read(9)[8:] == b"{"
    blobs = [n for n in os.listdir(f"{store}/blobs")
             if not is_safetensors(f"{store}/blobs/{n}")]
    assert blobs, os.listdir(f"{store}/blobs")
    out = f"{tmp}/export-damaged"
    for name in blobs:
        path = f"{store}/blobs/{name}"
        flip(path, os.path.getsize(path) // 2)
        err = run("export", store, out, "--config", "tp=1,pp=1,dp=1", "--format", "megatron",
                  expect=1).stderr
        assert name in err, (name, err)
        assert not os.path.exists(out), name
        flip(path, os.path.getsize(path) // 2)  # back as it was
    print(f"the non-tensor state damaged on the disk ({len(blobs)} blob(s), each in turn): "
          "export --format megatron refuses it")


def main():
    require_fuse()
    seed = test_seed()
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    everything = with_optimizer_state(full)
    others = {(1, 1): "tp=2,pp=2,dp=1", (2, 1): "tp=1,pp=2,dp=2", (4, 1): "tp=2,pp=1,dp=2",
              (1, 2): "tp=4,pp=1,dp=1", (2, 2): "tp=1,pp=1,dp=3", (1, 4): "tp=2,pp=2,dp=1"}
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        for (tp, pp), other in others.items():
            src, store, mnt = f"{tmp}/ckpt-{tp}-{pp}", f"{tmp}/store-{tp}-{pp}", f"{tmp}/mnt-{tp}-{pp}"
            # pp=4's later stages start with a 1-D parameter: there the two
            # orders of param groups differ; it saves them as older Megatron.
            # Pickle protocols 2 to 5, one case each.
            protocol = {(2, 1): 3, (4, 1): 4, (1, 2): 5}.get((tp, pp), 2)
            saved = write_checkpoint(src, everything, tp, pp, seed, decayed_first=pp == 4,
                                     protocol=protocol)
            config = f"tp={tp},pp={pp},dp=1"
            run("init", store, *LAYOUT)
            out = run("import", store, src, "--config", config).stdout
            assert f"step {ITERATION}" in out, out
            os.makedirs(mnt)
            run("mount", store, mnt)
            mounts.add(mnt)
            check_bytes(mnt, everything, config, LAYERS, DIVISOR)
            check_remainder(mnt, saved, tp, pp)
            run("reconfigure", mnt, other, "--wait")
            check_bytes(mnt, everything, other, LAYERS, DIVISOR)
            run("umount", mnt)
            mounts.discard(mnt)
            to_tp, to_pp = (int(other.split(",")[i].split("=")[1]) for i in (0, 1))
            round_trip(tmp, store, everything, saved, to_tp, to_pp)
            if (tp, pp) == (1, 1):
                remainder_damage_refused(tmp, store)
            print(f"{config} (pickle protocol {protocol}): imported as step {ITERATION}, every tensor and its Adam state "
                  f"equal the direct cut, under {other} too; the rest loads back equal; "
                  f"exported as Megatron's tp={to_tp},pp={to_pp}, torch.load reads it, "
                  "imported again, equal")
        # Saved without optimizer state (--no-save-optim): the model alone.
        src, store = f"{tmp}/ckpt-plain", f"{tmp}/store-plain"
        write_checkpoint(src, full, 2, 2, seed)
        run("init", store, *LAYOUT)
        run("import", store, src + f"/iter_{ITERATION:07d}", "--config", "tp=2,pp=2,dp=1")
        mnt = f"{tmp}/mnt-plain"
        os.makedirs(mnt)
        run("mount", store, mnt, "--config", "tp=4,pp=1,dp=2")
        mounts.add(mnt)
        check_bytes(mnt, full, "tp=4,pp=1,dp=2", LAYERS, DIVISOR)
        print("without optimizer state, named by its iter_* directory: the model alone")
        bad_inputs(tmp, full, seed)


if __name__ == "__main__":
    main()
