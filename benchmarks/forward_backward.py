"""One training forward+backward, jaxrlhf vs transformers, with the kernel time it costs.

bench-S (or bench-M) on [32, 128] random tokens, unpacked; loss = mean log-prob of the last 64
tokens, the shape of R1's update without the RL terms. For each framework: median wall
milliseconds per call over ``--reps`` calls after a warm-up, and per call the process's user
and kernel (system) CPU milliseconds and minor page faults (``getrusage``). The kernel time is
where XLA:CPU's per-execution temporary buffer shows (benchmarks/RESULTS.md, "Why the
update loses per token"). Like ``python -m jaxrlhf.train`` on CPU, it first applies
``jaxrlhf.platform.reuse_freed_host_memory``; ``JAXRLHF_HOST_MEMORY=system`` leaves glibc's
and JAX's defaults, to compare::

    python benchmarks/forward_backward.py
    JAXRLHF_HOST_MEMORY=system python benchmarks/forward_backward.py
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import platform as jaxrlhf_platform  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402
from jaxrlhf.models.config import ModelConfig  # noqa: E402

MODELS = {"bench-s": ModelConfig.bench_s, "bench-m": ModelConfig.bench_m}
BATCH, LENGTH, RESPONSE = 32, 128, 64
MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def measure(fn: Callable[[], None], reps: int) -> dict[str, float]:
    """Median wall ms per call, and mean user ms, system ms and minor faults per call."""
    fn()  # warm-up (compiles)
    walls = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_ms": float(np.median(walls)) * 1e3,
        "user_ms": (after.ru_utime - before.ru_utime) / reps * 1e3,
        "sys_ms": (after.ru_stime - before.ru_stime) / reps * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bench-s", choices=sorted(MODELS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    host = jaxrlhf_platform.reuse_freed_host_memory()  # as `python -m jaxrlhf.train` on CPU

    import torch
    import transformers

    from benchmarks.pytorch_rl import hf_causal_lm

    cfg = MODELS[args.model]()
    params = model_lib.init_params(cfg, jax.random.key(0))
    module = model_lib.build(cfg)
    tokens = np.random.default_rng(0).integers(4, cfg.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    start = LENGTH - RESPONSE

    def loss(p, tokens, mask):
        logits = model_lib.forward(module, p, tokens, mask)[:, start - 1 : -1]
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logprobs, tokens[:, start:, None], axis=-1).mean()

    grad = jax.jit(jax.grad(loss))
    tokens_j, mask_j = jnp.asarray(tokens), jnp.ones(tokens.shape, bool)

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    hf = hf_causal_lm(cfg, params)
    tokens_t = torch.from_numpy(tokens).long()

    def torch_step() -> None:
        logits = hf(input_ids=tokens_t).logits[:, start - 1 : -1]
        logprobs = torch.log_softmax(logits, dim=-1)
        logprobs.gather(-1, tokens_t[:, start:, None]).mean().backward()
        hf.zero_grad(set_to_none=True)

    env = " ".join(f"{k}={os.environ[k]}" for k in MALLOC_ENV if k in os.environ)
    print(
        f"# {args.model}, [{BATCH}, {LENGTH}] tokens, fwd+bwd; host memory reuse: "
        f"{host or 'on'}; malloc env: {env or 'default'}"
    )
    print("| framework | wall ms | user ms | system ms | minor faults |")
    print("|---|---|---|---|---|")
    for name, fn in (
        ("jaxrlhf", lambda: jax.block_until_ready(grad(params, tokens_j, mask_j))),
        ("transformers", torch_step),
    ):
        r = measure(fn, args.reps)
        print(
            f"| {name} | {r['wall_ms']:.0f} | {r['user_ms']:.0f} | {r['sys_ms']:.0f} "
            f"| {r['faults']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
