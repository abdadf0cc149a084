"""Graceful stop on SIGTERM/SIGINT, and the errors that end a run early.

The training loops run inside :class:`StopSignals`: the first signal only sets a flag, the
loop notices it after the current step, writes a checkpoint and raises :class:`Preempted`;
a second signal interrupts at once (the previous checkpoint stays usable: saves are atomic).
With several processes the flag is agreed on with an all-gather, so every process stops
after the same step.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint.

    Attributes:
      signum: the signal received.
      step: the step the checkpoint holds.
      directory: the checkpoint directory.
    """

    def __init__(self, signum: int, step: int, directory: str) -> None:
        self.signum, self.step, self.directory = signum, step, directory
        name = signal.Signals(signum).name
        super().__init__(
            f"{name}: stopped after step {step}; checkpoint saved in {directory}. "
            "Resume by running the same command again (or add --resume)."
        )

    @property
    def exit_code(self) -> int:
        """The conventional ``128 + signal`` status, so schedulers see a signalled stop."""
        return 128 + self.signum


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class OutOfDeviceMemory(RuntimeError):
    """A device ran out of memory (XLA's ``RESOURCE_EXHAUSTED``); the message is one line
    that says where and what to try."""


OOM_ADVICE = (
    "`python -m jaxrlhf.train --config ... --dry-run` prints each phase's memory per device; "
    "lower the batch, micro-batch, rollout or sequence sizes, turn on model.remat, or give "
    "the run more devices"
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA running out of device (or host) memory: a
    ``RESOURCE_EXHAUSTED`` status about memory or an allocation ("Out of memory ...",
    "Failed to allocate request for ..."), not one about a size limit (a message "larger
    than max")."""
    message = str(error).lower()
    return (
        isinstance(error, jax.errors.JaxRuntimeError)
        and message.startswith("resource_exhausted")
        and ("memory" in message or "allocat" in message)
    )


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message (XLA's can run to pages)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def out_of_memory_message(error: BaseException, where: str) -> str:
    """One line: ``where`` it happened ("in step 4"), XLA's own first line (the allocation
    that failed) and :data:`OOM_ADVICE`."""
    return f"out of device memory {where} ({first_line(error).rstrip('.')}). {OOM_ADVICE}."


def check_skips(run: int, step: int, limit: int) -> None:
    """Raises :class:`TrainingDiverged` when ``run`` consecutive updates were skipped.

    Args:
      run: the longest run of consecutive skipped updates seen (RL: iterations with one).
      step: the current step, for the message.
      limit: ``train.max_consecutive_skips``.
    """
    if run >= limit:
        raise TrainingDiverged(
            f"step {step}: {run} consecutive updates had a non-finite loss or gradient "
            f"(train.max_consecutive_skips={limit}); lower optimizer.lr, set "
            "optimizer.max_grad_norm or check the data."
        )


class StopSignals:
    """Context manager catching SIGTERM and SIGINT while a run trains.

    Handlers are installed only in the main thread of the main interpreter (elsewhere,
    e.g. a notebook's worker thread, signals keep their defaults and ``requested`` is
    always None).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # a second signal: stop now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + signum)
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name} received: finishing the current step and "
            "saving a checkpoint (send it again to stop immediately)",
            file=sys.stderr,
            flush=True,
        )

    def requested(self) -> int | None:
        """The signal to stop on, agreed by all processes (None: keep training)."""
        local = self.signum or 0
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            every = multihost_utils.process_allgather(np.int32(local))
            local = int(np.max(every))
        return local or None
