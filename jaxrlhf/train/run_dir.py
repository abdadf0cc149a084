"""Checks on a run's ``output_dir`` before anything is written into it.

The run directory is created late (after the model, data and checkpoints are set up), so a
path that can never hold it (a file, a file among its parents, an unwritable parent) would
otherwise surface as an ``OSError`` traceback from Orbax or ``os.makedirs`` minutes in.
"""

from __future__ import annotations

import os

from jaxrlhf.config import ConfigError


def check_output_dir(path: str) -> None:
    """Raises unless ``path`` is, or can be created as, a writable directory.

    Nothing is created: call it on every process before the run's first write. A path that
    does not exist yet is judged by its nearest existing ancestor.

    Args:
      path: the run directory (``output_dir``, or its default).

    Raises:
      ConfigError: one line, ``output_dir: PATH ...`` saying what is in the way.
    """
    absolute = os.path.abspath(path)
    existing = absolute
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == absolute:
            raise ConfigError(f"output_dir: {path} is a file, not a directory; choose another")
        raise ConfigError(
            f"output_dir: {path} cannot be created: {existing} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == absolute else f" cannot be created: {existing}"
        raise ConfigError(f"output_dir: {path}{where} is not writable by this user")


LOCK_FILE = ".lock"


class RunDirectoryInUse(ConfigError):
    """Another live run holds the run directory (one line: where, and who)."""


class RunLock:
    """Exclusive hold of a run directory for as long as a run writes into it.

    The lock is an ``flock`` on ``output_dir/.lock``, which the operating system releases
    when the holding process exits however it exits (a crash, ``kill -9``), so a dead run's
    lock never blocks the next one; the file itself stays, and records who held it last
    (host, pid, start time) for the message a second run prints. In a multi-process run only
    process 0 takes the lock and tells the others whether it got it, so every process stops
    with the same one-line error (on a shared filesystem that supports locks: local disks,
    NFSv4; object-store mounts that do not are refused with their error).

    Use as a context manager around everything a run writes::

        with RunLock(run_dir):
            ...
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._file = None

    def __enter__(self) -> RunLock:
        import jax

        error = self._acquire() if jax.process_index() == 0 else ""
        if jax.process_count() > 1:
            error = _shared_from_process_0(error)
        if error:
            raise RunDirectoryInUse(error)
        return self

    def _acquire(self) -> str:
        """Takes the lock; returns "" or the one-line reason it cannot."""
        import fcntl
        import socket
        import time

        os.makedirs(self.run_dir, exist_ok=True)
        path = os.path.join(self.run_dir, LOCK_FILE)
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115  held until __exit__
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return (
                f"output_dir: {self.run_dir} is in use by a running job ({holder}); wait for "
                "it to finish, or give this run another output_dir"
            )
        except OSError as e:
            f.close()
            return f"output_dir: {self.run_dir}: cannot lock {path} ({e.strerror})"
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        f.flush()
        self._file = f
        return ""

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None


def _shared_from_process_0(error: str) -> str:
    """Process 0's ``error`` ("" when it holds the lock), on every process."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.zeros(512, np.uint8)
    encoded = error.encode("utf-8")[:512]
    data[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return bytes(shared[shared > 0]).decode("utf-8", errors="replace")
