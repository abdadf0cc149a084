"""Multi-process helpers: single-process behaviour and a real 2-process localhost run."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import model as M
from jaxrlhf.sharding import (
    MeshConfig,
    global_batch_from_local,
    initialize,
    is_main_process,
    make_mesh,
    process_local_slice,
)
from tests.sharding import multiprocess_worker as worker

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def test_initialize_single_process_is_noop_and_idempotent():
    initialize()
    initialize()
    assert not jax.distributed.is_initialized()
    assert jax.process_count() == 1
    assert is_main_process()


def test_global_batch_from_local_single_process():
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    tokens = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    mask = tokens % 2 == 0
    spec = P(("data", "fsdp"), None)
    out = global_batch_from_local({"tokens": tokens, "mask": mask}, mesh, spec)
    assert out["tokens"].sharding.spec == spec
    np.testing.assert_array_equal(np.asarray(out["tokens"]), tokens)
    np.testing.assert_array_equal(np.asarray(out["mask"]), mask)

    specs = {"tokens": spec, "mask": P("data", None)}
    out = global_batch_from_local({"tokens": tokens, "mask": mask}, mesh, specs)
    assert out["mask"].sharding.spec == P("data", None)
    np.testing.assert_array_equal(np.asarray(out["mask"]), mask)

    assert process_local_slice(mesh, spec, (8, 3)) == (slice(0, 8), slice(0, 3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(args: list[list[str]], log_dir: Path, timeout_s: float) -> list[str]:
    """Runs the worker once per argument list; returns each process's output.

    Fails the test when a process exits non-zero or the run exceeds ``timeout_s``. As
    soon as one process fails the others are killed: a process whose peer died would
    otherwise block in a collective until the distributed runtime's heartbeat timeout
    (minutes). Output goes to files, so a chatty process can never stall on a full pipe.
    """
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log_paths = [log_dir / f"process_{i}.log" for i in range(len(args))]
    procs = []
    for a, log_path in zip(args, log_paths, strict=True):
        with open(log_path, "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, worker.__file__, *a],
                    env=env,
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout_s
    hung = False
    while True:
        codes = [p.poll() for p in procs]  # poll every process: no short-circuit
        if None not in codes:
            break
        failed = any(c not in (None, 0) for c in codes)
        hung = time.monotonic() > deadline
        if failed or hung:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    logs = [path.read_text() for path in log_paths]
    if hung:
        pytest.fail(f"multi-process run hung for {timeout_s} s:\n" + "\n---\n".join(logs))
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.returncode != 0:
            pytest.fail(f"process {i} exited with {p.returncode}:\n{log[-4000:]}")
    return logs


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 4, 1), (1, 8, 1)])
def test_two_processes_match_one(tmp_path, mesh_shape):
    port = _free_port()
    outs = [tmp_path / f"process_{i}.npz" for i in range(worker.NUM_PROCESSES)]
    _run_workers(
        [[str(port), str(i), str(out), *map(str, mesh_shape)] for i, out in enumerate(outs)],
        tmp_path,
        TIMEOUT_S,
    )

    data, fsdp, tensor = mesh_shape  # the same mesh shape on this process's 8 devices
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    expected = worker.compute(mesh, worker.make_batch())
    # Independent reference: the same model unsharded on one device.
    cfg = worker.model_config()
    batch = worker.make_batch()
    params = M.init_params(cfg, jax.random.key(worker.SEED))
    single = np.asarray(M.forward(M.build(cfg), params, batch["tokens"], batch["mask"]))
    mask = batch["mask"]
    # fp32, different reduction order across shardings: 1e-4 (the model tolerance).
    np.testing.assert_allclose(expected["logits"][mask], single[mask], atol=1e-4, rtol=0)

    for i, out in enumerate(outs):
        got = np.load(out)
        assert int(got["process_index"]) == i
        assert got["logits"].shape == (worker.B, worker.T, cfg.vocab_size)
        np.testing.assert_allclose(got["logits"][mask], expected["logits"][mask], atol=1e-4, rtol=0)
        np.testing.assert_allclose(got["loss"], expected["loss"], atol=1e-5, rtol=0)
