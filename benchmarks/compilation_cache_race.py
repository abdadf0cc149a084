"""Reads of JAX's persistent compilation cache racing a write, as the test suite's xdist
workers (which share one cache directory, tests/conftest.py) do when two compile the same
program: one process writes ``--entries`` entries of ``--megabytes`` MB while another reads
each as soon as its file exists, and counts the entries it read shorter than written. Run
with the cache's default (no size limit: no lock) and with a size limit (its file lock
around reads and writes).

    python benchmarks/compilation_cache_race.py --entries 40 --megabytes 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

from jax._src.lru_cache import LRUCache  # the cache's file store (no public name)


def write(path: str, max_size: int, entries: int, size: int) -> None:
    cache = LRUCache(path, max_size=max_size)
    for i in range(entries):
        cache.put(f"k{i}", b"x" * size)


def read(path: str, max_size: int, entries: int, size: int, out: mp.Queue) -> None:
    cache = LRUCache(path, max_size=max_size)
    read_count = short = 0
    deadline = time.monotonic() + 120
    while read_count < entries and time.monotonic() < deadline:
        value = cache.get(f"k{read_count}")
        if value is not None:
            short += len(value) != size
            read_count += 1
    out.put((read_count, short))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=40)
    parser.add_argument("--megabytes", type=int, default=64)
    args = parser.parse_args()
    size = args.megabytes << 20
    for name, max_size in (("no size limit (no lock)", -1), ("size limit 1 TB (lock)", 1 << 40)):
        with tempfile.TemporaryDirectory() as path:
            out: mp.Queue = mp.Queue()
            reader = mp.Process(target=read, args=(path, max_size, args.entries, size, out))
            writer = mp.Process(target=write, args=(path, max_size, args.entries, size))
            reader.start()
            writer.start()
            writer.join()
            reader.join()
            read_count, short = out.get()
        print(f"{name}: {read_count} entries read, {short} of them truncated", flush=True)


if __name__ == "__main__":
    main()
