"""Checkpoints, exact resume, preemption and the non-finite update guard.

Equality claims and their tolerances:
- Killed (SIGKILL) and resumed on the same 8-device mesh == uninterrupted: bitwise (same
  programs on the same inputs; the killed part runs in a subprocess with 8 forced host
  devices, which compiles the same XLA:CPU programs as this process).
- Resumed on another mesh: 1e-5 absolute on parameters and logged losses (float32 sums
  reduced in another order across shards; the tiny model's updates are ~1e-3).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxrlhf.train import loop, steps
from jaxrlhf.train.__main__ import main as cli_main
from jaxrlhf.train.checkpointing import RunCheckpointer
from jaxrlhf.train.config import CheckpointConfig
from jaxrlhf.train.preemption import TrainingDiverged
from jaxrlhf.train.supervised import SupervisedTrainer
from tests.train.helpers import CONFIGS, config, mesh

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SFT = os.path.join(CONFIGS, "tiny_sft.yaml")
# A constant learning rate: runs of different lengths share their first steps exactly.
SFT_ARGS = (
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    "train.log_every=1",
    "train.eval_every=0",
    "data.eval_size=32",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT
    return env


def _cli(config_path: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxrlhf.train", "--config", config_path, *overrides],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _committed_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _untimed(history):
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
        for row in history
    ]


def _assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ---- exact resume after SIGKILL ------------------------------------------------------------


@pytest.mark.slow
def test_sft_killed_then_resumed_equals_uninterrupted(tmp_path):
    args = (*SFT_ARGS, "train.steps=20", "checkpoint.every=3", "logging.progress=none")
    ref = loop.run(config("tiny_sft", tmp_path / "ref", *args))

    run_dir = str(tmp_path / "killed")
    proc = _cli(SFT, f"output_dir={run_dir}", *args)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    _wait_for(lambda: _committed_steps(ckpt_dir), proc, "the first checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = _committed_steps(ckpt_dir)[-1]
    assert 0 < killed_at < 20, killed_at

    resumed = loop.run(config("tiny_sft", run_dir, *args))
    assert resumed.history[0]["step"] == 0  # the first run's rows were kept...
    assert _untimed(resumed.history) == _untimed(ref.history)  # ...and the rest are equal
    _assert_trees_equal(resumed.trainer.state, ref.trainer.state)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [r["step"] for r in ref.history]


def _ppo_config(tmp_path, name="ppo.yaml", **extra) -> str:
    raw = {
        "algorithm": "ppo",
        "model": {"preset": "tiny", "initializer_range": 0.1},
        "data": {
            "train": "builtin:sort",
            "max_length": 32,
            "max_prompt_length": 16,
            "builtin_size": 256,
            "eval_size": 0,
        },
        "optimizer": {"lr": 1e-3, "schedule": "constant"},
        "train": {"steps": 6, "log_every": 1},
        "logging": {"progress": "none", "plot": False},
        "checkpoint": {"every": 2, "export_hf": False},
        "ppo": {
            "rollout": {"prompts_per_step": 16, "max_new_tokens": 6},
            # An adaptive KL controller: its coefficient is part of the saved state.
            "loss": {"kl_target": 0.5, "kl_horizon": 100, "num_minibatches": 2},
        },
        **extra,
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.slow
def test_ppo_killed_then_resumed_equals_uninterrupted(tmp_path):
    from jaxrlhf.config import load_config

    path = _ppo_config(tmp_path)
    ref = loop.run(load_config(path, [f"output_dir={tmp_path / 'ref'}"]))
    assert "kl/coef" in ref.history[-1]

    run_dir = str(tmp_path / "killed")
    proc = _cli(path, f"output_dir={run_dir}")
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    _wait_for(lambda: _committed_steps(ckpt_dir), proc, "the first checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = _committed_steps(ckpt_dir)[-1]
    assert 0 < killed_at < 6, killed_at

    resumed = loop.run(load_config(path, [f"output_dir={run_dir}"]))
    assert _untimed(resumed.history) == _untimed(ref.history)
    _assert_trees_equal(resumed.trainer.policy_state, ref.trainer.policy_state)
    _assert_trees_equal(resumed.trainer.value_state, ref.trainer.value_state)
    assert float(resumed.trainer.kl_state.kl_coef) == float(ref.trainer.kl_state.kl_coef)


# ---- resume on another mesh --------------------------------------------------------------


MESH_ARGS = (*SFT_ARGS, "checkpoint.every=0", "logging.plot=false", "checkpoint.export_hf=false")


@pytest.fixture(scope="module")
def three_of_six(tmp_path_factory):
    """An uninterrupted 6-step run, and the run directory of the same run stopped at 3
    (both on the 8-device mesh)."""
    tmp = tmp_path_factory.mktemp("mesh")
    ref = loop.run(config("tiny_sft", tmp / "ref", *MESH_ARGS, "train.steps=6"))
    first = loop.run(config("tiny_sft", tmp / "run", *MESH_ARGS, "train.steps=3"))
    assert first.trainer.mesh.shape["fsdp"] == 8
    return ref, tmp / "run"


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 1)])
def test_resume_on_another_mesh(tmp_path, three_of_six, shape):
    ref, saved = three_of_six
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    other = mesh(*shape)
    cfg = config(
        "tiny_sft",
        run_dir,
        *MESH_ARGS,
        "train.steps=6",
        f"mesh.data={shape[0]}",
        f"mesh.fsdp={shape[1]}",
        f"mesh.tensor={shape[2]}",
        device_count=other.size,
    )
    resumed = loop.run(cfg, mesh=other)
    assert resumed.trainer.steps_done == 6
    leaf = jax.tree.leaves(resumed.trainer.state.params)[0]
    assert leaf.sharding.mesh.shape == other.shape  # restored into the new layout
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5),
        resumed.trainer.state.params,
        ref.trainer.state.params,
    )
    for got, want in zip(resumed.rows("loss/sft"), ref.rows("loss/sft"), strict=True):
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], atol=1e-5)


# ---- preemption ------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path):
    run_dir = str(tmp_path / "run")
    args = (*SFT_ARGS, "train.steps=100000", "checkpoint.every=0", "logging.progress=plain")
    proc = _cli(SFT, f"output_dir={run_dir}", *args)
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def trained_a_few_steps():
        if not os.path.exists(metrics):
            return False
        with open(metrics) as f:
            return sum(1 for _ in f) >= 4

    _wait_for(trained_a_few_steps, proc, "a few steps")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("SIGTERM: stopped after step") and "Resume" in message, message
    saved = _committed_steps(os.path.join(run_dir, "checkpoints"))
    assert len(saved) == 1 and saved[0] >= 3
    with open(metrics) as f:
        logged = [json.loads(line)["step"] for line in f]
    assert logged[-1] >= saved[0]  # nothing trained was lost: the checkpoint is the last step

    step = saved[0]
    resumed = loop.run(config("tiny_sft", run_dir, *SFT_ARGS, f"train.steps={step + 2}"))
    assert resumed.trainer.steps_done == step + 2
    trained = [s for s, _ in resumed.rows("loss/sft")]
    assert trained[-3:] == [step, step + 1, step + 2] and len(set(trained)) == len(trained)


# ---- atomic saves, bad checkpoints -------------------------------------------------------

_CRASH_DURING_SAVE = """
import os, sys
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from jaxrlhf.train.checkpointing import RunCheckpointer
from jaxrlhf.train.config import CheckpointConfig

