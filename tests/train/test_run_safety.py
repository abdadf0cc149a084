"""A run's directory and history survive misuse: one run per directory, damaged metric lines
set aside (never the rows after them), the last good state saved when a run stops on a bad
reward, reward-model mistakes named by their field, the learning rate logged as it is."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest
import yaml

from jaxrlhf.config import ConfigError, load_config
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.rewards import RewardError
from jaxrlhf.train import loop
from jaxrlhf.train.__main__ import main as cli_main
from jaxrlhf.train.checkpointing import RunCheckpointer
from jaxrlhf.train.config import CheckpointConfig
from jaxrlhf.train.metrics import METRICS_FILE
from jaxrlhf.train.optim import make_schedule
from jaxrlhf.train.preemption import Preempted, StopSignals, TrainingDiverged, is_out_of_memory
from jaxrlhf.train.run_dir import LOCK_FILE, RunDirectoryInUse, RunLock
from tests.train.helpers import CONFIGS, config

QUIET = ("logging.plot=false", "checkpoint.export_hf=false", "train.eval_every=0")
SFT = (*QUIET, "data.eval_size=0", "optimizer.warmup_steps=0")


# ---- one run per directory -------------------------------------------------------------------


def test_a_second_run_stops_in_one_line_naming_the_holder(tmp_path):
    cfg = config("tiny_sft", tmp_path, *SFT, "train.steps=2")
    with RunLock(str(tmp_path)):  # another run holds the directory
        with pytest.raises(RunDirectoryInUse) as e:
            loop.run(cfg)
    message = str(e.value)
    assert message.startswith(f"output_dir: {tmp_path} is in use by a running job (pid ")
    assert str(os.getpid()) in message and "\n" not in message
    assert not os.path.exists(tmp_path / METRICS_FILE)  # it wrote nothing
    loop.run(cfg)  # free again once the holder is done


_HOLD = """
import sys, time
from jaxrlhf.train.run_dir import RunLock
with RunLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_runs_lock_does_not_block_the_next(tmp_path):
    """kill -9 leaves the lock file behind but the operating system drops the lock; the file
    still names the dead holder until the next run takes it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(RunDirectoryInUse, match=f"pid {proc.pid} on "):
        RunLock(str(tmp_path)).__enter__()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert f"pid {proc.pid}" in (tmp_path / LOCK_FILE).read_text()
    with RunLock(str(tmp_path)):
        assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()


def test_cli_reports_a_held_directory_in_one_line(tmp_path, capsys):
    path = os.path.join(CONFIGS, "tiny_sft.yaml")
    with RunLock(str(tmp_path)):
        code = cli_main(["--config", path, f"output_dir={tmp_path}", "logging.progress=none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: output_dir: "), err


def test_output_dir_that_is_a_file_is_a_one_line_cli_error(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("not a directory")
    path = os.path.join(CONFIGS, "tiny_sft.yaml")
    assert cli_main(["--config", path, f"output_dir={target}", "logging.progress=none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: output_dir: {target} is a file, not a directory; choose another"]


# ---- metric history --------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_keeps_every_intact_row_and_sets_damaged_ones_aside(tmp_path, caplog):
    """20 logged steps, checkpoint at 20; line 5 damaged by hand. Resuming to 24 keeps rows
    1-4 and 6-20 (before, the file was cut at the damaged line: 4 rows) and writes the
    damaged line, with its number, beside the file."""
    args = (*SFT, "train.log_every=1", "checkpoint.every=20")
    loop.run(config("tiny_sft", tmp_path, *args, "train.steps=20"))
    metrics = tmp_path / METRICS_FILE
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 21))
    lines[4] = lines[4][: len(lines[4]) // 2]  # a torn line in the middle
    metrics.write_text("\n".join(lines) + "\n")
    with caplog.at_level("WARNING"):
        resumed = loop.run(config("tiny_sft", tmp_path, *args, "train.steps=24"))
    steps = [r["step"] for r in resumed.history]
    assert steps == [s for s in range(1, 25) if s != 5]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == steps
    aside = (tmp_path / (METRICS_FILE + ".corrupt")).read_text().splitlines()
    assert aside == [f"5\t{lines[4]}"]
    assert "1 damaged line(s) set aside" in caplog.text


# ---- stopping on bad rewards -----------------------------------------------------------------

CALLS = {"n": 0}


def nan_at_fourth_iteration(prompts, completions, **columns):
    """1.0 per completion, but NaN on the 4th call: iterations 1-3 are good."""
    CALLS["n"] += 1
    return [float("nan") if CALLS["n"] == 4 else 1.0] * len(prompts)


def _grpo(tmp_path, *overrides):
    raw = {
        "algorithm": "grpo",
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny"},
        "data": {
            "train": "builtin:sort",
            "max_length": 32,
            "max_prompt_length": 16,
            "builtin_size": 64,
            "eval_size": 0,
        },
        "train": {"steps": 6},
        "logging": {"progress": "none", "plot": False},
        "checkpoint": {"every": 0, "export_hf": False},
        "grpo": {"rollout": {"prompts_per_step": 4, "max_new_tokens": 4}},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path), list(overrides))


@pytest.mark.slow
def test_a_non_finite_reward_keeps_the_iterations_before_it(tmp_path):
    CALLS["n"] = 0
    cfg = _grpo(tmp_path, f"grpo.reward.function={__name__}.nan_at_fourth_iteration")
    with pytest.raises(RewardError) as e:
        loop.run(cfg)
    message = str(e.value)
    assert "nan_at_fourth_iteration returned a non-finite score (nan) for row 0" in message
    assert "The last good state: checkpoint 3 in" in message and "\n" not in message
    ckpt = RunCheckpointer(str(tmp_path / "run" / "checkpoints"), CheckpointConfig())
    assert ckpt.steps() == [3]
    history = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3]
    CALLS["n"] = 10  # the reward is fixed: resuming runs iterations 4-6 from checkpoint 3
    resumed = loop.run(cfg)
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4, 5, 6]


def _out_of_memory_at_step(
    monkeypatch, step: int, consume_state: bool = False, after_update: bool = False
) -> None:
    """Makes the ``step``-th RL iteration run out of memory for real, after its prompts were
    drawn and sampled, as it starts learning: a jitted 4 PiB allocation (more than any
    address space, so refused on every host), which XLA refuses with RESOURCE_EXHAUSTED.
    ``consume_state`` first deletes a weight of the policy, as an update that donated its
    buffers before failing leaves it; ``after_update`` fails once the update has run (as
    an error read back with its metrics would)."""
    build = loop.build_trainer

    def build_failing(*args, **kwargs):
        trainer = build(*args, **kwargs)
        learn = trainer.learn

        def failing_learn(*args, **kwargs):
            if trainer.steps_done + 1 != step:
                return learn(*args, **kwargs)
            if after_update:
                learn(*args, **kwargs)
            if consume_state:
                jax.tree.leaves(trainer.policy_state.params)[0].delete()
            jax.block_until_ready(jax.jit(lambda: jax.numpy.ones((1 << 50,)))())

        trainer.learn = failing_learn
        return trainer

    monkeypatch.setattr(loop, "build_trainer", build_failing)


def _assert_same_run(resumed: list[dict], whole: list[dict]) -> None:
    """The resumed GRPO run's 6 iterations are the uninterrupted run's: the same rewards,
    KL and loss (atol 1e-6: the same programs on the same inputs and keys)."""
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    for key in ("reward/mean", "kl/seq_mean", "loss/policy"):
        np.testing.assert_allclose(
            [r[key] for r in resumed], [r[key] for r in whole], rtol=0, atol=1e-6, err_msg=key
        )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 6-iteration GRPO run of ``_grpo`` without a fault: its history."""
    return loop.run(_grpo(tmp_path_factory.mktemp("whole"))).history


