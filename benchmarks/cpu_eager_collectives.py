"""Eager ops on arrays sharded over 8 CPU devices while the host's cores are busy: does
XLA:CPU's collective rendezvous abort the process? (tests/conftest.py sizes the client's
thread pool, NPROC, from what this shows.)

A loss with reductions (``losses.aot_unpaired_loss``: its means are all-reduces over the 8
devices) is called eagerly in a loop for ``--seconds`` while ``--busy`` processes spin on
the cores. Each try runs in a fresh process (the pool size is read when JAX starts) and
reports ``ok N calls`` or the abort (XLA's rendezvous "Termination timeout", exit 134).

    python benchmarks/cpu_eager_collectives.py --nproc 8 16 --seconds 150 --busy 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = r"""
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrlhf.losses.preference_variants import aot_unpaired_loss
rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
rng = np.random.default_rng(0)
logps = [jax.device_put(jnp.asarray(rng.normal(size=16) - 50, jnp.float32), rows) for _ in range(4)]
mask = jax.device_put(jnp.ones(16, bool), rows)
start, calls = time.time(), 0
while time.time() - start < float(sys.argv[1]):
    loss, _ = aot_unpaired_loss(*logps, beta=0.5, pair_mask=mask)
    calls += 1
    if calls % 50 == 0:
        jax.block_until_ready(loss)
print(f"ok {calls} calls")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside it")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for nproc in args.nproc:
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
        ]
        env = {**os.environ, "NPROC": str(nproc), "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
        start = time.perf_counter()
        try:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.seconds)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
        finally:
            for p in spinners:
                p.kill()
        took = time.perf_counter() - start
        lines = (
            out.stdout.strip().splitlines()
            + [line for line in out.stderr.splitlines() if "Termination timeout" in line][:1]
        )
        verdict = lines[0][:160] if lines else "(no output)"
        print(f"NPROC={nproc}: exit {out.returncode} after {took:.0f} s: {verdict}", flush=True)


if __name__ == "__main__":
    main()