ckpt = RunCheckpointer(sys.argv[1], CheckpointConfig(async_save={async_save}))
ckpt.save(1, {{"w": jnp.arange(1000.0)}}, {{"step": 1}}, wait=True)

async def crash(self, *args, **kwargs):  # every file is written; the commit never happens
    os._exit(17)

for name in ("AtomicRenameTemporaryPath", "CommitFileTemporaryPath"):
    setattr(getattr(atomicity, name), "finalize", crash)
ckpt.save(2, {{"w": jnp.arange(1000.0) + 1}}, {{"step": 2}}, wait=True)
print("not reached")
"""


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False])
def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path, async_save):
    directory = str(tmp_path / "ckpt")
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_DURING_SAVE.format(async_save=async_save))
    proc = subprocess.run(
        [sys.executable, str(script), directory], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert "not reached" not in proc.stdout
    assert any("tmp" in name for name in os.listdir(directory))  # the torn save is there

    ckpt = RunCheckpointer(directory, CheckpointConfig())
    assert ckpt.latest() == 1
    target = {"w": jnp.zeros(1000)}
    arrays, meta = ckpt.restore(1, target)
    np.testing.assert_array_equal(arrays["w"], np.arange(1000.0))
    assert meta["step"] == 1
    ckpt.save(2, {"w": jnp.ones(1000)}, {"step": 2}, wait=True)  # saving over the debris works
    assert ckpt.latest() == 2
    ckpt.close()


def test_a_state_on_two_device_groups_saves_restores_and_is_checked(tmp_path):
    """An interleaved placement keeps the policy's state on the learner's devices and the
    critic's on its own: the save's finiteness check runs per device set (one program over
    both raised "incompatible devices" at the end of such a run), the restore puts each
    array back on its devices bitwise, and a NaN on the second group is still refused."""
    from jax.sharding import SingleDeviceSharding

    from jaxrlhf.train.checkpointing import NonFiniteStateError

    first, second = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    state = {
        "policy": jax.device_put(jnp.arange(6.0), first),
        "critic": {"w": jax.device_put(jnp.arange(4.0) / 3, second)},
        "step": jax.device_put(jnp.asarray(3, jnp.int32), second),
    }
    ckpt = RunCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(async_save=False))
    ckpt.save(1, state, {"step": 1}, wait=True)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    arrays, _ = ckpt.restore(1, target)
    for got, want in zip(jax.tree.leaves(arrays), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    bad = {**state, "critic": {"w": jax.device_put(jnp.array([1.0, np.nan]), second)}}
    with pytest.raises(NonFiniteStateError, match="step 2: the run state has non-finite"):
        ckpt.save(2, bad, {"step": 2}, wait=True)
    assert ckpt.latest() == 1
    ckpt.close()


@pytest.mark.slow
def test_resume_errors_are_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = [
        "--config",
        SFT,
        f"output_dir={run_dir}",
        "logging.progress=none",
        "logging.plot=false",
        "train.steps=2",
        *SFT_ARGS,
    ]

    def error(*extra):
        capsys.readouterr()
        assert cli_main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    assert "no checkpoint to resume from" in error("--resume")
    assert cli_main(base) == 0
    assert "checkpoint.resume=never" in error("checkpoint.resume=never")
    assert "different `model`" in error("model.hidden_size=32", "model.intermediate_size=64")

    state_dir = run_dir / "checkpoints" / "2" / "state"
    for root, _, files in os.walk(state_dir):  # corrupt every data file
        for name in files:
            if not name.startswith("_"):
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"garbage")
    message = error("train.steps=4")
    assert "cannot restore" in message and str(run_dir) in message


# ---- non-finite updates ---------------------------------------------------------------------


def _poisoned_sft(poisoned_steps: set[int], monkeypatch):
    """SFT whose loss is NaN on the given (0-based) updates: the first token of the batch is
    replaced by -1 on the host and the wrapped loss turns NaN when it sees a negative id."""
    original = loop.TRAINERS["sft"]

    def factory(cfg):
        obj = original(cfg)

        def loss_fn(module, params, batch):
            loss, aux = obj.loss_fn(module, params, batch)
            poison = jnp.any(batch["tokens"] < 0)
            loss = jnp.where(poison, jnp.nan, loss)
            return loss, aux._replace(metrics=dict(aux.metrics, **{"loss/sft": loss}))

        return steps.Objective(**{**obj.__dict__, "loss_fn": loss_fn})

    def next_batch(self):
        host = next(self.batches)
        if self.steps_done in poisoned_steps:
            host = dict(host, tokens=host["tokens"].copy())
            host["tokens"][0, 0] = -1
        return self.put(host)

    monkeypatch.setitem(loop.TRAINERS, "sft", factory)
    monkeypatch.setattr(SupervisedTrainer, "next_batch", next_batch)


@pytest.mark.slow
def test_nonfinite_updates_are_skipped(tmp_path, monkeypatch):
    _poisoned_sft({1, 2, 5}, monkeypatch)
    args = (*SFT_ARGS, "train.steps=7", "train.max_consecutive_skips=3", "logging.plot=false")
    result = loop.run(config("tiny_sft", tmp_path, *args, "checkpoint.export_hf=false"))
    skipped = [r["skipped"] for r in result.history if "skipped" in r]
    assert skipped == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert result.trainer.state.step == 4  # only the finite updates count
    for leaf in jax.tree.leaves(result.trainer.state):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_train_step_leaves_state_untouched_on_nan(tmp_path, monkeypatch):
    _poisoned_sft({0}, monkeypatch)
    trainer = loop.build_trainer(config("tiny_sft", tmp_path, *SFT_ARGS))
    before = jax.device_get(trainer.state)
    metrics = trainer.step().metrics
    assert float(metrics["skipped"]) == 1.0 and np.isnan(float(metrics["loss/sft"]))
    _assert_trees_equal(trainer.state, before)
    metrics = trainer.step().metrics
    assert float(metrics["skipped"]) == 0.0 and int(trainer.state.step) == 1


@pytest.mark.slow
def test_consecutive_nonfinite_updates_stop_with_the_last_good_state_saved(tmp_path, monkeypatch):
    """Updates 5, 6, 7 are non-finite and skipped; the run stops at step 7 and saves it. A
    skipped update changes nothing, so checkpoint 7 holds the step-4 state, equal to the
    regular checkpoint 6 (steps 5 and 6 skipped too)."""
    _poisoned_sft(set(range(4, 100)), monkeypatch)
    args = (*SFT_ARGS, "train.steps=20", "train.max_consecutive_skips=3", "checkpoint.every=2")
    with pytest.raises(TrainingDiverged, match="3 consecutive updates") as err:
        loop.run(config("tiny_sft", tmp_path, *args))
    assert "\n" not in str(err.value)
    assert "The last good state: checkpoint 7 in" in str(err.value)
    ckpt = RunCheckpointer(str(tmp_path / "checkpoints"), CheckpointConfig())
    assert ckpt.steps() == [6, 7]
    trainer = loop.build_trainer(config("tiny_sft", tmp_path, *args))
    target, _ = trainer.snapshot()
    six, _ = ckpt.restore(6, target)
    seven, meta = ckpt.restore(7, target)
    assert int(seven["train"].step) == 4 and meta["step"] == 7
    _assert_trees_equal(seven["train"], six["train"])
    for leaf in jax.tree.leaves(seven["train"]):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert not os.path.exists(tmp_path / "hf")  # no export of a failed run


@pytest.mark.slow
def test_cli_reports_divergence_in_one_line(tmp_path, monkeypatch, capsys):
    _poisoned_sft(set(range(100)), monkeypatch)
    argv = ["--config", SFT, f"output_dir={tmp_path}", "logging.progress=none", *SFT_ARGS]
    assert cli_main([*argv, "train.steps=5", "train.max_consecutive_skips=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: step 2: 2 consecutive updates"), err
