#!/usr/bin/env python3
"""An independent safetensors reader: Python's json + struct + numpy only, sharing no code with booster.

It proves that what booster writes is what the format says (and so what PyTorch's tools read):

    python3 tests/safetensors_reader.py FILE.safetensors
    python3 tests/safetensors_reader.py DIR_OR_INDEX   # model.safetensors.index.json and its shards

prints one line per tensor, sorted by name:

    <name> <dtype> <shape as 1,2,3 or "scalar"> sum=<float64 sum> values=<v0>,<v1>,...

with every value as Python's repr of a float64 (bool and integers as integers), and "metadata <key>=<value>"
lines for __metadata__. It exits with status 1 and a message on stderr when the file breaks the format.
"""
import json
import os
import struct
import sys

import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened below: the top 16 bits of a float32
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "BOOL": np.dtype("u1"),
}


class FormatError(Exception):
    pass


def read_file(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise FormatError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise FormatError(f"{path}: header length {n} passes the end of the file")
    if n % 8 != 0:
        raise FormatError(f"{path}: header length {n} is not a multiple of 8 (data not aligned)")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    spans = []
    for name, entry in header.items():
        if set(entry) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{path}: tensor {name} has fields {sorted(entry)}")
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * dtype.itemsize:
            raise FormatError(f"{path}: tensor {name} span {end - begin} != {count} x {dtype.itemsize}")
        spans.append((begin, end, name))
        array = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        if entry["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        if entry["dtype"] == "BOOL":
            if array.size and array.max() > 1:
                raise FormatError(f"{path}: BOOL tensor {name} holds a byte other than 0 or 1")
            array = array.astype(bool)
        tensors[name] = (entry["dtype"], shape, array)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise FormatError(f"{path}: tensor {name} starts at {begin}, expected {position} (gap or overlap)")
        position = end
    if position != len(data):
        raise FormatError(f"{path}: {len(data) - position} bytes after the last tensor")
    return tensors, metadata


def read_model(path):
    if os.path.isdir(path):
        single = os.path.join(path, "model.safetensors")
        path = single if os.path.exists(single) else os.path.join(path, "model.safetensors.index.json")
    if not path.endswith(".index.json"):
        return read_file(path)
    with open(path) as f:
        index = json.load(f)
    tensors, total = {}, 0
    for shard in sorted(set(index["weight_map"].values())):
        shard_tensors, _ = read_file(os.path.join(os.path.dirname(path), shard))
        for name, value in shard_tensors.items():
            if index["weight_map"].get(name) != shard:
                raise FormatError(f"{shard}: tensor {name} is not mapped to this shard")
            total += value[2].nbytes if value[0] != "BF16" else value[2].size * 2
        tensors.update(shard_tensors)
    if set(tensors) != set(index["weight_map"]):
        raise FormatError(f"{path}: weight_map and shards name different tensors")
    if index["metadata"]["total_size"] != total:
        raise FormatError(f"{path}: total_size {index['metadata']['total_size']} != {total}")
    return tensors, {"shards": str(len(set(index["weight_map"].values())))}


def format_value(dtype, v):
    if dtype in ("I64", "I32", "BOOL"):
        return str(int(v))
    return repr(float(v))


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        tensors, metadata = read_model(sys.argv[1])
    except (FormatError, KeyError, ValueError, OSError) as e:
        print(f"safetensors_reader: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for key in sorted(metadata):
        print(f"metadata {key}={metadata[key]}")
    for name in sorted(tensors):
        dtype, shape, array = tensors[name]
        flat = array.reshape(-1)
        shape_text = ",".join(str(d) for d in shape) if shape else "scalar"
        total = float(flat.astype(np.float64).sum()) if flat.size else 0.0
        values = ",".join(format_value(dtype, v) for v in flat)
        print(f"{name} {dtype} {shape_text} sum={total!r} values={values}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
