"""Does the default tier catch a broken package? One small, plausible bug per package of
``jaxrlhf/`` (a sign in a loss, a transpose in attention, an off-by-one in the engine's
admission, a dropped key in the config loader, a wrong shard in a rule table, ...), each
applied alone to the source, then the default tier run until its first failure.

    python tests/mutation_check.py                 # every mutation
    python tests/mutation_check.py losses config   # some of them, by name

The mutations apply to a git worktree of HEAD (the working tree is never touched). For
each, the default tier's tests of the mutated package run with ``-x`` (stop at the first
failure), and only if they all pass the whole default tier (a bug may show elsewhere); the
line printed names the first failing test. A mutation the tier survives, or that runs into
the time limit, is reported as not caught and the script exits 1. Not a test (``pytest``
does not collect it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
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
        "tasks",
        "jaxrlhf/data/tasks.py",
        "    return 0.7 * positional + 0.3 * overlap\n",
        "    return 0.3 * positional + 0.7 * overlap\n",
        "tests/test_rewards.py",
        "the sort task's partial credit weights swapped",
    ),
    Mutation(
        "rewards",
        "jaxrlhf/rewards/shaping.py",
        "    over = np.clip((lengths - (max_new_tokens - buffer)) / buffer, 0.0, 1.0)\n",
        "    over = np.clip((lengths - (max_new_tokens - buffer) + 1) / buffer, 0.0, 1.0)\n",
        "tests/test_rewards.py",
        "DAPO's overlong penalty starts one token early",
    ),
    Mutation(
        "kernels",
        "jaxrlhf/kernels/decode_attention.py",
        "    return jax.ffi.ffi_call(TARGET, shape)(q, k, v, ok, scale=np.float32(scale))\n",
        "    return jax.ffi.ffi_call(TARGET, shape)(q, k, v, ok, scale=np.float32(scale / 2))\n",
        "tests/kernels",
        "the CPU decode-attention kernel gets half the softmax scale",
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


def run_tests(where: Path, paths: list[str], timeout: float) -> tuple[str, int]:
    """Runs the default tier's tests under ``paths`` with ``-x`` in the checkout ``where``;
    returns (the first failing test, or "" when all passed / "TIMEOUT", pytest's exit)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *paths]
    env = {k: v for k, v in os.environ.items() if k != "JAXRLHF_RUN_SLOW"}
    env["PYTHONPATH"] = str(where)  # this checkout's jaxrlhf, not the installed one
    proc = subprocess.Popen(
        cmd,
        cwd=where,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout kills pytest-xdist's workers too
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "TIMEOUT", -1
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if proc.returncode == 0:
        return "", 0
    return (
        failed[0] if failed else f"pytest exit {proc.returncode}: {out[-300:]!r}"
    ), proc.returncode


def judge(mutation: Mutation, where: Path, timeout: float) -> tuple[str, bool, float]:
    """The package's own tests first; the whole default tier only if they all pass.
    Returns (verdict, caught, seconds)."""
    start = time.perf_counter()
    for paths in ([mutation.tests], ["tests"]):
        first, code = run_tests(where, paths, timeout)
        if first == "TIMEOUT":
            return f"TIMEOUT in {' '.join(paths)}: not caught", False, time.perf_counter() - start
        if code != 0:
            return f"caught by {first}", True, time.perf_counter() - start
    return "SURVIVED: the default tier passed", False, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"of {[m.name for m in MUTATIONS]}")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations {sorted(unknown)}")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    with tempfile.TemporaryDirectory(prefix="jaxrlhf-mutation-") as tmp:
        where = Path(tmp) / "checkout"  # HEAD, apart from the working tree
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(where), "HEAD"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            for m in chosen:  # all apply before any run
                count = (where / m.path).read_text().count(m.old)
                if count != 1:
                    parser.error(f"{m.name}: the line to mutate occurs {count} times in {m.path}")
            missed = 0
            for m in chosen:
                path = where / m.path
                source = path.read_text()
                try:
                    path.write_text(source.replace(m.old, m.new))
                    verdict, caught, took = judge(m, where, args.timeout)
                finally:
                    path.write_text(source)
                missed += not caught
                print(
                    f"{m.name:<11} {m.path}: {m.what}\n{'':<11} {verdict} ({took:.0f} s)",
                    flush=True,
                )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(where)],
                cwd=ROOT,
                check=False,
                capture_output=True,
            )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
