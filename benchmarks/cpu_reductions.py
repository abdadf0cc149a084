"""XLA:CPU's slow fused multiply-then-reduce over ``[1, T, V]`` logits, and what the losses do
instead.

The policy update's entropy metric, ``-sum_v p_v log p_v`` over a packed shard's ``[1, K, V]``
logits, took 3.7 of the 27.9 s of bench-M's R1-long update (a profile of the trainer,
2026-11-27): XLA:CPU (jax 0.10) turns ``(a * b).sum(-1)`` on a 3-D array with a leading 1 into
one slow fused kernel, while the same contraction written as an ``einsum`` (or on a 2-D
array) runs at memory speed. ``jaxrlhf.losses.common`` computes the entropy as a contraction.
This script times the forms side by side (milliseconds, best of ``--reps``):

    python benchmarks/cpu_reductions.py --tokens 7488 --vocab 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.generate import cpu_model  # noqa: E402
from jaxrlhf.losses.common import entropy_from_logits  # noqa: E402


def best_ms(fn, *args, reps: int) -> float:
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def select_entropy(x):
    """The entropy as the losses computed it before (select on isfinite, multiply, reduce)."""
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    finite = jnp.isfinite(x)
    logp = jnp.where(finite, x - lse, 0.0)
    p = jnp.where(finite, jnp.exp(logp), 0.0)
    return -jnp.sum(p * logp, axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=7488)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    x = jax.random.normal(jax.random.key(0), (1, args.tokens, args.vocab))
    y = x + 1.0
    print(f"# {cpu_model()}, jax {jax.__version__}, [1, {args.tokens}, {args.vocab}] float32")
    rows = [
        ("(x * y).sum(-1), 3-D", lambda a, b: (a * b).sum(-1), (x, y)),
        ("(x * y).sum(-1), 2-D", lambda a, b: (a * b).sum(-1), (x[0], y[0])),
        ("einsum('...v,...v->...'), 3-D", lambda a, b: jnp.einsum("...v,...v->...", a, b), (x, y)),
        ("entropy, select + multiply + reduce", select_entropy, (x,)),
        ("entropy, losses.common (contraction)", entropy_from_logits, (x,)),
    ]
    for name, fn, fn_args in rows:
        print(f"{name:40s} {best_ms(fn, *fn_args, reps=args.reps):9.2f} ms")


if __name__ == "__main__":
    main()
