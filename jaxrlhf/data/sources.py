"""Raw records (dicts) from local JSONL, Parquet, ``datasets`` directories or built-in tasks.

Parquet needs pyarrow and ``datasets`` directories need the datasets package; neither is a
dependency of jaxrlhf, so each is imported only when such a source is used, with a one-line
error naming the missing package.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxrlhf.data.errors import DataError

BUILTIN_PREFIX = "builtin:"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a UTF-8 JSON-lines file (a leading byte-order mark is allowed); blank lines
    are skipped.

    Raises:
      DataError: missing or empty file, a line that is not UTF-8 or not valid JSON, or one
        that is not a JSON object (the message gives ``path:line``).
    """
    records = []
    try:
        f = open(path, "rb")  # decoded per line, so a bad byte is reported with its line
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}); convert the file to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
                )
            records.append(record)
    if not records:
        raise DataError(f"{path}: empty file, no records")
    return records


def read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow, which is not installed (pip install pyarrow)"
        ) from None
    records = pq.read_table(path).to_pylist()
    if not records:
        raise DataError(f"{path}: empty file, no records")
    return records


def read_saved_dataset(path: str, split: str) -> list[dict[str, Any]]:
    """Records of a directory written by ``Dataset.save_to_disk`` or ``DatasetDict``'s."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading a saved datasets directory needs the datasets package, which is "
            "not installed (pip install datasets)"
        ) from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} (splits: {sorted(ds)})")
        ds = ds[split]
    records = list(ds)
    if not records:
        raise DataError(f"{path}: empty dataset, no records")
    return records


def read_records(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Records of a local file or saved dataset directory, chosen by its suffix.

    Args:
      source: ``*.jsonl`` / ``*.json`` / ``*.ndjson`` (JSON lines), ``*.parquet``, or a
        directory saved by ``datasets``.
      split: the split of a saved ``DatasetDict``.

    Raises:
      DataError: unknown format, missing file, or unreadable content (one line).
    """
    if os.path.isdir(source):
        return read_saved_dataset(source, split)
    lower = source.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return read_jsonl(source)
    if lower.endswith(PARQUET_SUFFIXES):
        if not os.path.exists(source):
            raise DataError(f"{source}: no such file")
        return read_parquet(source)
    if not os.path.exists(source):
        raise DataError(f"{source}: no such file or directory")
    raise DataError(
        f"{source}: unknown data format (expected {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        " or a datasets directory)"
    )
