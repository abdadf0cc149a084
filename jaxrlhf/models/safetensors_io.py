"""Minimal, lazy safetensors reading and streaming writing with NumPy.

Reading memory-maps each file, so a tensor's bytes are only paged in when sliced; a 70B
checkpoint never sits in host memory as a whole. bfloat16 is handled through ``ml_dtypes``
(shipped with JAX), which ``safetensors.numpy`` does not support. Nothing here can load a
pickle: the format is a JSON header followed by raw little-endian bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, malformed, or does not match the model."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


def _read_header(path: str) -> dict[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file not found: {path}") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})") from None
    infos = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {meta['dtype']}")
        start, _ = meta["data_offsets"]
        infos[key] = TensorInfo(
            path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + header_len + start
        )
    return infos


class SafetensorsReader:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path} is not a valid index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single_path):
            weight_map, files = None, [SINGLE_FILE]
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            what = (
                "directory does not exist" if not os.path.isdir(directory) else (f"found {found}")
            )
            raise CheckpointError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {directory} ({what}); "
                "only safetensors checkpoints are loaded (never pickle .bin files)"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            self.tensors.update(_read_header(os.path.join(directory, name)))
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self.tensors)
            if missing:
                raise CheckpointError(
                    f"{index_path} lists {len(missing)} tensors not found in their files, "
                    f"e.g. {missing[0]}"
                )
        self._maps: dict[str, np.memmap] = {}

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(
                f"tensor {key} not found in checkpoint {self.directory}"
            ) from None

    def get(self, key: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor (bytes are read on access)."""
        info = self.info(key)
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        count = int(np.prod(info.shape, dtype=np.int64))
        raw = self._maps[info.file][info.offset : info.offset + count * info.dtype.itemsize]
        return raw.view(info.dtype).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype


def write_safetensors(
    directory: str,
    planned: list[PlannedTensor],
    arrays: Iterator[np.ndarray],
    *,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Stream tensors to one or more safetensors files (with an index when sharded).

    ``planned`` fixes the keys, shapes and dtypes up front so headers can be written before
    the data; ``arrays`` yields the tensors in the same order, one at a time, so only one
    tensor is held in host memory. Returns the file names written.
    """
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in planned:
        nbytes = int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize
        if max_shard_bytes and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    if len(groups) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    total = 0
    for name, group in zip(names, groups, strict=True):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in group:
            nbytes = int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize
            header[t.key] = {
                "dtype": _NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[t.key] = name
        total += offset
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in group:
                array = np.ascontiguousarray(next(arrays), dtype=t.dtype)
                if array.shape != t.shape:
                    raise CheckpointError(f"tensor {t.key}: planned {t.shape}, got {array.shape}")
                f.write(array.tobytes())
    if len(names) > 1:
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
