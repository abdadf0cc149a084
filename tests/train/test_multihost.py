"""Multi-host training: 2 processes x 4 CPU devices equal 1 process x 8 devices.

Each case starts two localhost processes (``multihost_worker.py``: ``jax.distributed`` with
gloo CPU collectives, 4 fake devices each) that train a tiny model for a few iterations
through the CLI's entry points (``run_rl`` for GRPO and PPO, ``loop.run`` for SFT) on a
(data 2, fsdp 4) mesh whose data axis spans both processes. The test process then runs the
same function on its own 8 devices with the same mesh, and compares per-iteration metrics
and the final parameters.

Tolerances (float32). The two runs compile the same sharded programs, but the gloo
all-reduces between processes sum in a different order than XLA's in-process ones, so the
runs are not bitwise equal: the first iteration's entropy (~4.7) already differs by one ulp.
Measured: metrics differ by <= 6e-7 (entropy, ratios, KL, losses, grad norm; SFT's are
bitwise equal). Params after 3 Adam updates at lr 1e-3: Adam's update lr * g / (|g| + eps)
moves by up to lr / eps per unit of gradient rounding where g is near 0, so with the default
eps = 1e-8 one GRPO k_kernel entry of 1024 differed by 6.6e-5 on an AMD EPYC Zen 4 VM (7e-6
on earlier VMs). The runs use eps = 1e-6: params then differ by <= 4e-8 (GRPO's LM head;
PPO and SFT <= 2e-8). We allow 1e-5 on metrics and 2e-5 on params, 50x below one update.
The sampled tokens are the same (rounding does not flip a token here), so the rollout's
metrics (rewards, lengths) and the learning rate must match exactly, and both processes must
return bitwise the same values (every host-side value is computed from the same all-gathered
arrays).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train import multihost_worker as worker

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
# The 2-process run of a case takes 20-40 s on an idle 2-core machine, 2-3x that on a busy one.
TIMEOUT_S = 300
METRIC_ATOL, PARAM_ATOL = 1e-5, 2e-5
# Computed on the host from the sampled tokens (or set by the config): exactly equal.
EXACT_PREFIXES = ("reward/", "response/", "reshard/", "lr", "kl/coef", "step", "epoch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(
    args: list[list[str]],
    log_dir: Path,
    timeout_s: float,
    *,
    program: list[str] | None = None,
    envs: list[dict[str, str]] | None = None,
) -> None:
    """Runs ``multihost_worker.py`` once per argument list, all at once.

    Fails the test when a process exits non-zero or the run exceeds ``timeout_s``, showing
    the end of every process's output (the first to fail has the cause). As soon as one
    process fails the others are killed: a process whose peer died would otherwise block in
    a collective until the distributed runtime's heartbeat timeout (minutes). Output goes
    to files, so a chatty process can never stall on a full pipe.
    """
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log_paths = [log_dir / f"process_{i}.log" for i in range(len(args))]
    program = program or [sys.executable, worker.__file__]
    procs = []
    for i, (a, log_path) in enumerate(zip(args, log_paths, strict=True)):
        with open(log_path, "w") as log:
            procs.append(
                subprocess.Popen(
                    [*program, *a],
                    env={**env, **(envs[i] if envs else {})},
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout_s
    hung = False
    try:
        while True:
            codes = [p.poll() for p in procs]  # poll every process (no short-circuit)
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            hung = time.monotonic() > deadline
            if hung:
                break
            time.sleep(0.2)
    finally:  # also on KeyboardInterrupt: never leave a worker behind
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    logs = "\n".join(
        f"--- process {i} (exit code {p.returncode}) ---\n{path.read_text()[-5000:]}"
        for i, (p, path) in enumerate(zip(procs, log_paths, strict=True))
    )
    if hung:
        pytest.fail(f"multi-process run hung for {timeout_s} s:\n{logs}")
    if any(p.returncode != 0 for p in procs):
        pytest.fail(f"a worker process failed:\n{logs}")


def _assert_same_run(got: dict, want: dict, label: str) -> None:
    assert sorted(got) == sorted(want), label
    for key, expected in want.items():
        msg = f"{label}: {key}"
        if key.startswith("meta/"):
            continue
        if key.startswith("metric/"):
            name = key.removeprefix("metric/")
            if name.startswith(EXACT_PREFIXES):
                np.testing.assert_array_equal(got[key], expected, err_msg=msg)
            else:
                np.testing.assert_allclose(
                    got[key], expected, atol=METRIC_ATOL, rtol=0, err_msg=msg
                )
        else:
            assert got[key].shape == expected.shape, msg
            np.testing.assert_allclose(got[key], expected, atol=PARAM_ATOL, rtol=0, err_msg=msg)


# Two processes split batches, parameters and the checkpoint the same way for every
# algorithm: PPO (four models: policy, critic, reference, reward model, colocated) and GRPO
# with the sampler on its own devices (the weight sync between process groups) cover it.
@pytest.mark.parametrize("algorithm", ["ppo", "grpo_separated"])
def test_two_processes_train_like_one(algorithm, tmp_path):
    """``grpo_separated``: the sampler and the learner on their own device groups, each two
    devices of each process (the weight sync goes through the hosts), at staleness 0."""
    port = _free_port()
    run_dir = tmp_path / "run"
    outs = [tmp_path / f"process_{i}.npz" for i in range(worker.NUM_PROCESSES)]
    _run_workers(
        [
            [str(port), str(i), str(worker.NUM_PROCESSES), algorithm, str(run_dir), str(out)]
            for i, out in enumerate(outs)
        ],
        tmp_path,
        TIMEOUT_S,
    )
    results = []
    for i, out in enumerate(outs):
        with np.load(out) as f:
            results.append(dict(f))
        assert int(results[i].pop("process_index")) == i
    # The trained params really were sharded across the two processes.
    assert int(results[0]["meta/cross_process_leaves"]) > 0

    # Both processes hold the same (all-gathered) values, bit for bit.
    for key in results[0]:
        np.testing.assert_array_equal(results[1][key], results[0][key], err_msg=key)

    # The single-process reference: this process's 8 devices, the same mesh.
    expected = worker.run(algorithm, str(tmp_path / "single"))
    assert int(expected["meta/cross_process_leaves"]) == 0
    _assert_same_run(results[0], expected, f"{algorithm}, 2 processes vs 1")

    # Process 0 wrote the run's files once: one metrics row per iteration, the export and
    # the final checkpoint.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if not any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in rows] == list(range(1, worker.STEPS + 1))
    for key, values in results[0].items():
        if key.startswith("metric/") and not key.startswith("metric/eval/"):
            logged = [r[key.removeprefix("metric/")] for r in rows]
            np.testing.assert_array_equal(logged, values, err_msg=key)
    assert (run_dir / "hf" / "config.json").is_file()
    assert (run_dir / "checkpoints" / str(worker.STEPS)).is_dir()


def test_cli_two_processes_train_then_resume(tmp_path):
    """``python -m jaxrlhf.train`` started twice with JAX_NUM_PROCESSES / JAX_PROCESS_ID
    joins one job: it trains 2 steps and checkpoints, then a second launch resumes (each
    process restoring its shards) to step 4. Losses match one process on 8 devices (1e-5,
    see the module docstring)."""
    from jaxrlhf.train import loop
    from tests.train.helpers import config, mesh

    run_dir = tmp_path / "run"
    args = [
        "logging.progress=none",
        "logging.plot=false",
        "checkpoint.export_hf=false",
        "train.log_every=1",
        "train.eval_every=0",
        "data.eval_size=32",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "mesh.data=2",
        "mesh.fsdp=4",
    ]
    cli = [sys.executable, "-m", "jaxrlhf.train", "--config", "configs/tiny_sft.yaml"]
    for steps in (2, 4):
        port = _free_port()
        envs = [
            {
                "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            }
            for i in range(2)
        ]
        argv = [f"output_dir={run_dir}", f"train.steps={steps}", *args]
        _run_workers([argv, argv], tmp_path, TIMEOUT_S, program=cli, envs=envs)
        assert (run_dir / "checkpoints" / str(steps)).is_dir()
    log = (tmp_path / "process_0.log").read_text()
    assert "resumed from" in log, log[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    got = [(r["step"], r["loss/sft"]) for r in rows if "loss/sft" in r]

    one = config("tiny_sft", tmp_path / "one", *args, "train.steps=4")
    want = loop.run(one, mesh=mesh(2, 4, 1))
    expected = want.rows("loss/sft")
    assert [s for s, _ in got] == [s for s, _ in expected] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in expected], atol=METRIC_ATOL)
