"""``--dry-run``: the plan against the real trainers, the fit verdict, recipes and errors.

What "matches the real run" means here, and the factors:

* Programs. The dry run compiles the trainers' own jitted functions against abstract
  inputs. The test runs the real trainer for one iteration, records the arguments each of
  its jitted programs was called with, compiles those programs on the real arrays, and
  compares XLA's memory analysis per program (arguments, outputs, aliased and temporary
  bytes per device). Factor 1.05 (plus 1 KiB for scalars): they are the same programs; the
  only intended difference is where the dry run puts uncommitted scalars (the KL
  coefficient), which the real run passes as single-device arrays.
* Resident state. The bytes each device really holds between steps (every role's
  parameters and optimizer state: the shards of the real arrays, summed per device) must
  equal the dry run's analytic ``state`` exactly (factor 1.0).

XLA:CPU devices report no ``memory_stats()`` (None), so a peak cannot be read from the
device here; the real executables' memory analysis is the measurement.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import numpy as np
import pytest
import yaml

from jaxrlhf.config import load_config, validate
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.sharding import MeshConfig
from jaxrlhf.sharding.placement import PlacementConfig
from jaxrlhf.train import dry_run
from jaxrlhf.train.__main__ import main
from jaxrlhf.train.loop import build_trainer
from jaxrlhf.train.rl_trainer import build_rl_trainer
from tests.train import helpers

RECIPES = os.path.join(helpers.CONFIGS, "recipes")
FACTOR, SLACK = 1.05, 1024


def _abstract(x):
    if not isinstance(x, jax.Array | np.ndarray):
        return x
    committed = isinstance(x, jax.Array) and x.committed
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)


class Recorder:
    """Wraps jitted functions; keeps each one's last call as abstract arguments."""

    def __init__(self):
        self.calls = {}

    def wrap(self, name, fn):
        def recorded(*args):
            self.calls[name] = (fn, jax.tree.map(_abstract, args))
            return fn(*args)

        return recorded

    def memory(self, name):
        fn, args = self.calls[name]
        return fn.lower(*args).compile().memory_analysis()


def _device_bytes(*trees) -> int:
    """Max over devices of the bytes of the real arrays' shards."""
    totals = {}
    for x in jax.tree.leaves(trees):
        for shard in x.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values())


def _buffers(x) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _assert_program_matches(planned: dry_run.ProgramMemory, real) -> None:
    pairs = {
        "argument": (planned.argument_bytes, real.argument_size_in_bytes),
        "output": (planned.output_bytes, real.output_size_in_bytes),
        "alias": (planned.alias_bytes, real.alias_size_in_bytes),
        "temp": (planned.temp_bytes, real.temp_size_in_bytes),
    }
    for what, (got, want) in pairs.items():
        assert got <= FACTOR * want + SLACK and want <= FACTOR * got + SLACK, (
            f"{planned.phase}/{planned.name} {what}: dry run {got} B, real {want} B"
        )


def _ppo_config(tmp_path):
    rm_dir = str(tmp_path / "rm")
    tiny = ModelConfig.tiny()
    save_hf(
        rm_dir,
        tiny,
        model_lib.init_params(tiny, jax.random.key(1), head="scalar"),
        head="scalar",
    )
    raw = {
        "algorithm": "ppo",
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny"},
        "data": {
            "train": "builtin:sort",
            "max_length": 32,
            "max_prompt_length": 16,
            "builtin_size": 64,
            "eval_size": 0,
        },
        "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
        "train": {"steps": 1, "micro_batch_size": 1},
        "logging": {"progress": "none"},
        "ppo": {
            # Scoring packs sequences (4 rows per data shard); one packed size, the largest,
            # so the real run compiles the programs the dry run plans.
            "rollout": {"prompts_per_step": 16, "max_new_tokens": 6, "pack_buckets": 1},
            "loss": {"epochs": 2, "num_minibatches": 2},
            "reward": {"function": None, "model_dir": rm_dir},
        },
    }
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(path))
    validate(cfg, 8, source=str(path))
    return cfg


