"""Why two multi-device programs in flight at once can deadlock XLA:CPU, and what fixes it.

Each configuration runs in a child process (a deadlock aborts it after XLA's 40 s rendezvous
timeout): two threads each dispatch a jitted program with an all-reduce per loop iteration,
on 8 fake CPU devices, either over disjoint halves (4 + 4 devices) or both over all 8, with
the XLA:CPU client's thread pool sized by ``NPROC`` (default: ``max(cores, devices)``).

The cause (xla/pjrt/cpu/cpu_client.cc): the client runs each device's share of a
multi-device program as a task on one pool of ``max(DefaultThreadPoolSize(), devices)``
threads ("Need at least CpuDeviceCount threads to launch one collective"), and a share that
reaches a collective blocks its thread in a rendezvous until every share of *that* program
arrives. The client gang-schedules one collective launch at a time, but a second program's
shares already hold threads when the first's last share is still queued: with both
programs' shares blocked, no thread is left for it. Disjoint devices do not help (the pool
is shared); a pool of about twice the shares in flight does.

    python -m benchmarks.cpu_concurrency          # ~2-4 minutes on a 2-core VM

On the 2-core VM (8 devices, sync and async dispatch alike): 4 + 4 devices deadlock with the
default 8 threads and run with 16; 8 + 8 deadlock with 16 and 20 threads and run with 24.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

CASES = [("disjoint", None), ("disjoint", 16), ("overlap", 16), ("overlap", 32)]


def child(mode: str, iterations: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    halves = (devices[:4], devices[4:]) if mode == "disjoint" else (devices, devices)

    def program(devs, salt):
        mesh = Mesh(devs, ("d",))

        @jax.jit
        def f(x):
            for _ in range(20):
                x = x + salt * jnp.sum(x) / x.size  # an all-reduce every iteration
                x = jnp.tanh(x @ jnp.ones((x.shape[1], x.shape[1])) / x.shape[1])
            return x

        x = jax.device_put(jnp.ones((mesh.size * 64, 256)), NamedSharding(mesh, P("d")))
        f(x).block_until_ready()
        return f, x

    def loop(f, x):
        for _ in range(iterations):
            x = f(x)
        x.block_until_ready()

    programs = [program(devs, salt) for devs, salt in zip(halves, (1.0, 2.0), strict=True)]
    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=p) for p in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"ok {time.perf_counter() - start:.2f}s")


def main() -> None:
    print(f"{'devices':>10} {'NPROC':>7}  result")
    for mode, nproc in CASES:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("NPROC", None)
        if nproc is not None:
            env["NPROC"] = str(nproc)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.cpu_concurrency", "--child", mode, "200"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        ok = [ln for ln in proc.stdout.splitlines() if ln.startswith("ok")]
        result = ok[0] if ok else "deadlock (rendezvous timeout, process aborted)"
        shape = "4 + 4" if mode == "disjoint" else "8 + 8"
        print(f"{shape:>10} {nproc or 'default':>7}  {result}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
