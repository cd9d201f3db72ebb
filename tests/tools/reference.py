"""An independent reference for tests: a safetensors reader and writer of its
own, docs/reference.md's megatron-core-gpt partitioning written with numpy, and a
random full model. Nothing here calls scalai."""
import json
import math
import re
import struct
import subprocess

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "U8": np.uint8, "I32": np.int32, "I64": np.int64}
NAMES = {np.dtype(v).str: k for k, v in DTYPES.items()}


def read_safetensors(path):
    """Returns ({name: array}, metadata), checking for holes and trailing bytes."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    out, end = {}, 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, en = e["data_offsets"]
        assert b == end, f"{path}: {name} leaves a hole"
        end = en
        out[name] = np.frombuffer(data[b:en], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
    assert end == len(data), f"{path}: trailing bytes"
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(safetensors_bytes(tensors, metadata))


def safetensors_bytes(tensors, metadata=None):
    """A safetensors file's bytes: the header, then the tensors in order."""
    header, offset, chunks = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": NAMES[arr.dtype.str], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        chunks.append(arr.tobytes())
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def rule(name, gated):
    """The megatron-core-gpt rules of docs/reference.md: (split, blocks, vocab, stage)."""
    if name.endswith("word_embeddings.weight"):
        return 0, 1, True, "first"
    if name.endswith("output_layer.weight"):
        return 0, 1, True, "last"
    if re.search(r"linear_fc1\.(weight|bias)$", name) and gated:
        return 0, 2, False, "first"
    if re.search(r"linear_(qkv|fc1)\.(weight|bias)$", name):
        return 0, 1, False, "first"
    if re.search(r"linear_(proj|fc2)\.weight$", name):
        return 1, 1, False, "first"
    if "final_layernorm." in name:
        return None, 1, False, "last"
    return None, 1, False, "first"


def parse_config(config):
    tp, pp, dp = (int(re.search(r"(?<![a-z])" + k + r"=(\d+)", config).group(1))
                  for k in ("tp", "pp", "dp"))
    m = re.search(r"stages=([\d:]+)", config)
    return tp, pp, dp, ([int(s) for s in m.group(1).split(":")] if m else None)


def distopt_of(config):
    """Whether the config says distopt=1."""
    return re.search(r"distopt=1", config) is not None


def distopt_parts(shard, dp):
    """Megatron-Core's distributed optimizer over one (stage, tp) shard
    ({local name: array}, in the model's order): the parameters in reverse
    order, each starting at a multiple of 64 elements, the buffer's end
    padded to lcm(dp, 128); dp rank d owns the d-th of dp equal parts and
    holds, of each parameter's optimizer state (optimizer.KEY.PARAM), the
    flat elements in its part. Parameters stay whole. One dict per dp rank."""
    at, starts = 0, {}
    for name in reversed([n for n in shard if not n.startswith("optimizer.")]):
        at = -(-at // 64) * 64
        starts[name] = at
        at += shard[name].size
    multiple = math.lcm(dp, 128)
    per = -(-at // multiple) * multiple // dp
    parts = []
    for d in range(dp):
        lo, hi, part = d * per, (d + 1) * per, {}
        for name, x in shard.items():
            if not name.startswith("optimizer."):
                part[name] = x
                continue
            start = starts[name.split(".", 2)[2]]
            a, b = max(start, lo), min(start + x.size, hi)
            if a < b:
                part[name] = x.reshape(-1)[a - start:b - start]
        parts.append(part)
    return parts


def fsdp_of(config):
    """S of ",fsdp=S", 1 without it."""
    m = re.search(r"fsdp=(\d+)", config)
    return int(m.group(1)) if m else 1


def chunk(x, s, c):
    """torch.chunk's chunk c of s on dim 0: ceil(n/s) rows each, the last
    ones smaller or empty; a scalar is every chunk."""
    if x.ndim == 0:
        return x
    size = -(-x.shape[0] // s)
    return x[c * size:(c + 1) * size]


def slice_tensor(x, name, tp, t, gated, divisor):
    split, blocks, vocab, _ = rule(name, gated)
    if split is None:
        return x
    x = np.moveaxis(x, split, 0)
    if vocab:
        padded = -(-x.shape[0] // (divisor * tp)) * divisor * tp
        pad = np.zeros((padded - x.shape[0],) + x.shape[1:], x.dtype)
        part = np.concatenate([x, pad])[t * padded // tp:(t + 1) * padded // tp]
    else:
        part = np.concatenate([np.split(b, tp)[t] for b in np.split(x, blocks)])
    return np.moveaxis(part, 0, split)


def rank_shards(full, config, gated, divisor, layers):
    """{rank: {local name: array}} for every rank that saves: dp_rank 0, or
    under fsdp=S the first S dp ranks, each with its chunk, or under
    distopt=1 every rank, each with its part of the optimizer state."""
    tp, pp, dp, stages = parse_config(config)
    fsdp = fsdp_of(config)
    distopt = distopt_of(config)
    if stages is None:
        stages = [layers // pp + (1 if p < layers % pp else 0) for p in range(pp)]
    first = [sum(stages[:p]) for p in range(pp)]
    out = {}
    for p in range(pp):
        for t in range(tp):
            shard = {}
            for name, x in full.items():
                m = re.search(r"decoder\.layers\.(\d+)\.", name)
                if m:
                    layer = int(m.group(1))
                    if not first[p] <= layer < first[p] + stages[p]:
                        continue
                    local = name.replace(f"layers.{layer}.", f"layers.{layer - first[p]}.", 1)
                else:
                    stage = rule(name, gated)[3]
                    if stage != ("first" if p == 0 else "") and not (stage == "last" and p == pp - 1):
                        continue
                    local = name
                shard[local] = slice_tensor(x, name, tp, t, gated, divisor)
            if distopt:
                for d, part in enumerate(distopt_parts(shard, dp)):
                    out[(p * dp + d) * tp + t] = part
                continue
            for c in range(fsdp):
                out[(p * dp + c) * tp + t] = {k: chunk(v, fsdp, c) for k, v in shard.items()}
    return out


def random_gpt(rng, layers, hidden, heads, groups, ffn, vocab, gated, dtype=np.float32):
    hd = hidden // heads
    shapes = {"embedding.word_embeddings.weight": (vocab, hidden)}
    for n in range(layers):
        p = f"decoder.layers.{n}."
        shapes[p + "self_attention.linear_qkv.layer_norm_weight"] = (hidden,)
        shapes[p + "self_attention.linear_qkv.weight"] = ((heads + 2 * groups) * hd, hidden)
        shapes[p + "self_attention.linear_proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.linear_fc1.layer_norm_weight"] = (hidden,)
        shapes[p + "mlp.linear_fc1.weight"] = (ffn * (2 if gated else 1), hidden)
        shapes[p + "mlp.linear_fc2.weight"] = (hidden, ffn)
    shapes["decoder.final_layernorm.weight"] = (hidden,)
    shapes["output_layer.weight"] = (vocab, hidden)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


def scalai(binary, *args, expect=0):
    p = subprocess.run([binary, *args], capture_output=True, text=True)
    assert p.returncode == expect, (
        f"scalai {' '.join(args)}: exit {p.returncode}, expected {expect}\n{p.stdout}{p.stderr}")
    return p