@pytest.mark.slow
def test_ppo_plan_matches_real_run(tmp_path):
    cfg = _ppo_config(tmp_path)
    mesh = helpers.mesh(1, 4, 2)
    report = dry_run.plan(cfg, mesh=mesh)
    planned = {p.name: p for p in report.programs}
    assert list(planned) == ["prefill", "decode", "reward", "score", "update"]
    planned_rl = ("reward", "score", "update")  # RLPrograms' fields; the sampler's others
    assert [r.role for r in report.roles] == ["policy", "reference", "value", "reward"]

    trainer = build_rl_trainer(cfg, mesh=mesh)
    rec = Recorder()
    programs = trainer.programs
    trainer.programs = dataclasses.replace(
        programs, **{name: rec.wrap(name, getattr(programs, name)) for name in planned_rl}
    )
    sampler = trainer.sampler
    prefill_fn, decode_fn = sampler.prefill_program, sampler.decode_program
    sampler.prefill_program = lambda *a: rec.wrap("prefill", prefill_fn(*a))
    sampler.decode_program = lambda *a: rec.wrap("decode", decode_fn(*a))
    trainer.step()
    assert set(rec.calls) == set(planned)
    for name, program in planned.items():
        _assert_program_matches(program, rec.memory(name))

    held = _device_bytes(
        trainer.policy_state, trainer.value_state, trainer.ref_params, trainer.rm_params
    )
    assert planned["score"].state_bytes == held
    assert planned["update"].state_bytes == held
    # Generation adds the sampler's copy of the policy parameters (replicated over fsdp);
    # leaves whose layout does not change are not copied.
    train = trainer.policy_state.params
    gen, _ = sampler.to_generate_layout(train)
    pairs = zip(jax.tree.leaves(train), jax.tree.leaves(gen), strict=True)
    copied = [y for x, y in pairs if _buffers(x) != _buffers(y)]
    assert len(copied) < len(jax.tree.leaves(gen))
    assert planned["decode"].state_bytes == held + _device_bytes(copied)
    assert report.roles[0].generate_bytes == _device_bytes(gen) > _device_bytes(train)


@pytest.mark.slow
def test_packed_grpo_plan_matches_real_run(tmp_path):
    """GRPO packing sequences in scoring and in the update, 4 rows per data shard each: the
    dry run plans the packed programs (at their largest size; ``pack_buckets: 1`` makes it
    the only one, and without ``shared_prefix`` packing is not traded for prompt groups, so
    the real run compiles exactly the planned programs)."""
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
        "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
        "train": {"steps": 1},
        "logging": {"progress": "none"},
        "grpo": {
            "rollout": {
                "prompts_per_step": 4,
                "max_new_tokens": 6,
                "pack_buckets": 1,
                "shared_prefix": False,
            },
        },
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(path))
    mesh = helpers.mesh(1, 4, 2)
    report = dry_run.plan(cfg, mesh=mesh)
    planned = {p.name: p for p in report.programs}
    assert list(planned) == ["prefill", "decode", "score", "update"]
    assert "sequences packed (scoring 4 -> 4 rows per data shard, update 4 -> 4" in report.shapes

    trainer = build_rl_trainer(cfg, mesh=mesh)
    assert trainer.layout.rl.packing.score == trainer.layout.rl.packing.update == 4
    rec = Recorder()
    trainer.programs = dataclasses.replace(
        trainer.programs,
        **{name: rec.wrap(name, getattr(trainer.programs, name)) for name in ("score", "update")},
    )
    metrics = trainer.step().metrics
    assert metrics["packing/score_rows"] == metrics["packing/update_rows"] == 4
    for name in ("score", "update"):
        _assert_program_matches(planned[name], rec.memory(name))


