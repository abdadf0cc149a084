"""XLA:CPU compile and run time of the test suite's typical programs under sets of XLA
flags: the jitted forward (mean log-prob of one token) and one AdamW train step of three
tiny model families (2 layers, width 32: ``ModelConfig.tiny``, the tests' size), each flag
set in a fresh process with no compilation cache, the sets alternating round by round.
Seconds of compile summed over the six programs (median over rounds), and milliseconds of
the first run of each train step (summed).

The test suite compiles with ``tests/compile_flags.py``'s flags; this measures why.

    python benchmarks/compile_flags.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("llama", "mixtral", "gemma2")
FLAG_SETS = {
    "defaults": "",
    "O0": "--xla_backend_optimization_level=0",
    "loop emitters": "--xla_cpu_use_fusion_emitters=false",
    "O0 + loop emitters": (
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    ),
}


def measure() -> dict[str, float]:
    """In this process (its XLA_FLAGS): compile seconds and train-step milliseconds."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxrlhf.models import model as M
    from jaxrlhf.models.config import ModelConfig

    compile_s = step_ms = 0.0
    for family in FAMILIES:
        cfg = ModelConfig.tiny(family)
        module = M.build(cfg)
        params = M.init_params(cfg, jax.random.key(0))
        tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, 128)
        mask = jnp.arange(24)[None] < jnp.array([[24], [20], [13], [7]])
        opt = optax.adamw(1e-3)

        def loss(p, module=module, tokens=tokens, mask=mask):
            logits = M.forward(module, p, tokens, mask)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * mask)

        def step(p, s, loss=loss, opt=opt):
            g = jax.grad(loss)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        for fn, args in ((loss, (params,)), (step, (params, opt.init(params)))):
            t = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            compile_s += time.perf_counter() - t
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            if fn is step:
                step_ms += 1e3 * (time.perf_counter() - t)
    return {"compile_s": compile_s, "step_ms": step_ms}


def run_in_process(flags: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    from benchmarks.generate import cpu_model

    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in FLAG_SETS}
    for r in range(args.rounds):
        for name, flags in FLAG_SETS.items():
            results[name].append(run_in_process(flags))
            got = results[name][-1]
            print(
                f"round {r + 1} {name:>20}: compile {got['compile_s']:.2f} s, "
                f"train steps {got['step_ms']:.0f} ms",
                flush=True,
            )
    base = statistics.median(x["compile_s"] for x in results["defaults"])
    print("\nmedian over rounds: flags | compile s | vs defaults | train steps ms")
    for name, runs in results.items():
        c = statistics.median(x["compile_s"] for x in runs)
        s = statistics.median(x["step_ms"] for x in runs)
        print(f"{name:>20} | {c:6.2f} | {base / c:4.2f}x | {s:5.0f}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
