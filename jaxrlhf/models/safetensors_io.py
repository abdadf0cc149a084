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
from typing import Any

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


# The safetensors library's own bound; a damaged length field is usually far above it.
MAX_HEADER_BYTES = 100_000_000


def _read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one file, after checking that the header fits the file and that each
    tensor's bytes lie inside it (so a damaged file fails here, not when a tensor is read).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(
                    f"{path} is not a valid safetensors file ({size} bytes, shorter than the "
                    "8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path} is not a valid safetensors file or is truncated (its header length "
                    f"field says {header_len} bytes; the file has {size})"
                )
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not a valid safetensors file (its header is not JSON: {e})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a valid safetensors file (header is not an object)")
    data_start = 8 + header_len
    return {
        key: _tensor_info(path, key, meta, data_start, size)
        for key, meta in header.items()
        if key != "__metadata__"
    }


def _tensor_info(path: str, key: str, meta: Any, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: known dtype, offsets that match the shape and the file."""
    try:
        dtype, shape, (start, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
        shape = tuple(int(d) for d in shape)
        start, end = int(start), int(end)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(
            f"{path} is not a valid safetensors file (malformed header entry for tensor {key})"
        ) from None
    if dtype not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {dtype}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
    if min(shape, default=0) < 0 or start < 0 or end - start != nbytes:
        raise CheckpointError(
            f"{path} is damaged: tensor {key} of shape {list(shape)} ({dtype}) has data "
            f"offsets [{start}, {end}], which do not span its {nbytes} bytes"
        )
    if data_start + end > size:
        raise CheckpointError(
            f"{path} is truncated: tensor {key} ends at byte {data_start + end} but the file "
            f"has {size} bytes (copy or export it again)"
        )
    return TensorInfo(path, _DTYPES[dtype], shape, data_start + start)


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
