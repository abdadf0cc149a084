"""Workload R1-long: the R1 GRPO step (benchmarks/rl_step.py) with G2's long-tailed response
lengths, the static sampler against the rollout engine with streamed scoring.

Four paths: ``static unpacked`` (the step before issue 19: the static scan sampler, and
scoring and the update on rows padded to ``max_new_tokens``), ``static`` (the same sampler,
then scoring and the update on the samples' real lengths, ``rollout.pack_sequences``),
``engine+stream`` (the rollout engine, each batch of finished groups scored on a background
thread while the tail decodes, packed) and ``engine+stream serial`` (the same, each batch
scored between decode chunks: ``rollout.stream_concurrent: false``).

R1 (8 prompts x 4 samples, 64 random prompt tokens, a cheap programmatic reward, reference
log-probs, one AdamW update over the 32 rows, KL 0.04) with ``max_new_tokens`` 512 and the
32 rows' response lengths at the quantiles of G2's distribution (lognormal, median 48,
capped at 512; benchmarks/generate_longtail.py). Both runs use the same samples: the engine
stops each row at its length (per-row budgets), the static sampler decodes every row
for 512 steps, as it must, and its rows are then cut at the same lengths, so scoring and the
update see identical rollouts. Metric: seconds per iteration, median over the timed
iterations after one warm-up, with the trainer's per-phase split; the runs alternate
iteration by iteration.

    python benchmarks/rl_long.py --models bench-s bench-m --steps 3 --cpu-devices 2
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rl_step  # noqa: E402
from benchmarks.generate import cpu_model  # noqa: E402
from benchmarks.generate_longtail import CAP, MEDIAN, SIGMA  # noqa: E402
from jaxrlhf import platform as jaxrlhf_platform  # noqa: E402
from jaxrlhf.config import load_config  # noqa: E402
from jaxrlhf.train.rl_config import RolloutConfig  # noqa: E402
from jaxrlhf.train.rl_trainer import build_rl_trainer  # noqa: E402

ROWS = rl_step.PROMPTS * rl_step.SAMPLES
ENGINES = {
    # The step before issue 19: the static sampler, scoring and the update on rows padded
    # to max_new_tokens (prompt groups still share their prompt, rollout.shared_prefix).
    "static unpacked": {"engine": "static", "pack_sequences": False},
    "static": {"engine": "static"},
    "engine+stream": {
        "engine": "continuous",
        "slots": ROWS,
        "chunk_tokens": 16,
        "stream_scoring": True,
    },
    # The same, each streamed batch scored between decode chunks on the engine's thread
    # instead of on a background thread beside the decode (rollout.stream_concurrent).
    "engine+stream serial": {
        "engine": "continuous",
        "slots": ROWS,
        "chunk_tokens": 16,
        "stream_scoring": True,
        "stream_concurrent": False,
    },
}


def _trainer(
    model: str,
    engine: str,
    placement: str,
    out: str,
    pack_buckets: int,
    model_fields: dict | None = None,
    micro_batch_size: int | None = None,
):
    preset = rl_step.MODELS.get(model, model)
    rl_step._config("R1", preset, None, out, placement, model_fields)  # writes R1.yaml
    path = os.path.join(out, "R1.yaml")
    overrides = [
        f"grpo.rollout.max_new_tokens={CAP}",
        f"data.max_length={rl_step.PROMPT_LEN + CAP}",
        f"model.max_position_embeddings={rl_step.PROMPT_LEN + CAP}",
        f"grpo.rollout.pack_buckets={pack_buckets}",
    ]
    overrides += [f"grpo.rollout.{k}={v}" for k, v in ENGINES[engine].items()]
    if micro_batch_size is not None:
        overrides.append(f"train.micro_batch_size={micro_batch_size}")
    trainer = build_rl_trainer(load_config(path, overrides))
    trainer.prompts = rl_step.RandomPrompts(trainer.model_cfg.vocab_size)
    trainer.task_fn = None
    return trainer


def quantile_lengths() -> np.ndarray:
    """[32] response lengths: G2's distribution at the quantiles (i + 0.5) / 32, capped at
    512, shuffled once (seed 0): the same tail as G2's draw (2 of 32 at the cap, about 5%)
    without a 32-row draw's luck."""
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf((i + 0.5) / ROWS) for i in range(ROWS)])
    lengths = np.clip(np.ceil(MEDIAN * np.exp(SIGMA * z)), 1, CAP).astype(np.int32)
    return np.random.default_rng(0).permutation(lengths)


