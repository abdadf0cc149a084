"""The planner's length-distribution pricing of the rollout engine against the engine.

The planner prices the engine's decode as its chunks (``jaxrlhf.plan.lengths.engine_chunks``
replayed on the response lengths) times a per-chunk cost that does not depend on the
lengths. This times one engine call on G2's workload (benchmarks/generate_longtail.py: 32
prompts x 4 samples, 64 prompt tokens, budget 512, lognormal lengths of median 48) at G2's
drawn lengths and with every sample at the budget, and compares the measured time ratio with
the predicted chunk ratio; with ``views=False`` (every chunk decodes every slot, the
planner's pricing) and with views (the default: a ragged tail decodes on a smaller view,
cheaper than a chunk count says). It also prints the chunks of the planner's own quantile
lengths (``--lengths lognormal:48,1.439``) beside those of G2's random draw, and the
planner's own prediction: the generate phase of a GRPO run with G2's shapes on this
engine, estimated with those lengths and with every sample at the budget (the views priced
from the dry run's compiled corner views, ``jaxrlhf.plan.estimate.view_cost_model``).

    python benchmarks/planner_lengths.py --model bench-s --slots 64 --chunk 16 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rl_step  # noqa: E402
from benchmarks.generate import cpu_model  # noqa: E402
from benchmarks.generate_longtail import (  # noqa: E402
    CAP,
    MEDIAN,
    MODELS,
    PROMPT_LEN,
    PROMPTS,
    SAMPLES,
    SIGMA,
    Jaxrlhf,
    draw_lengths,
)
from jaxrlhf.config import from_dict  # noqa: E402
from jaxrlhf.plan import estimate  # noqa: E402
from jaxrlhf.plan.hardware import Cluster, measure_cpu  # noqa: E402
from jaxrlhf.plan.lengths import BUDGET, LengthModel, engine_chunks  # noqa: E402


def planner_ratio(model: str, slots: int, chunk: int, lengths: LengthModel) -> float:
    """The planner's generate seconds of a GRPO iteration with G2's shapes on this engine
    (one CPU device) with ``lengths``, over the same with every sample at the budget."""
    run = {
        "algorithm": "grpo",
        "model": {"preset": rl_step.MODELS[model], "max_position_embeddings": PROMPT_LEN + CAP},
        "data": {"max_length": PROMPT_LEN + CAP, "max_prompt_length": PROMPT_LEN, "eval_size": 0},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
        "grpo": {
            "rollout": {
                "prompts_per_step": PROMPTS,
                "num_samples": SAMPLES,
                "max_new_tokens": CAP,
                "engine": "continuous",
                "slots": slots,
                "chunk_tokens": chunk,
                "stream_scoring": False,
            },
            "reward": {"function": "builtin"},
        },
    }
    cfg = from_dict(run)
    compiled = estimate.compile_plan(cfg)
    cluster, cost = Cluster(measure_cpu(), 1), estimate.CostModel()
    tail, full = (
        estimate.estimate(cfg, cluster, cost, compiled=compiled, lengths=x).phases["generate"]
        for x in (lengths, BUDGET)
    )
    return tail / full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-s", choices=list(MODELS))
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    g2 = draw_lengths()
    full = np.full_like(g2, CAP)
    quantiles = LengthModel("lognormal", MEDIAN, SIGMA).lengths(len(g2), CAP)
    chunks = {
        name: engine_chunks(x, args.slots, args.chunk, SAMPLES)[0]
        for name, x in (("g2", g2), ("budget", full), ("quantiles", quantiles))
    }
    print(f"# {cpu_model()}; {args.model}, {args.slots} slots, chunks of {args.chunk}")
    print(
        f"# chunks replayed: G2's draw {chunks['g2']}, every sample at {CAP} "
        f"{chunks['budget']}, the planner's lognormal quantiles {chunks['quantiles']} "
        f"(tokens: {g2.sum()} / {full.sum()} / {quantiles.sum()})"
    )
    ours = Jaxrlhf(MODELS[args.model](), 1, args.slots, args.chunk)
    runs = {
        (views, name): (lambda v=views, x=x: ours.engine_call(x, views=v))
        for views in (False, True)
        for name, x in (("g2", g2), ("budget", full))
    }
    for fn in runs.values():
        fn()  # compiles
    times: dict = {k: [] for k in runs}
    for rep in range(args.reps):
        for k in runs if rep % 2 == 0 else reversed(list(runs)):
            times[k].append(runs[k]())
    predicted = chunks["g2"] / chunks["budget"]
    measured = {}
    for views in (False, True):
        g, b = (statistics.median(times[(views, n)]) for n in ("g2", "budget"))
        measured[views] = g / b
        print(
            f"views={views!s:5}: G2 {g:.2f} s, budget {b:.2f} s, measured ratio {g / b:.3f}, "
            f"predicted (chunks) {predicted:.3f}, prediction / measured {predicted / (g / b):.2f}"
        )
    planned = planner_ratio(
        args.model, args.slots, args.chunk, LengthModel("lognormal", MEDIAN, SIGMA)
    )
    print(
        f"planner (views priced, its quantile lengths): generate ratio {planned:.3f}, "
        f"/ measured with views {planned / measured[True]:.2f}"
    )


if __name__ == "__main__":
    main()
