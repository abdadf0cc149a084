"""The dry run compiled by XLA:TPU for a ``v5e:2x2`` slice on this CPU host (``--topology``).

Tiny runs (the tiny Llama: vocabulary V=128, width D=64, MLP F=128, L=2 layers, N=4 query
and K=2 kv heads of H=16) on the slice's 4 compile-only devices: GRPO with the rollout
engine, PPO with a critic, LoRA through the CLI with ``--json``. What is checked against
numbers worked out by hand: the parameter counts, each role's bytes per device (4 bytes of
float32 per parameter, split over the 4 fsdp shards but for the 2L + 1 RMSNorm scales of D,
which every device holds whole), the donated training
state (its bytes are aliased in the compiled update: written in place), the FSDP all-gathers
among the update's collectives, every program's peak (> 0 and within a v5e chip's 16 GiB
of HBM) and that XLA:TPU is the compiler named.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from jaxrlhf.config import load_config
from jaxrlhf.sharding.topology import load_topology
from jaxrlhf.train import dry_run
from jaxrlhf.train.__main__ import main
from tests.train import helpers

pytest.importorskip("libtpu", reason="the TPU compiler is not installed: pip install -e '.[tpu]'")
pytestmark = [pytest.mark.slow, pytest.mark.tpu]

TOPOLOGY = "v5e:2x2"
CHIPS = 4
HBM = 16 * 2**30  # a v5e chip's
V, D, F, L, N, K, H = 128, 64, 128, 2, 4, 2, 16
TRUNK = V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D) + D
LM = TRUNK + D * V  # the untied LM head
NORMS = (2 * L + 1) * D  # replicated: the rules shard no norm scale
FLOAT32 = 4


def per_device(params: int) -> int:
    """Bytes per device of ``params`` float32 parameters (the norms among them whole, the
    rest over the 4 fsdp shards)."""
    return ((params - NORMS) // CHIPS + NORMS) * FLOAT32


@pytest.fixture(scope="module")
def topology():
    return load_topology(TOPOLOGY)


def _config(tmp_path, raw: dict, *overrides: str):
    path = tmp_path / f"{raw['algorithm']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path), list(overrides))


def _rl(algorithm: str, **section) -> dict:
    return {
        "algorithm": algorithm,
        "model": {"preset": "tiny", "hidden_size": D, "intermediate_size": F},
        "tokenizer": {"path": "builtin"},
        "data": {"train": "builtin:sort", "max_length": 32, "max_prompt_length": 16},
        "mesh": {"data": 1, "fsdp": -1, "tensor": 1},  # fills the slice: fsdp 4
        algorithm: section,
    }


def _check_compiled_for_the_slice(report) -> None:
    """Named as XLA:TPU's, on the slice's chips, every program's peak within one chip."""
    assert report.compiler == f"XLA:TPU {TOPOLOGY}"
    assert report.platform.startswith(f"XLA:TPU {TOPOLOGY}")
    assert report.device_kind == "TPU v5 lite" and report.devices == CHIPS
    assert f"compiled by XLA:TPU {TOPOLOGY}" in dry_run.format_report(report)
    for p in report.programs:
        assert 0 < p.peak_bytes < HBM, f"{p.phase}/{p.name}: {p.peak_bytes} B"
        assert p.cost is not None and p.cost.devices == CHIPS
    assert report.device_memory == HBM and report.fits is True


def _check_update(report, trained: list[str]) -> None:
    """The RL update takes the trained roles' states donated (aliased: updated in place)
    and all-gathers their FSDP shards over the 4 chips."""
    roles = {r.role: r for r in report.roles}
    state = sum(roles[r].param_bytes + roles[r].optimizer_bytes for r in trained)
    update = next(p for p in report.programs if (p.phase, p.name) == ("train", "update"))
    assert update.alias_bytes >= state
    assert dict(update.cost.collectives).get(CHIPS, 0) > 0
    assert update.cost.flops > 0 and update.cost.bytes_accessed > 0


