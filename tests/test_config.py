"""Config loading: typed sections, dotted overrides, and one test per validation rule, each
asserting the exact one-line message (file, field path, problem)."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from jaxrlhf.config import (
    ALGORITHMS,
    ConfigError,
    RunConfig,
    dump_config,
    from_dict,
    load_config,
    override_paths,
    parse_override,
    validate,
)
from jaxrlhf.train.__main__ import main
from jaxrlhf.train.supervised import OBJECTIVES as TRAINERS

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_*.yaml")))
BASE = {
    "algorithm": "sft",
    "data": {"max_length": 32, "max_prompt_length": 16},
    "train": {"batch_size": 16},
}


def _write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _load(path, overrides=(), device_count=8):
    """``load_config`` and ``validate`` for ``device_count`` devices, as a run does."""
    cfg = load_config(path, overrides)
    validate(cfg, device_count, source=path, override_paths=override_paths(overrides))
    return cfg


def _error(tmp_path, data, overrides=(), device_count=8):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        _load(path, overrides, device_count)
    message = str(e.value)
    assert "\n" not in message
    return message.replace(path, "FILE")


def _merge(**sections):
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            out.setdefault(key, {}).update(value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_tiny_configs_load_and_start_with_the_command(path):
    cfg = _load(path)
    assert cfg.algorithm in ALGORITHMS
    with open(path) as f:
        head = f.read().split("\nalgorithm:")[0]
    assert f"python -m jaxrlhf.train --config configs/{os.path.basename(path)}" in head
    assert "Expected" in head


def test_every_trainer_has_a_tiny_config():
    assert {"sft", "reward_model", "dpo"} <= set(TRAINERS) <= set(ALGORITHMS)
    assert set(TRAINERS) <= {_load(p).algorithm for p in CONFIGS}


def test_sections_are_typed_and_defaults_filled(tmp_path):
    cfg = _load(
        _write(tmp_path, _merge(optimizer={"lr": "1e-5"}, model={"hidden_size": 64})),
    )
    assert cfg.optimizer.lr == 1e-5 and isinstance(
        cfg.optimizer.lr, float
    )  # YAML reads 1e-5 as str
    assert cfg.model.resolve().hidden_size == 64
    assert cfg.output_dir == os.path.join("runs", "run")  # from the file name


def test_overrides_set_and_bare_forms(tmp_path):
    path = _write(tmp_path, BASE)
    cfg = _load(
        path,
        [
            "optimizer.lr=2e-4",
            "train.steps=7",
            "data.eval=null",
            "model.family=gpt2",
            "mesh.data=2",
        ],
    )
    assert cfg.optimizer.lr == 2e-4
    assert cfg.train.steps == 7
    assert cfg.data.eval is None
    assert cfg.model.resolve().family == "gpt2"
    assert cfg.mesh.data == 2
    assert parse_override("optimizer.lr=1e-5") == ("optimizer.lr", "1e-5")  # typed on load


def test_resolved_config_round_trips(tmp_path):
    cfg = _load(CONFIGS[0], ["optimizer.lr=0.01", "model.num_layers=3"])
    out = tmp_path / "config.yaml"
    dump_config(cfg, str(out), header="resolved")
    assert out.read_text().startswith("# resolved\n")
    assert _load(str(out)) == cfg


# ---- one test per validation rule --------------------------------------------------------


def test_unknown_key(tmp_path):
    msg = _error(tmp_path, _merge(optimizer={"lrr": 1.0}))
    assert msg.startswith("FILE: optimizer.lrr: unknown key (did you mean 'lr'? valid: b1, b2,")


def test_unknown_section(tmp_path):
    msg = _error(tmp_path, _merge(optimiser={"lr": 1.0}))
    assert msg.startswith("FILE: optimiser: unknown key (did you mean 'optimizer'?")


def test_unknown_model_field(tmp_path):
    msg = _error(tmp_path, _merge(model={"hidden": 64}))
    assert msg.startswith("FILE: model.hidden: unknown key (did you mean 'hidden_size'?")


def test_wrong_type(tmp_path):
    assert _error(tmp_path, _merge(optimizer={"lr": "fast"})) == (
        "FILE: optimizer.lr: expected float, got 'fast'"
    )
    assert _error(tmp_path, _merge(train={"steps": 1.5})) == (
        "FILE: train.steps: expected int, got 1.5"
    )
    assert _error(tmp_path, _merge(data={"shuffle": "yes please"})) == (
        "FILE: data.shuffle: expected bool, got 'yes please'"
    )
    assert _error(tmp_path, _merge(train={"micro_batch_size": "two"})) == (
        "FILE: train.micro_batch_size: expected int or null, got 'two'"
    )
    assert _error(tmp_path, _merge(optimizer=3)) == "FILE: optimizer: expected a mapping, got 3"


def test_wrong_type_from_the_command_line(tmp_path):
    msg = _error(tmp_path, BASE, overrides=["optimizer.lr=fast"])
    assert msg == "command line: optimizer.lr: expected float, got 'fast'"


def test_invalid_value(tmp_path):
    msg = _error(tmp_path, _merge(algorithm="ppo2"))
    assert msg.startswith("FILE: algorithm: expected one of ['sft', 'reward_model', 'dpo'")
    assert msg.endswith("], got 'ppo2'")
    assert (
        _error(tmp_path, _merge(optimizer={"lr": -1}))
        == "FILE: optimizer.lr: must be > 0, got -1.0"
    )


def test_batch_size_not_divisible_by_micro_batch_times_data_shards(tmp_path):
    msg = _error(tmp_path, _merge(train={"batch_size": 24, "micro_batch_size": 2}))
    assert msg == (
        "FILE: train.batch_size: 24 is not divisible by train.micro_batch_size x data shards"
        " = 2 x 8 = 16"
    )


def test_batch_size_not_divisible_by_data_shards(tmp_path):
    msg = _error(tmp_path, _merge(train={"batch_size": 12}, mesh={"data": 2, "fsdp": -1}))
    assert msg == (
        "FILE: train.batch_size: 12 is not divisible by the 8 data shards (mesh data x fsdp)"
    )
    # Tensor parallelism does not split the batch: 4 data shards divide 12.
    path = _write(tmp_path, _merge(train={"batch_size": 12}, mesh={"fsdp": -1, "tensor": 2}))
    assert _load(path).train.batch_size == 12


def test_eval_batch_size_not_divisible_by_data_shards(tmp_path):
    msg = _error(tmp_path, _merge(train={"eval_batch_size": 20}))
    assert msg == (
        "FILE: train.eval_batch_size: 20 is not divisible by the 8 data shards (mesh data x fsdp)"
    )


def test_sequence_length_over_model_positions(tmp_path):
    msg = _error(tmp_path, _merge(data={"max_length": 200, "max_prompt_length": 16}))
    assert msg == "FILE: data.max_length: 200 exceeds the model's max_position_embeddings (128)"


def test_prompt_length_leaves_no_room(tmp_path):
    msg = _error(tmp_path, _merge(data={"max_length": 32, "max_prompt_length": 32}))
    assert msg == (
        "FILE: data.max_prompt_length: 32 leaves no room for a response in max_length 32"
    )


def test_mesh_not_matching_devices(tmp_path):
    msg = _error(tmp_path, _merge(mesh={"data": 3, "fsdp": 1}))
    assert msg == "FILE: mesh: mesh data=3 x fsdp=1 x tensor=1 needs 3 devices but 8 are available"
    msg = _error(tmp_path, _merge(mesh={"data": 3, "fsdp": -1}))
    assert msg == (
        "FILE: mesh: mesh data=3 x fsdp=-1 x tensor=1 cannot fill fsdp: 8 devices are not"
        " divisible by the other axes' product 3"
    )


def test_warmup_longer_than_run(tmp_path):
    msg = _error(tmp_path, _merge(train={"steps": 5}, optimizer={"warmup_steps": 10}))
    assert msg == "FILE: optimizer.warmup_steps: 10 exceeds train.steps (5)"


def test_model_needs_exactly_one_source(tmp_path):
    msg = _error(tmp_path, _merge(model={"preset": "tiny", "hf_dir": str(tmp_path)}))
    assert msg == "FILE: model: set exactly one of model.preset and model.hf_dir"
    msg = _error(tmp_path, _merge(model={"preset": None, "hf_dir": str(tmp_path / "nope")}))
    assert msg == f"FILE: model.hf_dir: no config.json in {tmp_path / 'nope'}"


def test_unknown_builtin_task(tmp_path):
    msg = _error(tmp_path, _merge(data={"train": "builtin:chess"}))
    assert (
        msg == "FILE: data.train: unknown built-in task 'chess' (expected one of ['sort', 'add', "
        "'calc'])"
    )


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^nope\.yaml: no such config file$"):
        load_config("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: sft\ntrain: {steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line 3: "):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"^command line: 'lr': expected an override like"):
        load_config(CONFIGS[0], ["lr"])


def test_programmatic_config_is_validated_the_same_way():
    with pytest.raises(ConfigError, match=r"^<config>: train.steps: must be >= 1, got 0$"):
        from_dict(dict(BASE, train={"steps": 0}))
    cfg = from_dict(BASE)
    assert isinstance(cfg, RunConfig)
    assert validate(cfg, 8).num_micro == 1  # across sections, as a run validates it
    with pytest.raises(ConfigError, match="train.batch_size: 16 is not divisible by the 3"):
        validate(from_dict(dict(BASE, mesh={"data": 3, "fsdp": 1})), 3)


# ---- CLI -----------------------------------------------------------------------------------


def test_cli_error_is_one_line_and_exit_2(tmp_path, capsys):
    path = _write(tmp_path, _merge(optimizer={"lr": "fast"}))
    assert main(["--config", path]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: optimizer.lr: expected float, got 'fast'\n"


def test_cli_help_lists_options_and_fields(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for needle in ("--config", "--set", "--dry-run", "optimizer: lr=", "train: steps="):
        assert needle in out


@pytest.mark.slow
def test_cli_dry_run_prints_sizes(capsys):
    assert main(["--config", CONFIGS[0], "--dry-run", "--set", "mesh.fsdp=-1"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "per device" in out and "8 device(s)" in out
