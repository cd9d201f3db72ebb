"""An independent writer of the dataset formats Scalai reads, for tests and
benchmarks: JSONL files, and Megatron-LM indexed dataset pairs (MMIDIDX
version 1: the .idx header and tables, the .bin of tokens) written with
numpy as Megatron's own writer lays them out. Each writer returns every
sample's expected bytes, in order."""
import json
import struct

import numpy as np

# Megatron's DType codes.
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                  np.float64: 6, np.float32: 7, np.uint16: 8}


def write_jsonl(path, records, final_newline=True):
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records]
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + (b"\n" if final_newline else b""))
    return lines


def megatron_idx(lengths, dtype, documents=None):
    """The .idx bytes for sequences of `lengths` tokens laid end to end."""
    lengths = np.asarray(lengths, dtype=np.int32)
    item = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * item)
    if documents is None:
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
    documents = np.asarray(documents, dtype=np.int64)
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype])
            + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents))
            + lengths.tobytes() + pointers.tobytes() + documents.tobytes())


def write_megatron(prefix, sequences, dtype):
    """Writes prefix.idx and prefix.bin; returns each sequence's bytes."""
    arrays = [np.asarray(s, dtype=dtype) for s in sequences]
    with open(prefix + ".bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(megatron_idx([len(a) for a in arrays], dtype))
    return [a.tobytes() for a in arrays]


def random_records(rng, n):
    """JSON records of varied length, some with non-ASCII text."""
    words = ["alpha", "βeta", "gamma", "δelta", "tokens", "shard", "mount", "ε"]
    return [{"id": int(i), "text": " ".join(rng.choice(words, size=int(rng.integers(0, 40))))}
            for i in range(n)]


def random_sequences(rng, n, dtype, max_len=64):
    high = 50000 if np.dtype(dtype).itemsize >= 2 else 100
    return [rng.integers(0, high, size=int(rng.integers(1, max_len))).astype(dtype)
            for _ in range(n)]
