"""The planner end to end on a tiny GRPO run: the command, its table and overlay, the
depth extrapolation against a full-depth compile, and its one-line errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import yaml

from jaxrlhf.config import from_dict, merge_configs
from jaxrlhf.models import model as model_lib
from jaxrlhf.plan import __main__ as plan_cli
from jaxrlhf.plan import candidates, estimate
from jaxrlhf.plan.hardware import Cluster, DeviceSpec
from jaxrlhf.plan.lengths import BUDGET, engine_chunks, parse_lengths
from jaxrlhf.plan.planner import read_run
from jaxrlhf.train.program_cost import ProgramCost, roofline_seconds

RUN = {
    "algorithm": "grpo",
    "model": {"preset": "tiny", "num_layers": 4},
    "data": {"max_length": 32, "max_prompt_length": 16, "eval_size": 0},
    "grpo": {
        "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_new_tokens": 16},
        "reward": {"function": "builtin"},
    },
}
HOST = DeviceSpec("cpu", 100e9, 20e9, 20e9, 20e9, 16 * 2**30, 1 << 16)


@pytest.fixture
def run_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RUN))
    return str(path)


@pytest.mark.slow
def test_plan_command_ranks_plans_and_writes_a_runnable_overlay(run_yaml, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    code = plan_cli.main(["--config", run_yaml, "--cluster", "cpu-2", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    table = text.split("plan\n", 1)[1].split("\n\n", 1)[0].splitlines()
    seconds = [float(line.split()[1]) for line in table]
    assert seconds == sorted(seconds) and len(seconds) >= 4
    assert any("separated sampler 1:d1 learner 1:d1, staleness 1" in line for line in table)
    # The overlay merges into the run as a valid config naming the best plan's placement.
    overlay = yaml.safe_load(out.read_text())
    cfg = from_dict(merge_configs(read_run([run_yaml], []), overlay))
    assert cfg.placement.cpu_devices == 2
    assert candidates.describe(overlay, "grpo") in table[0]


def _separated(staleness: int) -> dict:
    one = {"data": 1, "fsdp": 1, "tensor": 1}
    return {
        "placement": {
            "cpu_devices": 2,
            "strategy": "separated",
            "sampler": {"devices": [0], "mesh": one},
            "learner": {"devices": [1], "mesh": one},
        },
        "mesh": one,
        "grpo": {"rollout": {"max_staleness": staleness}},
    }


@pytest.mark.slow
def test_staleness_overlaps_the_sampler_and_the_learner():
    """One compile prices every staleness bound; at 1 the period is the slower side's,
    at 0 the sum of the phases (hand-checked from the predicted phases)."""
    cluster = Cluster(dataclasses.replace(HOST, name="accelerator"), 2)  # not a shared host
    sync_cfg = from_dict(merge_configs(RUN, _separated(0)))
    compiled = estimate.compile_plan(sync_cfg)
    model = estimate.CostModel()
    sync = estimate.estimate(sync_cfg, cluster, model, compiled=compiled)
    stale_cfg = from_dict(merge_configs(RUN, _separated(1)))
    stale = estimate.estimate(stale_cfg, cluster, model, compiled=compiled)
    ph = sync.phases
    assert sync.iteration_s == pytest.approx(sum(ph.values()))
    learner, sampler = ph["score"] + ph["train"], ph["generate"] + ph["sync"]
    assert stale.iteration_s == pytest.approx(max(learner, sampler))
    assert stale.idle_fraction == pytest.approx(1 - (learner + sampler) / 2 / max(learner, sampler))
    assert sync.groups == {"sampler": 1, "learner": 1}
    # The whole float32 policy moves to the sampler's device at each sync.
    policy = model_lib.param_count(model_lib.abstract_params(sync_cfg.model.resolve()))
    assert sync.reshard_bytes == 4 * policy


@pytest.mark.slow
def test_the_reference_on_the_sampler_moves_its_forward_to_the_sampler():
    """``placement.reference: sampler``: the reference's forward is priced on the sampler's
    side (a ``generate/reference`` program at scoring's efficiency) and leaves the
    learner's score program; the learner's state floor loses a copy of the policy."""
    cluster = Cluster(dataclasses.replace(HOST, name="accelerator"), 2)
    model = estimate.CostModel()
    out = {}
    for place in ("learner", "sampler"):
        overlay = merge_configs(_separated(1), {"placement": {"reference": place}})
        cfg = from_dict(merge_configs(RUN, overlay))
        out[place] = (cfg, estimate.estimate(cfg, cluster, model))
    (cfg_l, learner), (cfg_s, sampler) = out["learner"], out["sampler"]
    forward = next(p for p in sampler.programs if (p.phase, p.name) == ("generate", "reference"))
    score = {p.name: p for p in learner.programs}["score"]
    left = {p.name: p for p in sampler.programs}["score"]
    assert not any(p.name == "reference" for p in learner.programs)
    # This run's scoring is the reference's forward alone (one minibatch: the update's
    # forward gives the old log-probs), so it moves whole: the learner's score program
    # keeps only the advantages.
    assert forward.cost.flops == pytest.approx(score.cost.flops, rel=0.01)
    assert left.cost.flops < 0.01 * score.cost.flops
    moved = forward.seconds
    assert sampler.phases["generate"] == pytest.approx(learner.phases["generate"] + moved)
    assert sampler.phases["score"] == pytest.approx(
        learner.phases["score"] - moved, abs=0.01 * moved
    )
    lm = model_lib.param_count(model_lib.abstract_params(cfg_l.model.resolve()))
    assert estimate.state_floor(cfg_l) - estimate.state_floor(cfg_s) == 4 * lm
    assert "reference on the sampler" in candidates.describe(overlay, "grpo")


@pytest.mark.slow
def test_depth_extrapolation_matches_a_full_depth_compile(monkeypatch):
    """A 6-layer model priced as a deep one (shallow compiles, extrapolated) against its
    full-depth compiles: FLOPs within 1% of the unrolled model's (layers are identical;
    XLA's cost analysis counts a scanned body once, so the unrolled one is the reference),
    bytes accessed within 15% (fusion differs slightly with depth), peak memory within 2%
    of the scanned model's (the loop a deep model runs)."""
    base = merge_configs(
        RUN, {"mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "model": {"num_layers": 6}}
    )
    unrolled = estimate.compile_plan(
        from_dict(merge_configs(base, {"model": {"layer_loop": "unroll"}}))
    )
    scanned = estimate.compile_plan(
        from_dict(merge_configs(base, {"model": {"layer_loop": "scan"}}))
    )
    monkeypatch.setattr(estimate, "FULL_DEPTH_LAYERS", 1)
    guessed = estimate.compile_plan(from_dict(base))
    for real, loop, guess in zip(
        unrolled.programs, scanned.programs, guessed.programs, strict=True
    ):
        assert real[:3] == guess[:3]
        assert guess[3].flops == pytest.approx(real[3].flops, rel=0.01), real[1]
        assert guess[3].bytes_accessed == pytest.approx(real[3].bytes_accessed, rel=0.15)
        assert guess[4] == pytest.approx(loop[4], rel=0.02), real[1]


@pytest.mark.slow
def test_runs_per_iteration_follow_the_config():
    cfg = from_dict({**RUN, "mesh": {"data": 1, "fsdp": 1, "tensor": 1}})
    runs = {(p[0], p[1]): p[2] for p in estimate.compile_plan(cfg).programs}
    assert runs[("generate", "prefill")] == 1
    assert runs[("generate", "decode")] == 16  # max_new_tokens steps
    assert runs[("train", "update")] == 1
    two = dataclasses.replace(cfg.grpo.loss, epochs=2, num_minibatches=2)
    cfg2 = cfg.replace(grpo=dataclasses.replace(cfg.grpo, loss=two))
    runs = {(p[0], p[1]): p[2] for p in estimate.compile_plan(cfg2).programs}
    assert runs[("train", "update")] == 4  # epochs x minibatches


def test_view_step_costs_separate_the_body_from_the_views_copies():
    """A chunk program's cost is one decode step (XLA counts a loop's body once) plus, for a
    view, what it moves once per chunk. Programs built here from body ``10 + 2 r + 0.5 r
    w`` in every field plus, in bytes only, ``40 + 4 * 3 r (P + w)`` for views (3 KV bytes
    per slot and position, P = 4): the whole state (8 slots, width 16) and four views (the
    whole state's own shape among them). A step on a 4 x 8 view costs its body, 10 + 8 +
    16 = 34, and in bytes also the copies over a chunk of 6 steps, (40 + 12 * 4 * 12) / 6
    = 102.67 (by hand)."""

    def program(r, w, view=True):
        body = 10 + 2 * r + 0.5 * r * w
        return ProgramCost(body, body + (40 + 12 * r * (4 + w) if view else 0), ((2, body),), 2)

    views = {v: program(*v) for v in ((8, 8), (1, 16), (8, 4), (8, 16))}
    model = estimate.view_cost_model(program(8, 16, view=False), views, 8, 16, 4, 6, 3)
    got = model(4, 8)
    assert (got.flops, got.bytes_accessed, got.collectives[0][1]) == pytest.approx(
        (34, 34 + (40 + 12 * 4 * 12) / 6, 34)
    )
    assert got.collectives[0][0] == got.devices == 2
    # Three points (one view besides the whole state's own shape, as a dry run with one
    # smaller view compiles): the per-row term is left out, the pass-through kept; exact
    # along the full width, where r w carries the rows: body 10 + 8 + 32 = 50 at 4 x 16.
    few = {v: program(*v) for v in ((1, 16), (8, 16))}
    three = estimate.view_cost_model(program(8, 16, view=False), few, 8, 16, 4, 6, 3)
    got = three(4, 16)
    assert (got.flops, got.bytes_accessed) == pytest.approx((50, 50 + (40 + 12 * 4 * 20) / 6))


def test_plans_of_an_interleaved_run_are_valid_runs():
    """A run configured with its reference on a group of its own (``interleaved``): every
    layout the planner derives from it is a valid config (its own placement fields, the
    reference's group among them, do not leak into the plans)."""
    own = {
        "strategy": "interleaved",
        "reference": "own",
        "reference_group": {"devices": [1]},
        "learner": {"devices": [0]},
    }
    cfg = from_dict(merge_configs(RUN, {"placement": own}))
    overlays = list(candidates.layouts(cfg, 2, cpu=True))
    assert len(overlays) > 2
    for overlay in overlays:
        placement = from_dict(merge_configs(RUN, {"placement": own}, overlay)).placement
        if placement.strategy == "interleaved":  # GRPO: the reference's group, no critic
            assert placement.reference == "own" and placement.critic is None
            assert placement.reference_group.devices == (0,)
            assert placement.learner.devices == (1,)
        else:
            assert placement.reference_group is None and placement.reference != "own"
    assert sum(o["placement"]["strategy"] == "interleaved" for o in overlays) == 1


PPO_RUN = {
    "algorithm": "ppo",
    "model": {"preset": "tiny", "num_layers": 4},
    "data": {"max_length": 32, "max_prompt_length": 16, "eval_size": 0},
    "ppo": {
        "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_new_tokens": 16},
        "reward": {"function": "builtin"},
    },
}


ONE = {"data": 1, "fsdp": 1, "tensor": 1}
INTERLEAVED_CRITIC = {  # the learner (policy, sampler) on device 0, the critic on device 1
    "placement": {
        "cpu_devices": 2,
        "strategy": "interleaved",
        "learner": {"devices": [0], "mesh": ONE},
        "critic": {"devices": [1], "mesh": ONE},
    },
    "mesh": ONE,
}


@pytest.mark.slow
def test_an_interleaved_critic_is_priced_on_its_own_group():
    """PPO with the critic on a group of its own (``interleaved``, the learner on device 0,
    the critic on device 1) against the same run colocated on one device: the critic's value
    forward and update are programs of the ``critic`` group (the dry run compiles them on
    its mesh), the two updates' FLOPs add up to the joint update's, the critic's programs
    hold the critic's state only, and the period is generate + the slower of each pair of
    phases running at once (independent devices: hand-checked from the predicted phases).
    The learner's state floor loses the critic's parameters and Adam moments."""
    one = {"data": 1, "fsdp": 1, "tensor": 1}
    alone = {"placement": {"cpu_devices": 2, "train_devices": 1}, "mesh": one}
    cluster = Cluster(dataclasses.replace(HOST, name="accelerator"), 2)
    model = estimate.CostModel()
    cfg_i = from_dict(merge_configs(PPO_RUN, INTERLEAVED_CRITIC))
    cfg_c = from_dict(merge_configs(PPO_RUN, alone))
    split, joint = (estimate.estimate(c, cluster, model) for c in (cfg_i, cfg_c))
    assert split.groups == {"learner": 1, "critic": 1}
    programs = {(p.phase, p.name): p for p in split.programs}
    critic = {k for k, p in programs.items() if p.group == "critic"}
    assert critic == {("score", "values"), ("train", "update.critic")}
    update = {p.name: p for p in joint.programs}["update"]
    both = (
        programs[("train", "update")].cost.flops + programs[("train", "update.critic")].cost.flops
    )
    assert both == pytest.approx(update.cost.flops, rel=0.01)
    ph = split.phases
    assert ph["score:critic"] == pytest.approx(programs[("score", "values")].seconds)
    assert ph["train:critic"] == pytest.approx(programs[("train", "update.critic")].seconds)
    assert ph["train"] == pytest.approx(programs[("train", "update")].seconds)
    period = (
        ph["generate"]
        + ph["sync"]
        + max(ph["score"], ph["score:critic"])
        + max(ph["train"], ph["train:critic"])
    )
    assert split.iteration_s == pytest.approx(period)
    # The critic's group holds its own state: its update's peak is below the policy's.
    assert (
        programs[("train", "update.critic")].peak_bytes < programs[("train", "update")].peak_bytes
    )
    scalar = model_lib.param_count(model_lib.abstract_params(cfg_i.model.resolve(), "scalar"))
    assert estimate.state_floor(cfg_c) - estimate.state_floor(cfg_i) == 3 * 4 * scalar
    # The planner offers it among a 2-device cluster's layouts.
    layouts = list(candidates.layouts(from_dict(PPO_RUN), 2, cpu=True))
    labels = [candidates.describe(o, "ppo") for o in layouts]
    assert "interleaved learner 1:d1 critic 1:d1" in labels
    assert "interleaved learner 1:d1 reference 1:d1" in labels


def _packed_rows(lengths, rows, prompt, budget, n):
    """Host rollout rows as the planner builds them: prompt groups of ``n`` with one
    full-length prompt each, responses of ``lengths``."""
    mask = np.zeros((rows, prompt + budget), bool)
    mask[:, :prompt] = True
    mask[:, prompt:] = np.arange(budget)[None] < np.asarray(lengths)[:, None]
    tokens = np.where(mask, 1, 0).astype(np.int32)
    tokens[:, :prompt] = 1 + np.arange(rows)[:, None] // n
    return tokens, mask


@pytest.mark.slow
def test_packed_phases_are_priced_at_the_packed_size_of_the_lengths():
    """With a length distribution, sequence-packed scoring and the update cost what they
    cost compiled at the packed size the trainer's packing planner picks for those rows (a
    pass is not affine in the packed rows: each size is compiled); an interleaved critic's
    forward and update (packed by the same plan) scale by the learner's ratio; the budget's
    full-length samples keep the largest size (the extra compiles change nothing there)."""
    cfg = from_dict(merge_configs(PPO_RUN, INTERLEAVED_CRITIC))  # 8 rows, 16 + 16 tokens
    cluster = Cluster(dataclasses.replace(HOST, name="accelerator"), 2)
    model = estimate.CostModel()
    both = estimate.compile_plan(cfg, packed_sizes=True)
    largest = estimate.compile_plan(cfg)
    costs = {(ph, name): c for ph, name, _, c, _ in both.programs}
    sizes = [int(name.split("@")[1]) for ph, name in costs if name.startswith("update@")]
    assert sorted(sizes) == [2, 4, 6]  # below the largest, 8 (4 buckets: bucket_sizes)
    budget = estimate.estimate(cfg, cluster, model, compiled=both)
    plain = estimate.estimate(cfg, cluster, model, compiled=largest)
    assert budget.phases == pytest.approx(plain.phases)
    tail = parse_lengths("lognormal:3,1.0")
    short = estimate.estimate(cfg, cluster, model, compiled=both, lengths=tail)
    tokens, mask = _packed_rows(tail.lengths(8, 16), 8, 16, 16, 2)
    priced = {(p.phase, p.name): p for p in short.programs}
    for phase, name, side, plan in (
        ("score", "score", "values", both.packing.score(tokens, mask)),
        ("train", "update", "update.critic", both.packing.update(tokens, mask, jax.random.key(0))),
    ):
        m = plan.rows
        assert m < 8, (phase, m)
        at, high = costs[(phase, f"{name}@{m}")], costs[(phase, name)]

        def seconds(c, phase=phase):
            return roofline_seconds(
                c, HOST.peak_flops, HOST.memory_bandwidth, HOST.link_for
            ) / model.efficiency_of(phase, 1)

        assert priced[(phase, name)].seconds == pytest.approx(seconds(at), rel=1e-6)
        ratio = at.flops / high.flops, at.bytes_accessed / high.bytes_accessed
        c = costs[(phase, side)]
        want = ProgramCost(c.flops * ratio[0], c.bytes_accessed * ratio[1], (), 1)
        assert priced[(phase, side)].seconds == pytest.approx(seconds(want), rel=1e-6)
        assert short.phases[phase] < 0.9 * budget.phases[phase]


@pytest.mark.slow
def test_engine_generation_is_priced_on_the_length_distribution():
    """With the rollout engine, the decode program's runs are the chunks the engine would run
    on the lengths (``lengths.engine_chunks``) times its steps per chunk, and the admission
    program's its admissions: shorter samples cost less, and a ragged tail's chunks, on
    smaller views, less than the whole state's. The static sampler's decode runs
    max_new_tokens steps whatever the lengths."""
    engine = {"engine": "continuous", "slots": 4, "chunk_tokens": 2, "stream_scoring": False}
    one_device = {"mesh": {"data": 1, "fsdp": 1, "tensor": 1}}
    cfg = from_dict(merge_configs(RUN, {"grpo": {"rollout": engine}, **one_device}))
    cluster = Cluster(dataclasses.replace(HOST, name="accelerator"), 1)
    model = estimate.CostModel()
    compiled = estimate.compile_plan(cfg)
    tail = parse_lengths("lognormal:3,1.0")
    full = estimate.estimate(cfg, cluster, model, compiled=compiled)
    short = estimate.estimate(cfg, cluster, model, compiled=compiled, lengths=tail)
    runs = {(p.phase, p.name): p for p in short.programs}
    budget_runs = {(p.phase, p.name): p for p in full.programs}
    chunks, admits = engine_chunks(tail.lengths(8, 16), 4, 2, 2)
    assert runs[("generate", "decode")].runs == 2 * chunks
    assert runs[("generate", "admit")].runs == admits
    assert budget_runs[("generate", "decode")].runs == 2 * 16  # 2 waves of 16 steps
    # Each chunk at most the whole state's cost; the tail's views cost less.
    per_run = budget_runs[("generate", "decode")].seconds / (2 * 16)
    assert 0 < runs[("generate", "decode")].seconds < 2 * chunks * per_run
    assert short.phases["generate"] < full.phases["generate"]
    static = from_dict(merge_configs(RUN, one_device))
    static_compiled = estimate.compile_plan(static)
    a, b = (
        estimate.estimate(static, cluster, model, compiled=static_compiled, lengths=x)
        for x in (BUDGET, tail)
    )
    assert a.phases == b.phases
    # Slots are a memory knob: halved down to one prompt group's.
    slots = [v for v in candidates.memory_variants(cfg) if "grpo" in v]
    assert slots == [{"grpo": {"rollout": {"slots": 2}}}]
    assert "slots 2" in candidates.describe(slots[0], "grpo")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cluster", "v100x8"], "unknown device kind 'v100'"),
        (["--cluster", "h100x8", "--calibrate"], "--calibrate times plans on this machine"),
        (["--cluster", "cpu-2", "--top", "0"], "--top and --calibrate-plans must be >= 1"),
        (["--cluster", "h100x8", "--lengths", "normal:3"], "--lengths: expected 'budget' or"),
        (
            ["--cluster", "cpu-1", "--strategies", "interleaved"],
            "--strategies interleaved: no such layout of this run on 1 x cpu",
        ),
    ],
)
def test_command_line_errors_are_one_line(run_yaml, argv, message, capsys):
    assert plan_cli.main(["--config", run_yaml, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.slow
def test_plan_command_searches_only_the_strategies_asked_for(tmp_path, capsys):
    """``--strategies interleaved`` on a PPO run over two CPU devices: the table holds the
    two interleaved plans only (the critic's group, the reference's), the overlay is one of
    them and merges into a valid run, and the comparison with flat is still printed."""
    run = tmp_path / "ppo.yaml"
    run.write_text(yaml.safe_dump(PPO_RUN))
    out = tmp_path / "plan.yaml"
    argv = ["--config", str(run), "--cluster", "cpu-2", "--strategies", "interleaved"]
    assert plan_cli.main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    table = text.split("plan\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(table) == 2 and all("interleaved learner 1:d1" in line for line in table)
    assert any("critic 1:d1" in line and "beside: score:critic" in line for line in table)
    assert "best plan vs flat" in text
    overlay = yaml.safe_load(out.read_text())
    assert overlay["placement"]["strategy"] == "interleaved"
    cfg = from_dict(merge_configs(read_run([str(run)], []), overlay))
    assert cfg.placement.cpu_devices == 2


def test_supervised_runs_are_refused(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "sft", "model": {"preset": "tiny"}}))
    assert plan_cli.main(["--config", str(path), "--cluster", "cpu-2"]) == 2
    assert "the planner plans RL runs" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_fits_saves_and_reuses_the_cost_model(run_yaml, tmp_path, capsys):
    """--calibrate on one CPU device: runs the best plan for 4 iterations, fits the model,
    writes it (tied to its cluster) and re-ranks; a later run reads it; another cluster
    refuses it in one line."""
    import json

    model = tmp_path / "model.json"
    argv = ["--config", run_yaml, "--cluster", "cpu-1", "--cost-model", str(model)]
    assert (
        plan_cli.main([*argv, "--calibrate", "--calibrate-plans", "1", "--calibrate-steps", "4"])
        == 0
    )
    out = capsys.readouterr().out
    saved = json.loads(model.read_text())
    assert saved["cluster"] == "1 x cpu"
    assert all(saved["efficiency"][p] > 0 for p in ("generate", "score", "train"))
    assert "cost model calibrated on" in out
    assert plan_cli.main(argv) == 0
    assert "cost model calibrated on" in capsys.readouterr().out
    other = ["--config", run_yaml, "--cluster", "cpu-2", "--cost-model", str(model)]
    assert plan_cli.main(other) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: --cost-model {model}: calibrated on 1 x cpu, not 2 x cpu (calibrate "
        "there, or plan without it)"
    )