@pytest.mark.slow
def test_running_out_of_memory_keeps_the_steps_before_it(tmp_path, monkeypatch, uninterrupted):
    """A step that runs out of device memory stops the run with one line (where, XLA's
    allocation, what to try) after saving the state before it; resuming from there repeats
    the uninterrupted run (its 4th iteration samples the 4th prompts again)."""
    _out_of_memory_at_step(monkeypatch, 4)
    cfg = _grpo(tmp_path)
    with pytest.raises(loop.OutOfDeviceMemory) as e:
        loop.run(cfg)
    message = str(e.value)
    assert message.startswith("out of device memory in step 4 (RESOURCE_EXHAUSTED: Out of memory")
    assert "--dry-run` prints each phase's memory per device" in message
    assert message.endswith(f"The last good state: checkpoint 3 in {tmp_path}/run/checkpoints.")
    assert "\n" not in message
    ckpt = RunCheckpointer(str(tmp_path / "run" / "checkpoints"), CheckpointConfig())
    assert ckpt.steps() == [3]
    monkeypatch.undo()
    _assert_same_run(loop.run(cfg).history, uninterrupted)


@pytest.mark.slow
def test_out_of_memory_after_the_update_keeps_the_state_before_it(
    tmp_path, monkeypatch, uninterrupted
):
    """A step that fails after its update ran (an error read back with its metrics) leaves
    the state the step started from, or, where the update donated it, nothing to save: the
    run resumed from what was saved repeats the uninterrupted run, not step 4's update
    twice."""
    _out_of_memory_at_step(monkeypatch, 4, after_update=True)
    cfg = _grpo(tmp_path, "checkpoint.every=2")
    with pytest.raises(loop.OutOfDeviceMemory, match="in step 4 "):
        loop.run(cfg)
    monkeypatch.undo()
    _assert_same_run(loop.run(cfg).history, uninterrupted)


