"""``python -m jaxrlhf.train`` in-process: a short run, its outputs, and user errors."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from jaxrlhf.config import load_config
from jaxrlhf.train.__main__ import main
from tests.train.helpers import CONFIGS


@pytest.mark.slow
def test_cli_short_run(tmp_path, capsys):
    rc = main(
        [
            "--config",
            os.path.join(CONFIGS, "tiny_sft.yaml"),
            "--set",
            "train.steps=2",
            f"output_dir={tmp_path}",
            "train.log_every=1",
            "logging.progress=plain",
            "data.builtin_size=64",
            "data.eval_size=16",
            "optimizer.warmup_steps=0",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "sft step 2/2 | loss/sft" in out and "eval step 2 | eval/loss/sft" in out
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    assert sorted(os.listdir(tmp_path)) == [
        ".lock",  # the run directory's lock (jaxrlhf/train/run_dir.py), free after the run
        "checkpoints",
        "config.yaml",
        "hf",
        "metrics.jsonl",
        "metrics.png",
    ]
    # The printed step-2 loss is the logged one, and the plot is a PNG.
    logged = next(r["loss/sft"] for r in rows if r["step"] == 2 and "loss/sft" in r)
    printed = float(out.split("sft step 2/2 | loss/sft ")[1].split()[0])
    assert printed == pytest.approx(logged, rel=1e-3)  # printed with 4 significant digits
    assert open(tmp_path / "metrics.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # The export holds what was trained: its config says 2 steps, and transformers' config of
    # the Hugging Face export is the tiny preset's.
    saved = yaml.safe_load(open(tmp_path / "config.yaml"))
    assert saved["train"]["steps"] == 2 and saved["output_dir"] == str(tmp_path)
    hf = json.load(open(tmp_path / "hf" / "config.json"))
    tiny = load_config(os.path.join(CONFIGS, "tiny_sft.yaml")).model.resolve()
    assert (hf["num_hidden_layers"], hf["hidden_size"]) == (tiny.num_layers, tiny.hidden_size)


def test_cli_data_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    rc = main(
        [
            "--config",
            os.path.join(CONFIGS, "tiny_sft.yaml"),
            f"data.train={bad}",
            f"output_dir={tmp_path}",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {bad}:2: malformed JSON line (Expecting property name enclosed in double"
        " quotes at column 2)\n"
    )


_TINY_GRPO = """\
algorithm: grpo
model: {preset: tiny}
tokenizer: {path: builtin}
data: {train: "builtin:sort", eval_size: 0, max_length: 32, max_prompt_length: 16, builtin_size: 64}
train: {steps: 2, log_every: 1}
logging: {progress: plain}
checkpoint: {export_hf: false}
grpo:
  rollout: {prompts_per_step: 4, num_samples: 2, max_new_tokens: 6}
  reward: {function: builtin}
"""
_PLACED = [
    "placement.cpu_devices=2",
    "placement.train_devices=1",
    "placement.generate_mesh={data: -1, fsdp: 1}",
]


@pytest.mark.slow
def test_cli_sets_cpu_devices_before_jax_starts(tmp_path):
    """A fresh process (JAX's default: one CPU device): the CLI asks JAX for the config's two
    CPU devices, trains on the first and samples on both; its compiled programs go to the
    persistent cache it was given."""
    import subprocess
    import sys

    config = tmp_path / "grpo.yaml"
    config.write_text(_TINY_GRPO)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    env.pop("XLA_FLAGS", None)
    # The run's persistent compilation cache, in a directory of this test's own.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAXRLHF_COMPILATION_CACHE"] = str(tmp_path / "xla-cache")
    cmd = [sys.executable, "-m", "jaxrlhf.train", "--config", str(config)]
    out = subprocess.run(
        [*cmd, f"output_dir={tmp_path / 'run'}", *_PLACED],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stdout + out.stderr
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1} (sampler: {'data': 2, 'fsdp': 1," in log
    assert f"compilation cache: {tmp_path / 'xla-cache'}" in log
    # The programs it compiled (JAX names each entry ``<key>-cache``).
    assert len([f for f in os.listdir(tmp_path / "xla-cache") if f.endswith("-cache")]) > 5
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # Each iteration copies the policy from device 0 to device 1: 26,784 float32 parameters.
    assert [r["reshard/bytes_moved"] for r in rows if "reshard/bytes_moved" in r] == [107136.0] * 2


def test_cli_cpu_devices_after_jax_started_is_one_line(tmp_path, capsys):
    import jax

    assert jax.device_count() == 8  # this test process has started JAX (conftest: 8 devices)
    config = tmp_path / "grpo.yaml"
    config.write_text(_TINY_GRPO)
    rc = main(["--config", str(config), f"output_dir={tmp_path / 'run'}", *_PLACED])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: placement.cpu_devices: 2 asked, but JAX started with 8 CPU")
    assert err.count("\n") == 1


def test_pipeline_stages_must_agree_on_cpu_devices(tmp_path):
    from jaxrlhf.config import ConfigError
    from jaxrlhf.train.pipeline import requested_cpu_devices

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("algorithm: sft\nplacement: {cpu_devices: 2}\n")
    b.write_text("algorithm: grpo\n")
    assert requested_cpu_devices([str(a), str(b)], []) == 2
    assert requested_cpu_devices([str(b)], []) is None
    assert requested_cpu_devices([str(b)], ["placement.cpu_devices=4"]) == 4
    b.write_text("algorithm: grpo\nplacement: {cpu_devices: 3}\n")
    with pytest.raises(ConfigError, match=r"differs between pipeline stages \(.*a.yaml: 2, .*b"):
        requested_cpu_devices([str(a), str(b)], [])