OWN_REFERENCE = {
    "strategy": "interleaved",
    "sampler": {"devices": [0, 1]},
    "reference_group": {"devices": [2]},  # one device: in flight beside the learner's four
    "learner": {"devices": [4, 5, 6, 7]},
    "reference": "own",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "phase", "where"),
    [
        (
            {"strategy": "separated", "sampler": {"devices": [0, 1, 2, 3]}, "reference": "sampler"},
            "generate",
            "on the sampler's devices",
        ),
        (OWN_REFERENCE, "score", "on its own devices"),
    ],
    ids=["sampler", "own"],
)
def test_plan_with_the_reference_apart(tmp_path, placement, phase, where):
    """``placement.reference: sampler`` (sampler on devices 0-3, learner on 4-7) or ``own``
    (sampler on 0-1, reference on 2, learner on 4-7): the dry run plans the reference's
    forward on that mesh, its weights on those devices only, and the score program without
    them; the real run's programs match."""
    raw = {
        "algorithm": "grpo",
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny"},
        "data": {"train": "builtin:sort", "max_length": 32, "max_prompt_length": 16},
        "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
        "train": {"steps": 1},
        "logging": {"progress": "none"},
        "placement": placement,
        "grpo": {
            "rollout": {
                "prompts_per_step": 4,
                "max_new_tokens": 6,
                "pack_buckets": 1,
                "shared_prefix": False,
            },
            "loss": {"kl_coef": 0.1},
        },
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(path))
    report = dry_run.plan(cfg)
    planned = {p.name: p for p in report.programs}
    assert list(planned) == ["prefill", "decode", "reference", "score", "update"]
    assert planned["reference"].phase == phase
    reference = next(r for r in report.roles if r.role == "reference")
    assert where in reference.note
    if phase == "generate":  # beside what generation holds: its copy of the policy, once
        assert planned["reference"].state_bytes == planned["decode"].state_bytes

    trainer = build_rl_trainer(cfg)
    assert trainer.ref_params is None
    rec = Recorder()
    trainer.programs = dataclasses.replace(
        trainer.programs,
        **{
            name: rec.wrap(name, getattr(trainer.programs, name))
            for name in ("reference_apart", "score", "update")
        },
    )
    trainer.step()
    # With its own group the learner's scoring runs as two programs (forwards while the
    # reference's runs, then the advantages) that the plan's one score program stands for.
    matched = ("reference", "score") if phase == "generate" else ("reference",)
    for name in matched:
        _assert_program_matches(
            planned[name], rec.memory({"reference": "reference_apart"}.get(name, name))
        )
    assert planned["score"].argument_bytes < planned["reference"].argument_bytes


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_plan_of_an_interleaved_critic_matches_real_run(tmp_path, lora):
    """``interleaved`` PPO (learner on devices 0-1, critic on 2-3 with the learner's two data
    shards): the dry run compiles the critic's value forward and update on the critic's
    mesh, each holding the critic's trees only (with LoRA, its own copy of the frozen
    base, as the trainer places it), and the learner's programs without them; the real
    run's programs match."""
    raw = {
        "algorithm": "ppo",
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny"},
        "data": {"train": "builtin:sort", "max_length": 32, "max_prompt_length": 16},
        "mesh": {"data": 2, "fsdp": 1, "tensor": 1},
        "train": {"steps": 1},
        "logging": {"progress": "none"},
        "placement": {
            "strategy": "interleaved",
            "learner": {"devices": [0, 1]},
            "critic": {"devices": [2, 3], "mesh": {"data": 2, "fsdp": 1, "tensor": 1}},
        },
        "ppo": {
            "rollout": {"prompts_per_step": 4, "max_new_tokens": 6, "pack_buckets": 1},
            "reward": {"function": "builtin"},
        },
        **({"lora": {"rank": 4}} if lora else {}),
    }
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(path))
    report = dry_run.plan(cfg)
    planned = {p.name: p for p in report.programs}
    assert {n for n, p in planned.items() if p.group == "critic"} == {"values", "update.critic"}
    roles = {(r.role, r.head): r for r in report.roles}
    value = roles[("value", "scalar")]
    base = roles.get(("base", "scalar"))  # LoRA: the critic's copy of the frozen base
    assert (base is not None) == lora
    critic_state = value.param_bytes + value.optimizer_bytes + (base.param_bytes if base else 0)
    assert planned["update.critic"].state_bytes == critic_state
    assert planned["update.critic"].resident_bytes == 0  # its whole state is its arguments
    assert planned["values"].resident_bytes == value.optimizer_bytes

    trainer = build_rl_trainer(cfg)
    rec = Recorder()
    trainer.programs = dataclasses.replace(
        trainer.programs,
        **{
            name: rec.wrap(name, getattr(trainer.programs, name))
            for name in ("score_values", "update_value", "update")
        },
    )
    trainer.step()
    for name, real in (("values", "score_values"), ("update.critic", "update_value")):
        _assert_program_matches(planned[name], rec.memory(real))
    _assert_program_matches(planned["update"], rec.memory("update"))
    # The learner's devices hold no critic: their update's state is the policy's and the
    # reference's alone.
    learner = [r for r in report.roles if r.role in ("policy", "reference")]
    learner_base = [r for r in report.roles if r.role == "base" and r.head == "lm"]
    want = sum(r.param_bytes + r.optimizer_bytes for r in learner + learner_base)
    assert planned["update"].state_bytes == want


