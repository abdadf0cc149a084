"""Metric sinks, progress lines and the plot; optional packages are never required."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from jaxrlhf.train.config import LoggingConfig
from jaxrlhf.train.metrics import MetricsLogger, Progress, plot_history

HISTORY = [
    {"step": 0, "eval/loss/sft": 4.0},
    {"step": 10, "loss/sft": 3.0, "lr": 1e-3},
    {"step": 20, "loss/sft": 2.0, "lr": 5e-4},
    {"step": 20, "eval/loss/sft": 2.5},
]


def test_jsonl_rows(tmp_path):
    log = MetricsLogger(str(tmp_path), LoggingConfig(), {})
    log.log(10, {"loss/sft": 3, "lr": 1e-3})
    log.log(20, {"loss/sft": 2.5})
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 10, "loss/sft": 3, "lr": 1e-3}, {"step": 20, "loss/sft": 2.5}]
    assert log.history == rows


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is not None
    or importlib.util.find_spec("tensorboardX") is not None
    or importlib.util.find_spec("tensorboard") is not None,
    reason="an optional logger is installed",
)
def test_missing_optional_loggers_are_skipped_with_a_note(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        log = MetricsLogger(str(tmp_path), LoggingConfig(tensorboard=True, wandb=True), {})
    log.log(1, {"x": 1.0})
    log.close()
    assert "wandb is not installed; skipping W&B logging" in caplog.text
    assert "skipping TensorBoard logging" in caplog.text


def test_plain_progress_lines(capsys):
    progress = Progress("plain", total=20, description="sft")
    progress.update(5)  # not a logging step: silent
    progress.update(10, {"loss/sft": 3.0, "lr": 1e-3, "other": 1.0}, keys=("loss/sft", "lr"))
    progress.write("eval step 10 | eval/loss/sft 2.5")
    progress.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("sft step 10/20 | loss/sft 3 | lr 0.001 | ")
    assert out[1] == "eval step 10 | eval/loss/sft 2.5"


@pytest.mark.parametrize("mode", ["rich", "tqdm"])
def test_bar_progress(mode, capsys):
    """The bar ends at 3 of 3 steps with the last logged metrics, and a line written through
    it stands on a line of its own."""
    pytest.importorskip(mode)
    progress = Progress(mode, total=3, description="rm")
    for step in range(1, 4):
        progress.update(step, {"loss/rm": step / 4}, keys=("loss/rm",))
    progress.write("eval step 3 | eval/loss/rm 0.9")
    progress.close()
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "3/3" in out and "loss/rm 0.75" in out
    assert "\neval step 3 | eval/loss/rm 0.9\n" in "\n" + out.replace("\r", "\n")


def test_plot(tmp_path, caplog):
    path = str(tmp_path / "metrics.png")
    if importlib.util.find_spec("matplotlib") is None:
        with caplog.at_level(logging.INFO):
            assert plot_history(HISTORY, ("loss/sft", "lr"), path) is None
        assert "plot skipped: matplotlib is not installed" in caplog.text
    else:
        assert plot_history(HISTORY, ("loss/sft", "lr"), path) == path
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_panels_labels_and_title():
    pytest.importorskip("matplotlib")
    from jaxrlhf.train.metrics import history_figure

    fig = history_figure(HISTORY, ("loss/sft", "lr", "absent"), title="runs/quickstart/sft")
    assert fig._suptitle.get_text() == "runs/quickstart/sft"
    loss, lr = fig.axes  # "absent" is never logged: no panel
    assert [(ax.get_title(), ax.get_ylabel(), ax.get_xlabel()) for ax in (loss, lr)] == [
        ("loss/sft", "loss/sft", "step"),
        ("lr", "lr", "step"),
    ]
    # The curves are the logged values: train from "loss/sft", eval from "eval/loss/sft".
    lines = {line.get_label(): line.get_xydata().tolist() for line in loss.get_lines()}
    assert lines == {"train": [[10, 3.0], [20, 2.0]], "eval": [[0, 4.0], [20, 2.5]]}
    assert history_figure(HISTORY, ("lr",))._suptitle is None