def force_lengths(trainer, lengths: np.ndarray) -> None:
    """Makes every rollout end its rows at ``lengths`` ([32], prompt-major rows)."""
    engine = trainer.programs.engine
    if engine is not None:
        engine.generate = functools.partial(engine.generate, max_new_tokens=lengths)
        return
    sampler = trainer.sampler
    generate = sampler.generate

    def cut(*args, **kwargs):
        out = generate(*args, **kwargs)
        keep = jnp.arange(out.tokens.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
        keep &= out.response_mask
        return out.replace(
            tokens=jnp.where(keep, out.tokens, 0),
            response_mask=keep,
            lengths=keep.sum(-1, dtype=jnp.int32),
            stopped=jnp.zeros_like(out.stopped),
            logprobs=jnp.where(keep, out.logprobs, 0.0),
            model_logprobs=jnp.where(keep, out.model_logprobs, 0.0),
        )

    sampler.generate = cut


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["bench-s"], choices=sorted(rl_step.MODELS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=1)
    parser.add_argument(
        "--runs",
        nargs="+",
        default=list(ENGINES),
        choices=list(ENGINES),
        help="which paths to run (default: all)",
    )
    parser.add_argument(
        "--unpacked-micro-batch",
        type=int,
        default=None,
        help="train.micro_batch_size of 'static unpacked' (gradient accumulation; bench-M's "
        "padded update needs ~27 GB in one micro-batch); the other paths run one micro-batch",
    )
    parser.add_argument(
        "--pack-buckets",
        type=int,
        default=RolloutConfig.pack_buckets,
        help="rollout.pack_buckets: packed sizes in steps of 1/this of the rows",
    )
    args = parser.parse_args()
    if args.cpu_devices > 1 and jaxrlhf_platform.set_cpu_devices(args.cpu_devices) is not None:
        parser.error("--cpu-devices: JAX has already started")
    placement = "split" if args.cpu_devices > 1 else "all"
    host = jaxrlhf_platform.reuse_freed_host_memory()
    lengths = quantile_lengths()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, jax {jax.__version__}, "
        f"{jax.device_count()} CPU device(s), placement {placement}, host memory reuse: "
        f"{host or 'on'}, pack_buckets {args.pack_buckets}"
    )
    print(
        f"# R1-long lengths: median {np.median(lengths):.0f}, mean {lengths.mean():.1f}, max "
        f"{lengths.max()}, {(lengths == CAP).sum()} at {CAP}; {lengths.sum()} tokens"
    )
    phases = (
        "reshard",
        "generate",
        "score_streamed",
        "score_streamed_wait",
        "reward",
        "score",
        "train",
    )
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            trainers = {}
            for name in args.runs:
                out = os.path.join(tmp, f"{model}-{name}")
                os.makedirs(out)
                micro = args.unpacked_micro_batch if name == "static unpacked" else None
                trainers[name] = _trainer(
                    model, name, placement, out, args.pack_buckets, micro_batch_size=micro
                )
                force_lengths(trainers[name], lengths)
                trainers[name].step()  # warm-up: compiles
            rows: dict[str, list[dict]] = {k: [] for k in trainers}
            for i in range(args.steps):
                order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
                for name in order:
                    rows[name].append(trainers[name].step().metrics)
            load = os.getloadavg()[0]
            print(f"{model}: s/iteration, median of {args.steps} (1-min load {load:.1f})")
            median = {}
            for name, rs in rows.items():
                median[name] = statistics.median(r["time/iteration_s"] for r in rs)
                split = ", ".join(
                    f"{p} {statistics.median(r.get(f'time/{p}_s', 0.0) for r in rs):.2f}"
                    for p in phases
                )
                print(f"  {name:14s} {median[name]:7.2f} s  ({split})")
                packing = {k: v for k, v in rs[-1].items() if k.startswith("packing/")}
                if packing:
                    print("    " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(packing.items())))
            bases = [k for k in trainers if k != "engine+stream"]
            for base in bases if "engine+stream" in trainers else ():
                ratio = median[base] / median["engine+stream"]
                print(f"  engine+stream is {ratio:.2f}x faster than {base}")


if __name__ == "__main__":
    main()
