"""One process of the multi-host trainer test (``test_multihost.py``).

Run as ``python tests/train/multihost_worker.py PORT PROCESS_ID NUM_PROCESSES ALGORITHM
RUN_DIR OUT.npz`` with ``JAX_PLATFORMS=cpu`` and the repo root on ``PYTHONPATH``. With
``NUM_PROCESSES = 2`` each process gets 4 CPU devices (8 global devices, gloo collectives);
with 1 it gets all 8 devices itself. The test also imports ``run`` and calls it in its own
8-device process as the single-process reference.

``run`` trains a tiny model for a few iterations of ``ALGORITHM`` (``grpo``, ``ppo``,
``sft``, ``ilql`` or ``grpo_separated``) on the built-in sort task through the same entry
points as the CLI (``run_rl`` / ``loop.run``) and returns what the test compares: the
per-iteration metrics and the final parameters, as numpy, identical on every process.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import jax
import numpy as np

from jaxrlhf.config import RunConfig, from_dict, validate
from jaxrlhf.sharding import distributed

NUM_PROCESSES = 2
DEVICES = 8  # in all, split evenly over the processes
MESH = {"data": 2, "fsdp": 4, "tensor": 1}  # the data axis spans both processes
STEPS = 3
# Wall-clock and throughput metrics differ from run to run; everything else must match.
NONDETERMINISTIC_PREFIXES = ("time/", "throughput/")


def config(algorithm: str, run_dir: str) -> RunConfig:
    """A tiny ``algorithm`` run on ``builtin:sort``: tiny model, 16 rows, few tokens."""
    raw: dict[str, Any] = {
        "algorithm": algorithm,
        "output_dir": run_dir,
        "mesh": MESH,
        "model": {"preset": "tiny", "initializer_range": 0.1},
        "data": {
            "train": "builtin:sort",
            "max_length": 32,
            "max_prompt_length": 16,
            "builtin_size": 64,
            "eval_size": 0,
        },
        "optimizer": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "eps": 1e-6},
        "train": {"steps": STEPS, "seed": 0, "log_every": 1},
        "logging": {"progress": "none", "plot": False},
    }
    if algorithm in ("sft", "ilql"):
        raw["train"].update(batch_size=16, micro_batch_size=1)
    if algorithm == "ilql":  # and its sampled evaluation of held-out prompts
        raw["data"]["eval_size"] = 16
        raw["ilql"] = {"eval_reward": "builtin", "max_new_tokens": 4}
    elif algorithm != "sft":
        raw[algorithm] = {
            "rollout": {"prompts_per_step": 8, "num_samples": 2, "max_new_tokens": 6},
            "loss": {"num_minibatches": 2},
        }
    if algorithm == "grpo_separated":  # each group on two devices of each process
        raw["algorithm"] = "grpo"
        raw["grpo"] = raw.pop(algorithm)
        raw["placement"] = {
            "strategy": "separated",
            "sampler": {"devices": [0, 1, 4, 5], "mesh": {"data": 4, "fsdp": 1, "tensor": 1}},
            "learner": {"devices": [2, 3, 6, 7]},
        }
        raw["mesh"] = {"data": 2, "fsdp": 2, "tensor": 1}  # the learner's
    cfg = from_dict(raw, source=f"multihost_worker:{algorithm}")
    validate(cfg, DEVICES)
    return cfg


def run(algorithm: str, run_dir: str) -> dict[str, np.ndarray]:
    """Runs ``algorithm`` for ``STEPS`` iterations through ``loop.run``.

    Returns:
      ``{"metric/<key>": [STEPS] float64, "params/<role>/<path>": array,
      "meta/cross_process_leaves": []}`` as numpy, the same on every process. The last
      counts the trained params that are sharded (not fully replicated) and span the
      devices of several processes (0 with one process): with ``MESH`` each process holds
      one ``data`` row, so the gradients are all-reduced across processes.
    """
    from jaxrlhf.train import loop

    result = loop.run(config(algorithm, run_dir))
    if algorithm in ("sft", "ilql"):
        params = {"policy": result.trainer.state.params}
    else:
        params = {"policy": result.trainer.policy_state.params}
        if result.trainer.value_state is not None:
            params["value"] = result.trainer.value_state.params
    first = next(row for row in result.history if not any(k.startswith("eval/") for k in row))
    history = [row for row in result.history if not any(k.startswith("eval/") for k in row)]
    keys = sorted(
        k
        for k, v in first.items()
        if isinstance(v, (int, float)) and not k.startswith(NONDETERMINISTIC_PREFIXES)
    )
    out = {f"metric/{k}": np.asarray([row[k] for row in history], np.float64) for k in keys}
    evals = [row for row in result.history if "eval/reward" in row]  # ILQL's decoding
    if evals:
        out["metric/eval/reward"] = np.asarray([row["eval/reward"] for row in evals])
    leaves = jax.tree.leaves(params)
    out["meta/cross_process_leaves"] = np.asarray(
        sum(not (x.is_fully_addressable or x.is_fully_replicated) for x in leaves)
    )
    host = distributed.to_host(params)  # all-gathers across processes: all must call it
    for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
        out["params/" + jax.tree_util.keystr(path, simple=True, separator="/")] = leaf
    return out


def main(argv: list[str]) -> None:
    port, process_id, num_processes = (int(a) for a in argv[:3])
    algorithm, run_dir, out_path = argv[3:6]
    # Before anything initialises the backend: 8 devices in all, split over the processes.
    jax.config.update("jax_num_cpu_devices", DEVICES // num_processes)
    if num_processes > 1:
        distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=num_processes,
            process_id=process_id,
        )
    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.device_count() == DEVICES, jax.device_count()
    out = run(algorithm, run_dir)
    # Every process writes its own result file (the run directory is process 0's alone).
    np.savez(out_path, process_index=jax.process_index(), **out)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Exit now: a normal exit runs jax.distributed's shutdown barrier, which waits for
        # the peers, and they wait for this process in their next collective (until the
        # runtime's timeouts, minutes). The test kills the peers once one process fails.
        os._exit(1)
