"""Several ``--config`` files merged in order: the deep-merge rules, where errors point, and
the CLI (a run, its dry run and the dry run's child process) on the merged config."""

from __future__ import annotations

import os

import pytest
import yaml

from jaxrlhf.config import (
    COMMAND_LINE,
    ConfigError,
    config_files,
    load_config,
    merge_configs,
    read_configs,
    validate,
)
from jaxrlhf.train import dry_run
from jaxrlhf.train.__main__ import main
from jaxrlhf.train.pipeline import requested_cpu_devices, run_stages

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
TINY_SFT = os.path.join(CONFIGS, "tiny_sft.yaml")
RUN = {
    "algorithm": "sft",
    "data": {"max_length": 32, "max_prompt_length": 16},
    "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
    "train": {"batch_size": 16, "steps": 10},
    "lora": {"rank": 4},
}


def _write(tmp_path, data, name):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return str(path)


# ---- merge semantics --------------------------------------------------------------------------


def test_sections_merge_key_by_key_and_later_values_win():
    base = {
        "algorithm": "ppo",
        "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
        "ppo": {"rollout": {"max_staleness": 0, "num_samples": 4}, "loss": {"kl_coef": 0.1}},
        "lora": {"rank": 8, "targets": ["q", "k", "v", "o"]},
        "data": {"train": "builtin:sort", "eval": "a.jsonl"},
    }
    overlay = {
        "mesh": {"fsdp": 4},  # one key of a section
        "ppo": {"rollout": {"max_staleness": 1}},  # two levels down
        "lora": {"targets": ["q"]},  # a list replaces the earlier list whole
        "data": {"eval": None},  # null sets null
        "placement": {"train_devices": 4},  # a new section
    }
    expected = {
        "algorithm": "ppo",
        "mesh": {"data": 1, "fsdp": 4, "tensor": 1},
        "ppo": {"rollout": {"max_staleness": 1, "num_samples": 4}, "loss": {"kl_coef": 0.1}},
        "lora": {"rank": 8, "targets": ["q"]},
        "data": {"train": "builtin:sort", "eval": None},
        "placement": {"train_devices": 4},
    }
    merged = merge_configs(base, overlay)
    assert merged == expected
    assert base["mesh"] == {"data": 1, "fsdp": -1, "tensor": 1}  # the inputs are not changed
    merged["lora"]["targets"].append("k")
    assert overlay["lora"]["targets"] == ["q"]  # nor shared with the result


def test_null_and_mappings_replace_each_other_whole():
    base = {"lora": {"rank": 8, "alpha": 16}, "mesh": None, "model": {"preset": "tiny"}}
    overlay = {"lora": None, "mesh": {"fsdp": 2}, "model": {}}
    assert merge_configs(base, overlay) == {
        "lora": None,  # a section set to null
        "mesh": {"fsdp": 2},  # a section where there was null
        "model": {"preset": "tiny"},  # an empty mapping changes nothing
    }
    # Three files: each later one wins.
    assert merge_configs({"a": {"b": 1, "c": 1}}, {"a": {"b": 2}}, {"a": {"b": 3, "d": 3}}) == {
        "a": {"b": 3, "c": 1, "d": 3}
    }


