"""G1 (32 prompts x 64 random tokens, 128 new tokens, temperature 1, no early stop) on the
rollout engine against the static sampler, on one CPU device, runs alternating: issue 19
asks the engine's decode for 70% of the matmul floor on bench-M. The floor is
benchmarks/generate.py's (the workload's FLOPs at the matmul rates measured at the decode
and prefill shapes), given twice: at XLA's own rates (the floor as issue 19 defined it) and
at the best of XLA and jaxrlhf's block-matmul kernel (strict). It is measured in every
round, right after that round's runs, and each run is set against its own round's floor
(the median over rounds is reported), so a VM whose speed drifts between rounds moves both
sides of the ratio; the fastest run against the lowest floor of all rounds is printed too.
The engine decodes every row to 128 tokens (per-row budgets), so both do the same work.

    python benchmarks/g1_engine.py --model bench-m --chunk 16 --reps 4 [--transformers]

``--transformers`` adds transformers ``generate`` (PyTorch CPU, 2 threads, the same
weights; benchmarks/generate.py's run) to every round, for the engine's own ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrlhf import platform  # noqa: E402

platform.reuse_freed_host_memory()  # as python -m jaxrlhf.train on CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import generate as g1  # noqa: E402
from jaxrlhf.generation import Sampler, SamplingParams  # noqa: E402
from jaxrlhf.generation.engine import Engine  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402


def engine_arguments(description: str, reps: int, transformers: bool = False) -> argparse.Namespace:
    """The engine benchmarks' command line: ``--model``, ``--chunk`` and ``--reps``, and
    ``--transformers`` where ``transformers``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="bench-m", choices=sorted(g1.MODELS))
    parser.add_argument("--chunk", type=int, default=16, help="engine steps per chunk")
    parser.add_argument("--reps", type=int, default=reps)
    if transformers:
        parser.add_argument(
            "--transformers",
            action="store_true",
            help="also time transformers generate (PyTorch CPU, 2 threads) in the same rounds",
        )
    return parser.parse_args()


def main() -> None:
    args = engine_arguments(__doc__.splitlines()[0], reps=4, transformers=True)
    cfg = g1.MODELS[args.model]()
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (g1.BATCH, g1.PROMPT))
    tokens = tokens.astype(np.int32)
    mask = np.ones_like(tokens, bool)
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=g1.NEW)
    sampler = Sampler(cfg)
    engine = Engine(sampler, slots=g1.BATCH, chunk=args.chunk)
    lengths = np.full(g1.BATCH, g1.NEW, np.int32)

    def run_engine(key: jax.Array) -> float:
        start = time.perf_counter()
        out = engine.generate(params, tokens, mask, key, sp, max_new_tokens=lengths)
        seconds = time.perf_counter() - start
        assert np.array_equal(out.finished.lengths, lengths)
        return seconds

    def run_static(key: jax.Array) -> float:
        total, _, _ = g1.run_jax(sampler, params, jnp.asarray(tokens), jnp.asarray(mask), sp, key)
        return total

    runners = {"engine": run_engine, "static": run_static}
    if args.transformers:
        import torch

        from benchmarks.pytorch_rl import hf_causal_lm

        torch.set_num_threads(2)
        hf_model = hf_causal_lm(cfg, params)
        tokens_t, mask_t = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask).long()

        def run_transformers(key: jax.Array) -> float:
            seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
            return g1.run_hf(hf_model, tokens_t, mask_t, seed=seed)

        runners["transformers"] = run_transformers
    for name, run in runners.items():
        start = time.perf_counter()
        run(jax.random.key(0))
        print(f"{name}: first call (compiles) {time.perf_counter() - start:.1f} s", flush=True)
    prefill_flops, decode_flops = g1.workload_flops(cfg)
    d, f = cfg.hidden_size, cfg.intermediate_size

    def floor(kernel: bool) -> tuple[float, str]:
        """The floor in seconds, and the matmul rates it came from (GFLOP/s)."""
        decode_rate = g1.matmul_rate(g1.BATCH, d, f, reps=40, with_kernel=kernel)
        prefill_rate = g1.matmul_rate(g1.BATCH * g1.PROMPT, d, f, reps=2, with_kernel=kernel)
        rates = f"{decode_rate / 1e9:.0f}/{prefill_rate / 1e9:.0f}"
        return prefill_flops / prefill_rate + decode_flops / decode_rate, rates

    times: dict[str, list[float]] = {name: [] for name in runners}
    floors: dict[str, list[float]] = {"strict": [], "XLA": []}
    rates: dict[str, list[str]] = {"strict": [], "XLA": []}
    for rep in range(args.reps):
        order = list(runners) if rep % 2 else list(runners)[::-1]
        for name in order:
            times[name].append(runners[name](jax.random.key(rep + 1)))
        for label, kernel in (("strict", True), ("XLA", False)):
            seconds, at = floor(kernel)
            floors[label].append(seconds)
            rates[label].append(at)
    for label, fs in floors.items():
        print(
            f"{args.model}, CPU {g1.cpu_model()}: {label} floor by round "
            f"{[round(x, 3) for x in fs]} s (lowest {min(fs):.3f}; matmul rates at the decode/"
            f"prefill shapes by round {rates[label]} GFLOP/s)"
        )
    for name, ts in times.items():
        median = statistics.median(ts)
        fractions = {
            label: statistics.median(x / t for x, t in zip(fs, ts, strict=True))
            for label, fs in floors.items()
        }
        print(
            f"{name}: {g1.BATCH * g1.NEW / median:.0f} tok/s (median {median:.3f} s of "
            f"{[round(t, 3) for t in ts]}); of its round's floor (median over rounds): "
            f"{fractions['strict']:.0%} strict, {fractions['XLA']:.0%} XLA's; its fastest "
            f"round against the lowest floor: {min(floors['strict']) / min(ts):.0%} strict, "
            f"{min(floors['XLA']) / min(ts):.0%} XLA's"
        )
    if "transformers" in times:
        for name in ("engine", "static"):
            by_round = [hf / t for hf, t in zip(times["transformers"], times[name], strict=True)]
            print(
                f"{name} / transformers: {statistics.median(by_round):.2f}x (median of the "
                f"rounds' ratios {[round(r, 2) for r in by_round]})"
            )


if __name__ == "__main__":
    main()
