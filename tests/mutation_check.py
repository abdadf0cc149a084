"""Does the default tier catch a broken package? One small, plausible bug per package of
``jaxrlhf/`` (a sign in a loss, a transpose in attention, an off-by-one in the engine's
admission, a dropped key in the config loader, a wrong shard in a rule table, ...), each
applied alone to the source, then the default tier run until its first failure.

    python tests/mutation_check.py                 # every mutation
    python tests/mutation_check.py losses config   # some of them, by name

For each mutation the default tier runs with ``-x`` (stop at the first failure), the
mutated package's own tests first (then the rest of the tier: a bug may only show
elsewhere); the line printed names the first failing test. A mutation the tier survives is
reported as ``SURVIVED`` and the script exits 1. The source is restored after each run,
also when the run is interrupted. Not a test (``pytest`` does not collect it): each
mutation costs a run of the tier up to its first failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (which must occur exactly once in ``path``) with ``new``."""

    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: str  # the package's own tests, run first
    what: str


MUTATIONS = (
    Mutation(
        "losses",
        "jaxrlhf/losses/ppo.py",
        "    pg1 = -adv * ratio\n",
        "    pg1 = adv * ratio\n",
        "tests/losses",
        "a sign in the PPO surrogate",
    ),
    Mutation(
        "models",
        "jaxrlhf/models/attention.py",
        "    k = k.transpose(0, 2, 1, 3)  # [B, K, S, H]\n",
        "    k = k.transpose(0, 2, 1, 3)[..., ::-1]  # [B, K, S, H]\n",
        "tests/models",
        "the keys' head dim reversed before q.k in XLA attention",
    ),
    Mutation(
        "generation",
        "jaxrlhf/generation/engine_run.py",
        "        rows = (index[:, None] * self.n + np.arange(self.n)).reshape(-1)\n",
        "        rows = (index[:, None] * self.n + np.arange(1, self.n + 1)).reshape(-1)\n",
        "tests/generation",
        "an off-by-one in the rows the engine admits",
    ),
    Mutation(
        "config",
        "jaxrlhf/config.py",
        "    for key, value in data.items():\n        if key not in fields:\n",
        "    for key, value in list(data.items())[:-1]:\n        if key not in fields:\n",
        "tests/test_config.py",
        "the loader drops the last key of every section",
    ),
    Mutation(
        "sharding",
        "jaxrlhf/sharding/rules.py",
        '        (ax.EMBED, "fsdp"),\n',
        '        (ax.EMBED, "tensor"),\n',
        "tests/sharding",
        "the training rules shard the model width over tensor instead of fsdp",
    ),
    Mutation(
        "data",
        "jaxrlhf/data/dataset.py",
        "                response_mask[row, j, p:end] = True\n",
        "                response_mask[row, j, p - 1 : end] = True\n",
        "tests/data",
        "the response mask starts one token early (on the prompt's last token)",
    ),
    Mutation(
        "rewards",
        "jaxrlhf/data/tasks.py",
        "    return 0.7 * positional + 0.3 * overlap\n",
        "    return 0.3 * positional + 0.7 * overlap\n",
        "tests/test_rewards.py",
        "the sort task's partial credit weights swapped",
    ),
    Mutation(
        "plan",
        "jaxrlhf/plan/estimate.py",
        '    itemsize = 2 if model.param_dtype in ("bfloat16", "float16") else 4\n',
        '    itemsize = 2 if model.param_dtype in ("bfloat16", "float16") else 2\n',
        "tests/plan",
        "the cost model counts float32 weights at 2 bytes",
    ),
    Mutation(
        "train",
        "jaxrlhf/train/steps.py",
        "    weights = weights / jnp.maximum(weights.sum(), 1.0)\n",
        "    weights = weights / jnp.maximum(weights.sum(), 1.0) * num_micro\n",
        "tests/train",
        "gradient accumulation sums the micro-batches' gradients instead of averaging",
    ),
    Mutation(
        "advantages",
        "jaxrlhf/losses/advantages.py",
        "    centred = g - jnp.mean(g, axis=-1, keepdims=True)\n",
        "    centred = g - jnp.mean(g, axis=0, keepdims=True)\n",
        "tests/losses",
        "GRPO's group mean taken over the groups, not within each group",
    ),
)


def run_tier(mutation: Mutation, timeout: float) -> tuple[str, float]:
    """Runs the default tier with ``-x``; returns (verdict line, seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    cmd += [mutation.tests, "tests"]
    env = {k: v for k, v in os.environ.items() if k != "JAXRLHF_RUN_SLOW"}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "TIMEOUT (neither failed nor passed)", time.perf_counter() - start
    took = time.perf_counter() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    if done.returncode == 0:
        return "SURVIVED: the default tier passed", took
    if failed:
        return f"caught by {failed[0]}", took
    return f"caught: pytest exit {done.returncode}\n{done.stdout[-1500:]}", took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"of {[m.name for m in MUTATIONS]}")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations {sorted(unknown)}")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    for m in chosen:  # all apply before any run
        count = (ROOT / m.path).read_text().count(m.old)
        if count != 1:
            parser.error(f"{m.name}: the line to mutate occurs {count} times in {m.path}")
    survived = 0
    for m in chosen:
        path = ROOT / m.path
        source = path.read_text()
        try:
            path.write_text(source.replace(m.old, m.new))
            verdict, took = run_tier(m, args.timeout)
        finally:
            path.write_text(source)
        survived += verdict.startswith("SURVIVED")
        print(f"{m.name:<11} {m.path}: {m.what}\n{'':<11} {verdict} ({took:.0f} s)", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
