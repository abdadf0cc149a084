"""Does a jitted forward run slower on a background thread than on the main thread on CPU?

Streamed scoring (``rollout.stream_concurrent``) runs the scoring forwards on a worker
thread. With ``platform.reuse_freed_host_memory`` the main thread's freed buffers stay in the
process's main heap and are reused without page faults; a worker thread allocates from its
own malloc arena, whose heaps hold at most 64 MiB in one piece, so a larger buffer (here the
``[rows, tokens, vocab]`` logits) is mmapped and faulted in again on every call. This times
the same jitted bench-M forward and log-softmax on both threads, alternating, on a quiet
machine (nothing else runs, so the two differ only in which thread dispatches), with the
process's minor page faults and system CPU time during each call.

    python benchmarks/worker_thread_forward.py --rounds 4 --calls 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrlhf import platform  # noqa: E402

platform.reuse_freed_host_memory()  # as python -m jaxrlhf.train on CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import generate as g1  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-m", choices=sorted(g1.MODELS))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=4, help="timed calls per thread per round")
    args = parser.parse_args()
    cfg = g1.MODELS[args.model]()
    module = model_lib.build(cfg)
    params = model_lib.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.rows, args.tokens)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)

    @jax.jit
    def score(p, t, m):
        return jax.nn.log_softmax(model_lib.forward(module, p, t, m)).max(-1).sum()

    def once() -> tuple[float, int, float]:
        """(seconds, the process's minor page faults, its system CPU seconds) of one call."""
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        jax.block_until_ready(score(params, tokens, mask))
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        return seconds, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime

    def medians(calls: list[tuple[float, int, float]]) -> tuple[float, ...]:
        return tuple(statistics.median(column) for column in zip(*calls, strict=True))

    once()  # compiles
    logits_mib = args.rows * args.tokens * cfg.vocab_size * 4 / 2**20
    print(
        f"{args.model}, CPU {g1.cpu_model()}: [{args.rows}, {args.tokens}] forward, "
        f"logits {logits_mib:.0f} MiB"
    )
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as worker:
        for r in range(args.rounds):
            m, m_faults, m_kernel = medians([once() for _ in range(args.calls)])
            w, w_faults, w_kernel = medians(
                [worker.submit(once).result() for _ in range(args.calls)]
            )
            print(
                f"round {r}: main thread {m:.3f} s ({m_faults:.0f} page faults, "
                f"{m_kernel:.2f} s system CPU a call), worker thread {w:.3f} s "
                f"({w_faults:.0f}, {w_kernel:.2f} s) (medians of {args.calls}): "
                f"worker / main {w / m:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
