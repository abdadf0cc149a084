"""bench-M's decode matmuls at a few rows, in four ways: the plain ``[in, out]`` kernels
(XLA's dot), the 64-column weight blocks (``decode.CPU_MATMUL_BLOCK``) multiplied by XLA's
batched matmul (``blocks``) or by the C++ kernel the decode uses on CPU
(``kernel``: ``jaxrlhf.kernels.block_matmul``), and ``[out, in]`` (contracted on their last
dim; the decode does not use it: an Intel Xeon VM preferred it in an earlier session, see
benchmarks/RESULTS.md, "Decode in the model's kernel layout"). One jitted
chain of a decode step's 48 layer matmuls (12 layers: fused q/k/v, o, fused gate/up, down;
302 MB of float32 weights, no LM head), ``M`` rows through it; milliseconds per chain
(median of ``--reps`` calls, per round) and the weights' GB/s, the layouts alternating
round by round on one CPU device.

    python benchmarks/decode_matmuls.py --rows 1 2 4 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.generate import cpu_model  # noqa: E402
from jaxrlhf.generation.decode import CPU_MATMUL_BLOCK  # noqa: E402
from jaxrlhf.kernels.block_matmul import (  # noqa: E402
    available,
    block_matmul,
    einsum_block_matmul,
    unavailable_reason,
)

D, F, KV, LAYERS = 768, 2048, 256, 12  # bench-M: hidden, MLP, k and v widths, layers


LAYOUTS = ("plain", "blocks", "kernel", "transposed")


def weights(layout: str) -> list[jax.Array]:
    """The chain's kernels (the same values in every layout): ``[in, out]`` (plain), blocks
    ``[out / b, in, b]`` (blocks, kernel) or ``[out, in]`` (transposed)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(LAYERS):
        for shape in ((D, D + 2 * KV), (D, D), (D, 2 * F), (F, D)):
            w = (0.02 * rng.standard_normal(shape)).astype(np.float32)
            if layout in ("blocks", "kernel"):
                b = CPU_MATMUL_BLOCK
                w = w.reshape(w.shape[0], -1, b).transpose(1, 0, 2)
            elif layout == "transposed":
                w = w.T
            out.append(jnp.asarray(np.ascontiguousarray(w)))
    return out


def _transposed_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum("mk,nk->mn", x, kernel)  # [M, in] x [out, in] -> [M, out]


def _xla_blocks_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return einsum_block_matmul(x, kernel).reshape(x.shape[0], -1)


def _kernel_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return block_matmul(x, kernel).reshape(x.shape[0], -1)


MATMULS = {
    "plain": jnp.dot,
    "blocks": _xla_blocks_matmul,
    "kernel": _kernel_matmul,
    "transposed": _transposed_matmul,
}


@functools.partial(jax.jit, static_argnames="layout")
def chain(h: jax.Array, ws: list[jax.Array], layout: str) -> jax.Array:
    """One decode step's layer matmuls in order, residual adds between them."""
    matmul = MATMULS[layout]
    for i in range(LAYERS):
        qkv, o, gate_up, down = ws[4 * i : 4 * i + 4]
        q = matmul(h, qkv)[:, :D]
        h = h + matmul(q, o) * 1e-3
        g = matmul(h, gate_up)
        h = h + matmul(g[:, :F] * g[:, F:], down) * 1e-3
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30, help="calls timed per round")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    if "kernel" in args.layouts and not available():
        parser.error(
            f"--layouts kernel: the block-matmul kernel is unavailable: {unavailable_reason()}"
        )
    layouts = {name: weights(name) for name in args.layouts}
    megabytes = sum(w.size for w in next(iter(layouts.values()))) * 4 / 1e6
    print(f"CPU {cpu_model()}, jax {jax.__version__}, {megabytes:.0f} MB of weights")
    rng = np.random.default_rng(1)
    for rows in args.rows:
        h = jnp.asarray(rng.standard_normal((rows, D)).astype(np.float32))
        results = [chain(h, ws, name) for name, ws in layouts.items()]
        for other in results[1:]:  # the same products, summed in another order
            np.testing.assert_allclose(other, results[0], rtol=1e-4, atol=1e-5)
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for r in range(args.rounds):
            for name in list(layouts)[:: 1 if r % 2 else -1]:
                calls = []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    chain(h, layouts[name], name).block_until_ready()
                    calls.append(time.perf_counter() - start)
                times[name].append(1e3 * statistics.median(calls))
        line = ", ".join(
            f"{name} {' / '.join(f'{t:.1f}' for t in ts)} ms "
            f"({megabytes / statistics.median(ts):.0f} GB/s)"
            for name, ts in times.items()
        )
        print(f"M = {rows}: {line}", flush=True)


if __name__ == "__main__":
    main()