def test_grpo_with_the_rollout_engine(tmp_path, topology):
    raw = _rl(
        "grpo",
        rollout={"prompts_per_step": 4, "num_samples": 4, "max_new_tokens": 16},
        reward={"function": "builtin"},
    )
    raw["grpo"]["rollout"]["engine"] = "continuous"
    cfg = _config(tmp_path, raw)
    report = dry_run.plan(cfg, topology=topology, device_memory=HBM)
    _check_compiled_for_the_slice(report)
    assert report.mesh == {"data": 1, "fsdp": CHIPS, "tensor": 1}
    roles = {r.role: r for r in report.roles}
    assert roles["policy"].params == roles["reference"].params == LM == 90_432
    assert roles["policy"].param_bytes == roles["reference"].param_bytes == per_device(LM)
    # Adam: two moments laid out as the parameters (and a step counter).
    assert 2 * per_device(LM) <= roles["policy"].optimizer_bytes <= 2 * per_device(LM) + 64
    names = {(p.phase, p.name) for p in report.programs}
    assert {("generate", "admit"), ("generate", "decode"), ("score", "score")} <= names
    assert report.engine_layout is not None and report.engine_layout.shards == CHIPS
    _check_update(report, ["policy"])


def test_ppo_with_a_critic(tmp_path, topology):
    raw = _rl(
        "ppo",
        rollout={"prompts_per_step": 8, "max_new_tokens": 8},
        loss={"epochs": 2, "num_minibatches": 2},
        reward={"function": "builtin"},
    )
    cfg = _config(tmp_path, raw)
    report = dry_run.plan(cfg, topology=topology, device_memory=HBM)
    _check_compiled_for_the_slice(report)
    roles = {r.role: r for r in report.roles}
    assert roles["value"].head == "scalar"
    assert roles["value"].params == TRUNK + D  # the trunk and a [D, 1] value head
    assert roles["policy"].param_bytes == per_device(LM)
    assert roles["value"].param_bytes == per_device(TRUNK + D)
    assert roles["value"].optimizer_bytes >= 2 * roles["value"].param_bytes
    names = {(p.phase, p.name) for p in report.programs}
    assert {("generate", "prefill"), ("generate", "decode"), ("score", "score")} <= names
    _check_update(report, ["policy", "value"])


def test_lora_through_the_cli_with_json(tmp_path, capsys):
    """SFT with rank-4 adapters on q and v: the command line's table and its JSON."""
    rank = 4
    report_path = tmp_path / "report.json"
    code = main(
        [
            "--config",
            os.path.join(helpers.CONFIGS, "tiny_sft.yaml"),
            "--dry-run",
            "--topology",
            TOPOLOGY,
            "--json",
            str(report_path),
            f"lora.rank={rank}",
            "lora.targets=[q,v]",
            "train.batch_size=8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"compiled by XLA:TPU {TOPOLOGY}" in out and "fits:" in out
    adapters = L * rank * ((D + N * H) + (D + K * H))  # A [D, r] and B [r, out] per target

    data = json.loads(report_path.read_text())
    assert data["version"] == 1 and len(data["stages"]) == 1
    stage = data["stages"][0]
    assert stage["compiler"] == f"XLA:TPU {TOPOLOGY}" and stage["topology"] == TOPOLOGY
    assert stage["device_kind"] == "TPU v5 lite" and stage["devices"] == CHIPS
    assert stage["device_memory_bytes"] == HBM and stage["fits"] is True
    roles = {r["role"]: r for r in stage["roles"]}
    assert roles["policy"]["params"] == adapters == 1_792
    assert roles["base"]["params"] == LM
    assert roles["base"]["param_bytes"] == per_device(LM)
    assert roles["base"]["optimizer_bytes"] == 0  # frozen
    programs = {(p["phase"], p["program"]): p for p in stage["programs"]}
    step = programs[("train", "train_step")]
    memory, cost = step["memory"], step["cost"]
    assert set(memory) == {
        "argument_bytes",
        "output_bytes",
        "alias_bytes",
        "temp_bytes",
        "resident_bytes",
        "peak_bytes",
        "state_bytes",
        "code_bytes",
        "compiler_peak_bytes",
    }
    assert memory["peak_bytes"] == (
        memory["argument_bytes"]
        + memory["output_bytes"]
        - memory["alias_bytes"]
        + memory["temp_bytes"]
        + memory["resident_bytes"]
    )
    assert 0 < memory["peak_bytes"] < HBM and memory["code_bytes"] > 0
    assert memory["compiler_peak_bytes"] > 0  # XLA:TPU's own figure
    assert cost["flops"] > 0 and cost["bytes_accessed"] > 0
    assert cost["collective_bytes"] == sum(c["bytes"] for c in cost["collectives"]) > 0
    assert stage["peak"]["bytes"] == max(p["memory"]["peak_bytes"] for p in stage["programs"])
