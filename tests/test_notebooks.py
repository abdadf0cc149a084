"""The notebooks run top to bottom on CPU, as a user would run them.

Each notebook is executed in a fresh Jupyter kernel (nbclient + ipykernel) with this
checkout first on ``PYTHONPATH``, ``JAX_PLATFORMS=cpu`` and a temporary working directory.
``JAXRLHF_NOTEBOOK_SMOKE=1`` shrinks the quickstart to a few steps per stage and makes the
TPU/GPU recipe take its CPU fallback (a tiny model written to and loaded from a local
Hugging Face directory); nothing is downloaded. The kernel is a separate process, so the 8
fake devices of ``conftest.py`` do not apply there: the recipe sets its own.

An error in any cell fails the test with that cell's source and traceback. After the last
cell the test runs one extra *probe* cell in the same kernel that prints a JSON summary of
the notebook's results (the variable names it reads are part of the contract), and checks
that the training actually produced what the notebook claims.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT_S = 600  # one cell; a quickstart stage compiles for ~20-40 s on 2 busy cores
PROBE_MARKER = "NOTEBOOK-PROBE:"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

pytestmark = pytest.mark.slow


def _kernel_env(work_dir: Path) -> dict[str, str]:
    # Hermetic: a developer's own settings (JAXRLHF_MODEL, ...) must not reach the notebooks.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRLHF_")}
    env.update(
        JAXRLHF_NOTEBOOK_SMOKE="1",
        JAXRLHF_NOTEBOOK_WORK_DIR=str(work_dir / "runs"),
        JAX_PLATFORMS="cpu",
        # Plots must come back as cell outputs whatever backend the test process was given.
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    )
    env.pop("XLA_FLAGS", None)  # a notebook chooses its own CPU device count
    return env


def run_notebook(name: str, work_dir: Path, probe: str) -> tuple[dict, object]:
    """Executes notebooks/``name``, then ``probe`` (code that sets ``PROBE`` from the
    notebook's variables) in the same kernel; returns ``PROBE`` (through JSON) and the
    executed notebook without the probe cell."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    n_cells = len(nb.cells)
    probe_source = f"{probe}\nimport json\nprint({PROBE_MARKER!r} + json.dumps(PROBE))"
    nb.cells.append(nbformat.v4.new_code_cell(probe_source))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(work_dir)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    try:
        client.execute(env=_kernel_env(work_dir))
    except nbclient.exceptions.CellExecutionError as e:
        # The message holds the failing cell's source and its traceback (IPython colours it).
        pytest.fail(f"{name}: a cell failed\n{ANSI_ESCAPE.sub('', str(e))}", pytrace=False)
    seconds = time.perf_counter() - start
    outputs = [o for o in nb.cells[-1].outputs if o.get("output_type") == "stream"]
    text = "".join(o["text"] for o in outputs)
    assert PROBE_MARKER in text, f"{name}: the probe printed nothing: {text!r}"
    nb.cells = nb.cells[:n_cells]
    print(f"{name}: {seconds:.1f} s")  # shown with pytest -s
    return json.loads(text.split(PROBE_MARKER, 1)[1]), nb


def _images(nb) -> int:
    return sum(
        "image/png" in o.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
    )


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_stored_clean(path):
    """Committed without outputs, so reviews see only sources (and nothing stale)."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {i}"
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert "pip" in first_code.source and "find_spec" in first_code.source, (
        f"{path.name}: the first code cell must install jaxrlhf when it is missing"
    )


# Fields the quickstart notebook points at its own WORK_DIR, or sets from its settings cell.
QUICKSTART_OWN_FIELDS = ("output_dir", "model.hf_dir", "ppo.reward.model_dir", "train.steps")
QUICKSTART_FILES = {
    "sft": ("sft.yaml", "grpo_sft.yaml"),
    "rm": ("rm.yaml",),
    "ppo": ("ppo.yaml",),
    "grpo": ("grpo.yaml",),
    "tool_sft": ("tool_sft.yaml",),
    "tool_grpo": ("tool_grpo.yaml",),
}


def test_quickstart_notebook(tmp_path):
    probe = """
from jaxrlhf.config import to_dict
PROBE = {
    "configs": {
        name: to_dict(from_dict(cfg))
        for name, cfg in {
            "sft": SFT, "rm": RM, "ppo": PPO, "grpo": GRPO,
            "tool_sft": TOOL_SFT, "tool_grpo": TOOL_GRPO,
        }.items()
    },
    "tool_history": tools.history,
    "algorithm": ALGORITHM,
    "steps": STEPS,
    "stages": list(results),
    "rl_history": rl.history,
    "answers": {name: len(completions) for name, completions in policies.items()},
}"""
    result, nb = run_notebook("01_quickstart.ipynb", tmp_path, probe)
    assert result["algorithm"] == "ppo"
    assert result["stages"] == ["sft", "rm", "rl", "tool_sft", "tool_rl"]
    history = result["rl_history"]
    assert len(history) == result["steps"]["rl"]
    for key in ("reward/mean", "reward/task_mean", "kl/seq_mean", "response/length_mean"):
        assert all(key in row for row in history), key
    assert history[-1]["kl/seq_mean"] > 0  # the policy moved away from the reference
    assert result["answers"] == {"SFT": 64, "PPO": 64}
    # The tool section's GRPO ran multi-turn episodes through the calculator environment.
    tool_history = result["tool_history"]
    assert len(tool_history) == result["steps"]["tool_rl"]
    for key in ("env/tool_use_rate", "reward/task_mean"):
        assert all(0 <= row[key] <= 1 for row in tool_history), key
    assert _images(nb) >= 3  # RL curves, the SFT/RM curves and the tool-use curves
    assert (tmp_path / "runs" / "ppo" / "hf" / "config.json").exists()

    # The notebook trains what `python -m jaxrlhf.train --config configs/quickstart.yaml`
    # (and grpo_quickstart.yaml) trains: its stage configs, resolved, equal the YAML files
    # resolved with the notebook's paths and step counts.
    from jaxrlhf.config import load_config, to_dict, validate

    for name, notebook_cfg in result["configs"].items():
        got = _flatten(notebook_cfg)
        overrides = [f"{k}={got[k]}" for k in QUICKSTART_OWN_FIELDS if got.get(k) is not None]
        for filename in QUICKSTART_FILES[name]:
            path = ROOT / "configs" / "quickstart" / filename
            loaded = load_config(str(path), overrides)
            validate(loaded, 1, source=str(path))  # every stage validates on one device
            want = _flatten(to_dict(loaded))
            differ = {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys()}
            differ = {k: v for k, v in differ.items() if v[0] != v[1]}
            assert not differ, f"notebook {name} vs {path.name} (notebook, file): {differ}"


def test_losses_notebook(tmp_path):
    probe = (
        "PROBE = {'grpo': grpo_history, 'ppo': ppo_history, "
        "'dpo': {k: v[-1] for k, v in dpo_histories.items()}}"
    )
    result, nb = run_notebook("02_losses_in_research_code.ipynb", tmp_path, probe)
    for name in ("grpo", "ppo"):
        rewards = [row["reward"] for row in result[name]]
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        # From a uniform policy (reward ~0.1) to nearly always the right answer.
        assert last > 0.8 and last > first + 0.5, (name, first, last)
    for loss_type, row in result["dpo"].items():
        assert row["rewards/accuracy"] > 0.9, (loss_type, row)
    assert _images(nb) == 2  # RL curves and DPO curves


def test_tpu_gpu_recipe_notebook_cpu_fallback(tmp_path):
    probe = (
        "PROBE = {'real': REAL, 'mesh': dict(mesh.shape), 'history': history, "
        "'moved': stats.bytes_moved, 'predicted': predicted, "
        "'export': sorted(os.listdir(export_dir))}"
    )
    result, nb = run_notebook("03_tpu_gpu_grpo_recipe.ipynb", tmp_path, probe)
    assert result["real"] is False  # smoke mode never downloads
    assert result["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    # Train (FSDP x tensor) -> generate (tensor only) gathers the FSDP shards.
    assert result["moved"] == result["predicted"] > 0
    assert len(result["history"]) == 3
    for key in ("reward/mean", "kl/seq_mean", "response/length_mean", "reshard/bytes_moved"):
        assert all(key in row for row in result["history"]), key
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(result["export"])
    assert _images(nb) == 1