@pytest.mark.slow
def test_out_of_memory_after_the_state_was_consumed_names_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """When the failing step had consumed the state (donated buffers), nothing is saved from
    it: the command line prints one line naming the last checkpoint saved (step 2) and exits
    with 1."""
    _out_of_memory_at_step(monkeypatch, 4, consume_state=True)
    _grpo(tmp_path)  # writes grpo.yaml
    argv = ["--config", str(tmp_path / "grpo.yaml"), "checkpoint.every=2"]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: out of device memory in step 4 (RESOURCE_EXHAUSTED"), err
    assert err[-1].endswith(f"The last good state: checkpoint 2 in {tmp_path}/run/checkpoints.")
    ckpt = RunCheckpointer(str(tmp_path / "run" / "checkpoints"), CheckpointConfig())
    assert ckpt.steps() == [2]


@pytest.mark.slow
def test_supervised_out_of_memory_draws_its_batch_again(tmp_path, monkeypatch):
    """SFT: a step that runs out of memory after drawing its batch (as it puts it on the
    devices) leaves the data position before it, so resuming from the checkpoint saved then
    repeats the uninterrupted run's losses."""
    args = (*SFT, "train.steps=4", "train.log_every=1")
    whole = loop.run(config("tiny_sft", tmp_path / "whole", *args)).history
    build = loop.build_trainer

    def build_failing(*a, **kw):
        trainer = build(*a, **kw)
        put = trainer.put

        def failing_put(batch):
            if trainer.steps_done == 2:  # drawing step 3's batch
                jax.block_until_ready(jax.jit(lambda: jax.numpy.ones((1 << 50,)))())
            return put(batch)

        trainer.put = failing_put
        return trainer

    monkeypatch.setattr(loop, "build_trainer", build_failing)
    cfg = config("tiny_sft", tmp_path / "run", *args)
    with pytest.raises(loop.OutOfDeviceMemory, match="in step 3 .* checkpoint 2 in"):
        loop.run(cfg)
    monkeypatch.undo()
    resumed = loop.run(cfg).history
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [r["loss/sft"] for r in resumed], [r["loss/sft"] for r in whole], rtol=0, atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["out of memory", "preempted", "diverged"])
def test_a_stopped_run_lets_its_trainer_go(tmp_path, monkeypatch, stop):
    """A notebook keeps the last error it showed (IPython's ``sys.last_value``). The error
    ``run`` raises when it stops after saving (out of memory, a stop signal, divergence)
    must not hold
    the run's frames, and through them its trainer and every device buffer, or the retry
    with smaller sizes runs out of memory again. The error keeps its message and cause.
    (Divergence is forced: the check is told a limit of 0 skips was passed.)"""
    if stop == "out of memory":
        _out_of_memory_at_step(monkeypatch, 2)
        expected = loop.OutOfDeviceMemory
    elif stop == "preempted":
        monkeypatch.setattr(StopSignals, "requested", lambda self: signal.SIGTERM)
        expected = Preempted
    else:
        check = loop.check_skips
        monkeypatch.setattr(loop, "check_skips", lambda run, step, limit: check(1, step, 0))
        expected = TrainingDiverged
    build = loop.build_trainer
    built = []

    def recording(*args, **kwargs):
        trainer = build(*args, **kwargs)
        built.append(weakref.ref(trainer))
        return trainer

    monkeypatch.setattr(loop, "build_trainer", recording)
    with pytest.raises(expected) as e:
        loop.run(_grpo(tmp_path))
    error = e.value
    gc.collect()
    assert len(built) == 1 and built[0]() is None
    if stop == "out of memory":
        assert str(error).startswith("out of device memory in step 2 (RESOURCE_EXHAUSTED")
        assert isinstance(error.__cause__, jax.errors.JaxRuntimeError)
    elif stop == "preempted":
        assert (error.signum, error.step) == (signal.SIGTERM, 1)
    else:
        assert str(error).startswith("step 1: 1 consecutive updates had a non-finite loss")


