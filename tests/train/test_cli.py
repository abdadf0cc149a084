"""``python -m jaxrlhf.train`` in-process: a short run, its outputs, and user errors."""

from __future__ import annotations

import json
import os

import pytest

from jaxrlhf.train.__main__ import main
from tests.train.helpers import CONFIGS

pytestmark = pytest.mark.usefixtures("fast_compile")


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
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "hf", "metrics.jsonl"] or (
        "metrics.png" in os.listdir(tmp_path)
    )


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