def test_sft_plan_matches_real_run(tmp_path):
    cfg = helpers.config("tiny_sft", tmp_path, "mesh.fsdp=8", "train.micro_batch_size=2")
    mesh = helpers.mesh(1, 8, 1)
    report = dry_run.plan(cfg, mesh=mesh)
    (program,) = report.programs
    assert (program.phase, program.name) == ("train", "train_step")

    trainer = build_trainer(cfg, mesh=mesh)
    rec = Recorder()
    trainer.programs = dataclasses.replace(
        trainer.programs, train_step=rec.wrap("train_step", trainer.programs.train_step)
    )
    trainer.step()
    _assert_program_matches(program, rec.memory("train_step"))
    assert program.state_bytes == _device_bytes(trainer.state)
    assert report.roles[0].params == model_lib.param_count(trainer.state.params)


@pytest.mark.parametrize("precompute", [False, True])
def test_dpo_plan_scores_reference(tmp_path, precompute):
    cfg = helpers.config(
        "tiny_dpo",
        tmp_path,
        "mesh.fsdp=8",
        f"dpo.precompute_reference={precompute}",
        "dpo.reference_hf_dir=/nonexistent/ref",
    )
    report = dry_run.plan(cfg, mesh=helpers.mesh(1, 8, 1))
    ref, step = report.programs
    policy, reference = report.roles
    assert (ref.name, step.name) == ("reference", "train_step")
    assert reference.role == "reference" and reference.note == "policy architecture assumed"
    trained = policy.param_bytes + policy.optimizer_bytes
    assert ref.resident_bytes == trained
    # A precomputed reference is freed before training; otherwise it stays beside the step.
    assert step.resident_bytes == (0 if precompute else reference.param_bytes)
    assert any("dpo.reference_hf_dir" in n for n in report.notes)


def test_bf16_state_keeps_its_dtypes(tmp_path):
    """bf16 params (trained with stochastic rounding, as validation requires) + float32
    accumulated gradients, no mu_dtype: the train step casts the optimizer state back to its
    dtypes, so the plan has no dtype-change note (it had one before that fix)."""
    overrides = [
        "mesh.fsdp=8",
        "model.param_dtype=bfloat16",
        "optimizer.stochastic_rounding=true",
        "train.micro_batch_size=2",
    ]
    cfg = helpers.config("tiny_sft", tmp_path, *overrides)
    assert dry_run.plan(cfg, mesh=helpers.mesh(1, 8, 1)).notes == ()


def test_format_report_and_verdict(tmp_path, capsys):
    cfg = helpers.config("tiny_sft", tmp_path, "mesh.fsdp=8")
    report = dry_run.plan(cfg, mesh=helpers.mesh(1, 8, 1), device_memory=10**9)
    text = dry_run.format_report(report)
    assert report.fits is True
    for needle in ("parameters", "per device", "8 device(s)", "train_step", "fits:", "XLA:CPU"):
        assert needle in text