def test_read_configs_applies_overrides_last_and_records_where_fields_came_from(tmp_path):
    run = _write(tmp_path, RUN, "run.yaml")
    plan = _write(tmp_path, {"mesh": {"fsdp": 4, "tensor": 2}, "lora": None}, "plan.yaml")
    data, origins = read_configs([run, plan], ["mesh.tensor=1", "train.steps=3"])
    assert data["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert data["lora"] is None and data["train"] == {"batch_size": 16, "steps": 3}
    assert origins == {
        "mesh.fsdp": plan,
        "mesh.tensor": COMMAND_LINE,
        "lora": plan,
        "train.steps": COMMAND_LINE,
    }
    assert config_files(run, origins) == f"{run} + {plan}"
    assert read_configs([run], []) == (RUN, {})


# ---- loading and errors -------------------------------------------------------------------------


def test_output_dir_and_source_come_from_the_first_file(tmp_path):
    run = _write(tmp_path, RUN, "run.yaml")
    plan = _write(tmp_path, {"mesh": {"fsdp": 2}}, "plan.yaml")
    cfg = load_config([run, plan])
    assert cfg.output_dir == os.path.join("runs", "run")  # as without the overlay
    assert cfg.output_dir == load_config(run).output_dir
    assert cfg.mesh.fsdp == 2 and cfg.lora.rank == 4
    assert load_config([run, plan], ["mesh.fsdp=8"]).mesh.fsdp == 8


@pytest.mark.parametrize(
    "run_changes, overlay, message",
    [
        ({}, {"mesh": {"fsdpp": 4}}, "{plan}: mesh.fsdpp: unknown key (did you mean 'fsdp'?"),
        ({}, {"train": {"steps": "many"}}, "{plan}: train.steps: expected int, got 'many'"),
        ({}, {"lora": {"rank": 0}}, "{plan}: lora.rank: must be >= 1, got 0"),  # its own check
        ({"lora": {"rank": 0}}, {"lora": {"alpha": 2.0}}, "{run}: lora.rank: must be >= 1"),
        ({"train": {"batch_size": "x"}}, {}, "{run}: train.batch_size: expected int, got 'x'"),
    ],
)
def test_errors_name_the_file_that_set_the_field(tmp_path, run_changes, overlay, message):
    run = _write(tmp_path, {**RUN, **run_changes}, "run.yaml")
    plan = _write(tmp_path, overlay, "plan.yaml")
    with pytest.raises(ConfigError) as e:
        load_config([run, plan])
    assert str(e.value).startswith(message.format(run=run, plan=plan)), str(e.value)


def test_section_errors_name_every_file_that_set_it(tmp_path):
    """The mesh of RUN.yaml with PLAN.yaml's fsdp does not fit 8 devices: both files are
    named; a command-line override of the same field is named instead of the overlay."""
    run = _write(tmp_path, RUN, "run.yaml")
    plan = _write(tmp_path, {"mesh": {"fsdp": 3}}, "plan.yaml")
    _, origins = read_configs([run, plan])
    with pytest.raises(ConfigError, match=rf"^{run} \+ {plan}: mesh: "):
        validate(load_config([run, plan]), 8, source=run, override_paths=origins)
    _, origins = read_configs([run, plan], ["mesh.fsdp=5"])
    with pytest.raises(ConfigError, match=rf"^{run} \+ {COMMAND_LINE}: mesh: "):
        validate(load_config([run, plan], ["mesh.fsdp=5"]), 8, source=run, override_paths=origins)


def test_bad_yaml_in_an_overlay_names_it(tmp_path):
    run = _write(tmp_path, RUN, "run.yaml")
    plan = _write(tmp_path, "mesh: {fsdp: 4\n", "plan.yaml")
    with pytest.raises(ConfigError, match=rf"^{plan}: invalid YAML at line"):
        load_config([run, plan])
    plan = _write(tmp_path, "- mesh\n", "plan.yaml")
    with pytest.raises(ConfigError, match=rf"^{plan}: expected a mapping of sections"):
        load_config([run, plan])


# ---- the CLI ----------------------------------------------------------------------------------


def test_cli_missing_overlay_is_one_line_exit_2(tmp_path, capsys):
    missing = str(tmp_path / "plan.yaml")
    assert main(["--config", TINY_SFT, "--config", missing, f"output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such config file\n"
    assert main(["--config", TINY_SFT, "--config", missing, "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such config file\n"


def test_cli_overlay_unknown_key_is_one_line_naming_it(tmp_path, capsys):
    plan = _write(tmp_path, {"ppo": {"rollout": {"max_stalenes": 1}}}, "plan.yaml")
    assert main(["--config", TINY_SFT, "--config", plan, f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {plan}: ppo.rollout.max_stalenes: unknown key (did you mean")


@pytest.mark.slow
def test_cli_dry_run_plans_the_merged_config(tmp_path, capsys):
    """tiny_sft fills the 8 devices with fsdp; the overlay asks for data 2 x fsdp 2 and a
    batch of 8, and the command line then sets the batch to 4: the table shows the overlay's
    mesh on 4 devices and the override's batch."""
    plan = _write(tmp_path, {"mesh": {"data": 2, "fsdp": 2}, "train": {"batch_size": 8}}, "p.yaml")
    assert main(["--config", TINY_SFT, "--config", plan, "--dry-run", "train.batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dry run of {TINY_SFT} + {plan}: sft, ")
    assert "mesh data=2 x fsdp=2 x tensor=1 (4 device(s)); batch 4 x 32 tokens" in out


def test_dry_run_child_gets_every_config(tmp_path, monkeypatch, capsys):
    """A merged config that needs more devices than this process has (8) is planned by a
    child process given every --config file in order and the overrides."""
    plan = _write(tmp_path, {"mesh": {"fsdp": 16}}, "plan.yaml")
    assert dry_run._configured_devices([TINY_SFT, plan], []) == 16
    assert dry_run._configured_devices([TINY_SFT, plan], ["mesh.fsdp=4"]) == 4
    assert dry_run._configured_devices([TINY_SFT, str(tmp_path / "missing.yaml")], []) is None
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "planned\n", ""

    def fake_run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"][dry_run._CHILD_ENV]))
        return Done()

    monkeypatch.setattr(dry_run.subprocess, "run", fake_run)
    overrides = ["train.batch_size=16"]
    assert dry_run.cli([TINY_SFT, plan], overrides, memory="1GB") == 0
    (cmd, child), *rest = calls
    assert not rest and child == "1"
    assert cmd[cmd.index("-m") :] == [
        "-m",
        "jaxrlhf.train",
        "--dry-run",
        "--device-memory=1GB",
        f"--config={TINY_SFT}",
        f"--config={plan}",
        "--set=train.batch_size=16",
    ]
    assert capsys.readouterr().out == "planned\n"


@pytest.mark.slow
def test_dry_run_child_process_plans_the_merged_config(tmp_path, capsys):
    """The same for real (about 5 s on 2 cores): the child, with 16 CPU devices, prints the
    overlay's mesh."""
    plan = _write(tmp_path, {"mesh": {"fsdp": 16}, "train": {"batch_size": 16}}, "plan.yaml")
    assert main(["--config", TINY_SFT, "--config", plan, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"dry run of {TINY_SFT} + {plan}: sft" in out
    assert "mesh data=1 x fsdp=16 x tensor=1 (16 device(s))" in out


# ---- pipelines ----------------------------------------------------------------------------------


def test_overlays_apply_to_every_pipeline_stage(tmp_path):
    a = _write(tmp_path, dict(RUN, placement={"cpu_devices": 2}), "a.yaml")
    b = _write(tmp_path, dict(RUN, algorithm="dpo", placement={"cpu_devices": 3}), "b.yaml")
    pipeline = _write(tmp_path, {"pipeline": ["a.yaml", "b.yaml"]}, "pipe.yaml")
    plan = _write(tmp_path, {"placement": {"cpu_devices": 4}}, "plan.yaml")
    a, b = os.path.join(tmp_path, "a.yaml"), os.path.join(tmp_path, "b.yaml")
    assert run_stages([pipeline]) == [(a,), (b,)]
    assert run_stages([pipeline, plan]) == [(a, plan), (b, plan)]
    assert run_stages([a, plan, b]) == [(a, plan, b)]
    with pytest.raises(ConfigError, match="differs between pipeline stages"):
        requested_cpu_devices(run_stages([pipeline]), [])  # 2 and 3
    assert requested_cpu_devices(run_stages([pipeline, plan]), []) == 4  # the overlay's
    with pytest.raises(ConfigError) as e:
        run_stages([a, pipeline])
    assert str(e.value) == f"{pipeline}: a pipeline file can only be the first --config"


@pytest.mark.slow
def test_run_saves_the_merged_config(tmp_path):
    """A one-step run: the run directory's config.yaml is the merged config, and its header
    names both files."""
    plan = _write(tmp_path, {"mesh": {"data": 2, "fsdp": 4}, "train": {"batch_size": 8}}, "p.yaml")
    out = tmp_path / "run"
    args = ["--config", TINY_SFT, "--config", plan, f"output_dir={out}", "train.steps=1"]
    args += ["optimizer.warmup_steps=0", "data.eval_size=0", "data.builtin_size=16"]
    args += ["logging.progress=none", "checkpoint.export_hf=false"]
    assert main(args) == 0
    text = (out / "config.yaml").read_text()
    assert text.startswith(f"# resolved from {TINY_SFT} + {plan}\n")
    saved = yaml.safe_load(text)
    assert saved["mesh"]["data"] == 2 and saved["mesh"]["fsdp"] == 4
    assert saved["train"]["batch_size"] == 8 and saved["train"]["steps"] == 1
    assert saved["optimizer"]["lr"] == 3.0e-3  # from tiny_sft.yaml
    assert load_config(str(out / "config.yaml")) == load_config([TINY_SFT, plan], args[4:])
