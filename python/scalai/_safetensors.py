"""The safetensors format as the mount serves it: read by mapping the file
(tensors are views of the mapping, so a tensor never touched is never read),
written in one pass."""
import json
import mmap
import os
import struct

import numpy as np

# safetensors dtype -> numpy dtype; BF16 has none in numpy: its bits as
# uint16 (load_shard gives torch.bfloat16).
NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
         "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4",
         "U16": "<u2", "U8": "u1", "BOOL": "?", "F8_E4M3": "u1", "F8_E5M2": "u1"}
NAME_OF = {np.dtype(v).str: k for k, v in NUMPY.items()
           if k not in ("BF16", "F8_E4M3", "F8_E5M2")}


class File:
    """An opened safetensors file: `header` (name -> entry), `metadata`, and
    `array(name)`, a numpy view of one tensor in the mapping."""

    def __init__(self, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise ValueError(f"{path}: {size} bytes is too short for safetensors")
            # Copy-on-write: views are writable (torch wants that) and a
            # write stays in this process.
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        (n,) = struct.unpack("<Q", self._map[:8])
        if 8 + n > size:
            raise ValueError(f"{path}: header of {n} bytes runs past the file's end")
        header = json.loads(bytes(self._map[8:8 + n]))
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._data = 8 + n
        self.path = path

    def array(self, name):
        e = self.header[name]
        begin, end = e["data_offsets"]
        dtype = np.dtype(NUMPY[e["dtype"]])
        count = (end - begin) // dtype.itemsize
        return np.frombuffer(self._map, dtype=dtype, count=count,
                             offset=self._data + begin).reshape(e["shape"])


def to_bytes(tensors, metadata):
    """The header, then each tensor's bytes: (header bytes, [arrays])."""
    header, offset, arrays = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, (dtype, arr) in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, arrays
