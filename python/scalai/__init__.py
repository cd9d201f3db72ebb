"""Scalai from a training script: a rank's shard loaded from the mount and
saved into it, a rank's samples read from the current position, the mount
reconfigured and asked how it stands. numpy is required; torch is used when
present (tensors come back as torch tensors, and RankSamples is a
torch.utils.data.Dataset).

    import scalai
    shard = scalai.load_shard("/mnt/job")            # RANK from the launcher
    model.load_state_dict({k: v for k, v in shard.items()
                           if not k.startswith("optimizer.")})
    for sample in scalai.RankSamples("/mnt/job", "web"):
        ...
    scalai.save_shard("/mnt/job", step, rank, model.state_dict(),
                      extra={"state.json": json.dumps(state)},
                      consumed_samples=step * global_batch)
"""
import json
import os
import time

import numpy as np

from . import _safetensors

try:
    import torch
except ImportError:  # numpy only
    torch = None

__all__ = ["ScalaiError", "load_shard", "save_shard", "RankSamples", "reconfigure",
           "status", "parse_config", "dp_rank_of"]
__version__ = "0.1.0"


class ScalaiError(Exception):
    """What the mount refused, with its reason (the `error` of its status)."""


def status(mount):
    """The mount's status: {"generation", "config", "state", "progress",
    "error", ...}."""
    with open(os.path.join(mount, "status")) as f:
        return json.load(f)


def parse_config(config):
    """"tp=2,pp=1,dp=4,fsdp=2" -> {"tp": 2, "pp": 1, "dp": 4, "fsdp": 2};
    keys that are not numbers (stages, hosts) stay text."""
    out = {}
    for part in config.split(","):
        key, _, value = part.partition("=")
        out[key] = int(value) if value.isdigit() else value
    return out


def dp_rank_of(config, rank):
    """The data-parallel rank of global rank `rank`, as the mount numbers
    ranks (tp fastest, then dp, then pp)."""
    c = parse_config(config) if isinstance(config, str) else config
    return (rank // c["tp"]) % c["dp"]


def _rank(rank):
    if rank is not None:
        return int(rank)
    if "RANK" not in os.environ:
        raise ScalaiError("no rank given and RANK is not set (torchrun sets it)")
    return int(os.environ["RANK"])


def _step_dir(mount, step):
    name = "latest" if step == "latest" else f"step-{int(step):08d}"
    return os.path.join(mount, "ckpt", name)


def _reason(mount, error):
    """An OSError from the mount, with the reason its status gives."""
    try:
        why = status(mount).get("error")
    except OSError:
        why = None
    text = f"{error.filename}: {error.strerror}"
    return ScalaiError(f"{text}: {why}" if why else text)


class Shard(dict):
    """A rank's tensors by name, with the file's `metadata` and its `step`.
    The tensors are views of a private mapping of the mount's file: a
    tensor never touched is never read."""

    def __init__(self, tensors, metadata):
        super().__init__(tensors)
        self.metadata = metadata
        self.step = int(metadata["scalai.step"]) if "scalai.step" in metadata else None


def load_shard(mount, rank=None, step="latest", device="cpu"):
    """Rank `rank`'s tensors (default: the launcher's RANK) of `step` ("latest"
    or a number), as torch tensors on `device` when torch is present (on the
    CPU, zero-copy), else numpy arrays (bfloat16 as raw uint16). device=None
    asks for numpy arrays."""
    r = _rank(rank)
    path = os.path.join(_step_dir(mount, step), f"rank-{r:05d}", "model.safetensors")
    try:
        f = _safetensors.File(path)
    except OSError as e:
        raise _reason(mount, e) from None
    tensors = {}
    for name, entry in f.header.items():
        arr = f.array(name)
        if device is None or torch is None:
            tensors[name] = arr
            continue
        if entry["dtype"] == "BF16":  # torch has no uint16: int16, then bfloat16
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        tensors[name] = t if str(device) == "cpu" else t.to(device)
    return Shard(tensors, f.metadata)


_TORCH_NAMES = {}
if torch is not None:
    _TORCH_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                    torch.bool: "BOOL"}