def test_only_memory_errors_are_out_of_memory():
    """XLA's RESOURCE_EXHAUSTED also reports limits that are not memory (a message over a
    size limit): those are not called out of memory."""
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes.")
    gpu = jax.errors.JaxRuntimeError(  # JAX's GPU allocator (BFC) words it so
        "RESOURCE_EXHAUSTED: Failed to allocate request for 256.00MiB (268435456B) on device "
        "ordinal 0"
    )
    grpc = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: message larger than max (5 vs. 4)")
    other = jax.errors.JaxRuntimeError("INTERNAL: see RESOURCE_EXHAUSTED memory above")
    assert is_out_of_memory(oom) and is_out_of_memory(gpu)
    assert not is_out_of_memory(grpc) and not is_out_of_memory(other)
    assert not is_out_of_memory(MemoryError("RESOURCE_EXHAUSTED: memory"))


def strings(prompts, completions, **columns):
    return ["good"] * len(prompts)


@pytest.mark.slow
def test_a_reward_function_returning_strings_is_named(tmp_path):
    cfg = _grpo(tmp_path, f"grpo.reward.function={__name__}.strings", "train.steps=1")
    with pytest.raises(RewardError) as e:
        loop.run(cfg)
    assert str(e.value).startswith(f"reward function {__name__}.strings returned ['good', 'good',")


# ---- reward-model mistakes -------------------------------------------------------------------


def test_reward_model_errors_name_the_field(tmp_path):
    missing = _grpo(tmp_path, "grpo.reward.function=null", f"grpo.reward.model_dir={tmp_path}/no")
    with pytest.raises(ConfigError) as e:
        loop.build_trainer(missing)
    assert str(e.value) == f"<config>: grpo.reward.model_dir: no config.json in {tmp_path}/no"
    with pytest.raises(ConfigError) as e:  # set on the command line: blamed there
        loop.build_trainer(missing, override_paths=("grpo.reward.model_dir",))
    assert str(e.value).startswith("command line: grpo.reward.model_dir: no config.json")

    tiny = ModelConfig.tiny()
    lm_dir = str(tmp_path / "lm")
    save_hf(lm_dir, tiny, model_lib.init_params(tiny, jax.random.key(0)))  # a causal LM
    causal = _grpo(tmp_path, "grpo.reward.function=null", f"grpo.reward.model_dir={lm_dir}")
    with pytest.raises(ConfigError) as e:
        loop.build_trainer(causal)
    message = str(e.value)
    assert message.startswith(f"<config>: grpo.reward.model_dir: {lm_dir} is a causal LM")
    assert "algorithm: reward_model" in message and "\n" not in message


# ---- logged learning rate --------------------------------------------------------------------


@pytest.mark.slow
def test_logged_lr_is_the_last_updates_not_the_windows_mean(tmp_path):
    """A cosine schedule over 12 updates logged every 4: each row's lr is the schedule at the
    window's last update (a window mean would lag it and flatten the curve)."""
    args = (*SFT, "train.steps=12", "train.log_every=4", "optimizer.schedule=cosine")
    result = loop.run(config("tiny_sft", tmp_path, *args))
    schedule = make_schedule(result.trainer.cfg.optimizer, 12)
    rows = result.rows("lr")
    assert [s for s, _ in rows] == [4, 8, 12]
    np.testing.assert_allclose([v for _, v in rows], [schedule(s - 1) for s, _ in rows])
    assert rows[0][1] > rows[1][1] > rows[2][1]


def test_every_stage_writes_its_plot_with_the_runs_name(tmp_path, monkeypatch):
    titles = []
    original = loop.plot_history

    def plot_history(*args, title=None):
        titles.append(title)
        return original(*args, title=title)

    monkeypatch.setattr(loop, "plot_history", plot_history)
    args = (*SFT, "train.steps=4", "train.log_every=1", "logging.plot=true")
    loop.run(config("tiny_sft", tmp_path / "sft_stage", *args))
    assert (tmp_path / "sft_stage" / "metrics.png").stat().st_size > 1000
    assert titles == ["sft: sft_stage"]