# ---- CLI ------------------------------------------------------------------------------------


def test_cli_does_not_fit_exits_1(capsys):
    path = os.path.join(helpers.CONFIGS, "tiny_sft.yaml")
    code = main(["--config", path, "--dry-run", "--device-memory", "1MB", "mesh.fsdp=8"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "train_step" in out and "NO" in out
    assert err.count("\n") == 1 and err.startswith("error: ") and "does not fit" in err


@pytest.mark.slow
def test_plan_with_the_sampler_on_its_own_mesh(tmp_path):
    """placement: train on device 0 (fsdp 1), sample on all 8 devices (data 8). The sampler's
    programs compile on the 8-device mesh; device 0 holds the training state and the
    sampler's copy, so each generate program's state exceeds the score program's by it."""
    cfg = _ppo_config(tmp_path).replace(
        mesh=MeshConfig(data=1, fsdp=1, tensor=1),
        placement=PlacementConfig(
            train_devices=1, generate_mesh=MeshConfig(data=-1, fsdp=1, tensor=1)
        ),
    )
    report = dry_run.plan(cfg)
    assert report.mesh == {"data": 1, "fsdp": 1, "tensor": 1}
    assert "on 8 CPU device(s)" in report.platform
    assert any("sampler on its own mesh {'data': 8," in n for n in report.notes)
    programs = {p.name: p for p in report.programs}
    policy = report.roles[0]
    assert policy.generate_bytes == policy.param_bytes  # replicated either way (1 device)
    assert programs["decode"].state_bytes == programs["score"].state_bytes + policy.param_bytes
    assert dry_run.run_devices(cfg.mesh, cfg.placement) is None  # data -1: fills the process
    fixed = PlacementConfig(train_devices=1, generate_mesh=MeshConfig(data=4, fsdp=1))
    assert dry_run.run_devices(cfg.mesh, fixed) == 4


def test_cli_program_that_does_not_compile_exits_1(tmp_path, capsys, monkeypatch):
    """A phase whose program fails to trace or compile: one line names the program and the
    reason, exit 1 (here the RL update is replaced by one that raises)."""
    from jaxrlhf.train import rl_steps

    def broken_update(*args, **kwargs):
        raise TypeError("scan body function carry input and carry output must match")

    monkeypatch.setattr(rl_steps, "rl_update", broken_update)
    raw = {
        "algorithm": "grpo",
        "model": {"preset": "tiny"},
        "data": {"train": "builtin:sort", "max_length": 32, "max_prompt_length": 16},
        "mesh": {"data": 1, "fsdp": 8, "tensor": 1},
        "grpo": {"rollout": {"prompts_per_step": 8, "max_new_tokens": 4}},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {path}: train/update does not compile: TypeError: scan body")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device-memory", "80XB"], "--device-memory: cannot read '80XB'"),
        (["--device-memory=-5GB"], "--device-memory: cannot read '-5GB'"),
        (["--device-memory", "GB"], "--device-memory: cannot read 'GB'"),
        (["--device-kind", "h1000"], "--device-kind: unknown kind 'h1000'"),
        (["--device-memory", "80GB", "--device-kind", "h100"], "not both"),
    ],
)
def test_cli_bad_device_memory_exits_2(flags, message, capsys):
    path = os.path.join(helpers.CONFIGS, "tiny_sft.yaml")
    assert main(["--config", path, "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: command line: ") and message in err


@pytest.mark.parametrize(
    "text, expected",
    [("80GB", 80 * 10**9), ("16GiB", 16 * 2**30), ("512 MB", 512 * 10**6), ("1.5TiB", 1.5 * 2**40)],
)
def test_parse_memory(text, expected):
    assert dry_run.parse_memory(text) == int(expected)


@pytest.mark.slow
def test_cli_mesh_larger_than_this_process_runs_in_a_child(capsys):
    """16 devices from a process that has 8: the dry run re-runs itself with 16."""
    path = os.path.join(helpers.CONFIGS, "tiny_sft.yaml")
    assert main(["--config", path, "--dry-run", "mesh.fsdp=16", "train.batch_size=16"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=1 x fsdp=16 x tensor=1 (16 device(s))" in out
    assert "fit not checked" in out


# ---- recipes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(os.listdir(RECIPES)))
def test_recipes_load_without_data_or_checkpoints(name):
    """Every recipe validates on its own mesh size; the dry run needs no files."""
    path = os.path.join(RECIPES, name)
    cfg = load_config(path)
    layout = validate(cfg, dry_run.run_devices(cfg.mesh, cfg.placement), source=path)
    # The device count the recipe's name promises ("8xh100", "tpu_v5e_64", "1gpu").
    named = re.search(r"_(\d+)xh100|_v5e_(\d+)|_(\d+)gpu", name)
    assert named, f"{name}: name the device count"
    assert layout.devices == int(next(g for g in named.groups() if g))
    assert layout.train_devices == math.prod(layout.mesh_shape)
    if cfg.placement.generate_mesh is None:
        assert layout.train_devices == layout.devices and layout.generate_shards is None
    else:  # the sampler's own mesh spans the devices the training mesh leaves
        assert layout.train_devices < layout.devices and layout.generate_shards
    assert not os.path.exists(cfg.data.train)  # the user's prompt file, not needed here


@pytest.mark.slow
def test_qwen_recipe_dry_run_fits_one_h100(capsys):
    """The GRPO recipe through the CLI, cut to 4 of its 28 layers to keep the test near
    20 s (the sampler's decode unrolls layers; the full dry runs are in docs/dry_run.md)."""
    path = os.path.join(RECIPES, "qwen2.5_1.5b_grpo_1gpu.yaml")
    args = ["--config", path, "--dry-run", "--device-kind", "h100", "model.num_layers=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("grpo, qwen2, ", "mesh data=1 x fsdp=1 x tensor=1", "decode", "fits:"):
        assert needle in out


def _tables(out: str) -> list[str]:
    """The report lines of a dry-run printout, without notes and compile times."""
    lines = [line for line in out.splitlines() if not line.startswith("note:")]
    lines = [re.sub(r" in [\d.]+ s:", " in _ s:", line) for line in lines]  # footer
    return [" ".join(line.split()[:-1]) if line.endswith("s") else line for line in lines]


@pytest.mark.slow
def test_pipeline_dry_run_plans_stages_whose_inputs_an_earlier_stage_exports(
    tmp_path, monkeypatch, capsys
):
    """The quickstart pipeline before anything has run: the RM and PPO stages load the SFT
    and RM exports, which do not exist yet. They are planned from stand-ins holding the
    config.json those stages would write, and the plan equals the one made after the
    exports exist (the same tables, byte for byte), with a note naming each stand-in."""
    monkeypatch.chdir(tmp_path)  # the quickstart writes runs/quickstart/... under the cwd
    pipeline = os.path.join(helpers.CONFIGS, "quickstart.yaml")
    assert main(["--config", pipeline, "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert planned.count("note: ") == 3
    assert "note: ppo.reward.model_dir: runs/quickstart/rm/hf is written by stage 2" in planned
    assert planned.count(" peaks at ") == 3
    assert not (tmp_path / "runs").exists()

    # The exports as the real stages write them (random weights: only config.json is read).
    sft_cfg = load_config(os.path.join(helpers.CONFIGS, "quickstart", "sft.yaml")).model.resolve()
    for stage, head in (("sft", "lm"), ("rm", "scalar")):
        params = model_lib.init_params(sft_cfg, jax.random.key(0), head)
        save_hf(str(tmp_path / "runs" / "quickstart" / stage / "hf"), sft_cfg, params, head=head)
    assert main(["--config", pipeline, "--dry-run"]) == 0
    real = capsys.readouterr().out
    assert "note: " not in real
    assert _tables(planned) == _tables(real)