def _as_array(name, value):
    """(safetensors dtype, numpy array of the bytes) of a tensor or array."""
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype not in _TORCH_NAMES:
            raise ScalaiError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        if t.dtype == torch.bfloat16:
            return "BF16", t.view(torch.int16).numpy()
        return _TORCH_NAMES[t.dtype], t.numpy()
    arr = np.asarray(value)
    if arr.dtype.str not in _safetensors.NAME_OF:
        raise ScalaiError(f"tensor {name}: dtype {arr.dtype} has no safetensors name")
    return _safetensors.NAME_OF[arr.dtype.str], arr


def _write(mount, path, chunks):
    """Writes the chunks to a new file at `path` and closes it; the mount
    checks the file at close, so a refusal surfaces there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise _reason(mount, e) from None
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
    except OSError as e:
        os.close(fd)
        raise _reason(mount, e) from None
    try:
        os.close(fd)
    except OSError as e:
        e.filename = path
        raise _reason(mount, e) from None


def save_shard(mount, step, rank, tensors, extra=None, consumed_samples=None):
    """Saves rank `rank`'s shard of step `step` through the mount: the files
    of `extra` ({path under extra/: bytes or str}) first, then
    model.safetensors, the order in which the mount commits a rank. Raises
    ScalaiError with the mount's reason when it refuses the shard."""
    r = _rank(rank)
    step_dir = os.path.join(mount, "ckpt", f"step-{int(step):08d}")
    rank_dir = os.path.join(step_dir, f"rank-{r:05d}")
    try:
        os.makedirs(rank_dir, exist_ok=True)
    except OSError as e:
        raise _reason(mount, e) from None
    for rel, content in (extra or {}).items():
        path = os.path.join(rank_dir, "extra", rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise _reason(mount, e) from None
        _write(mount, path, [content.encode() if isinstance(content, str) else content])
    entries = {name: _as_array(name, value) for name, value in tensors.items()}
    metadata = {"scalai.step": step, "scalai.rank": r}
    if consumed_samples is not None:
        metadata["scalai.consumed_samples"] = consumed_samples
    head, arrays = _safetensors.to_bytes(entries, metadata)
    _write(mount, os.path.join(rank_dir, "model.safetensors"), [head] + arrays)


def reconfigure(mount, config, wait=True, timeout=600):
    """Writes `config` to the mount's config file; with `wait`, returns once
    the mount is ready under it (raises ScalaiError if it failed)."""
    try:
        with open(os.path.join(mount, "config"), "w") as f:
            f.write(config + "\n")
    except OSError as e:
        e.filename = e.filename or os.path.join(mount, "config")
        raise _reason(mount, e) from None
    if not wait:
        return status(mount)
    deadline = time.monotonic() + timeout
    while True:
        s = status(mount)
        if s["config"] == config and s["state"] == "ready":
            return s
        if s["config"] == config and s["state"] == "failed":
            raise ScalaiError(f"reconfiguring to {config}: {s.get('error')}")
        if time.monotonic() > deadline:
            raise ScalaiError(f"reconfiguring to {config}: not ready after {timeout} s: {s}")
        time.sleep(0.02)


_Base = torch.utils.data.Dataset if torch is not None else object


class RankSamples(_Base):
    """The samples data-parallel rank of `rank` (default: RANK) consumes from
    the dataset's current position, in order: JSONL records decoded, Megatron
    sequences as numpy token arrays. `sample_ids` are their global ids.
    Indexable and iterable; a torch Dataset when torch is present."""

    def __init__(self, mount, dataset, rank=None):
        config = status(mount)["config"]
        self.dp_rank = dp_rank_of(config, _rank(rank))
        self.dir = os.path.join(mount, "data", dataset)
        with open(os.path.join(self.dir, "dataset.json")) as f:
            self.info = json.load(f)
        self._rank_dir = os.path.join(self.dir, f"rank-{self.dp_rank:05d}")
        # Read to the end rather than by size: np.fromfile trusts st_size.
        with open(os.path.join(self._rank_dir, "sample-ids.u64"), "rb") as f:
            self.sample_ids = np.frombuffer(f.read(), dtype="<u8")
        self._tokens = (np.dtype(self.info["token_dtype"])
                        if self.info["format"] == "megatron" else None)

    def __len__(self):
        return len(self.sample_ids)

    def __getitem__(self, k):
        if not 0 <= k < len(self):
            raise IndexError(k)
        with open(os.path.join(self._rank_dir, "samples", str(k)), "rb") as f:
            data = f.read()
        if self._tokens is None:
            return json.loads(data)
        return np.frombuffer(data, dtype=self._tokens.newbyteorder("<"))

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]
