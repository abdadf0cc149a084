"""The rollout engine's generation alone on R1-long's lengths (benchmarks/rl_long.py: 8
prompts x 4 samples of 64 random tokens, responses forced to G2's tail at the quantiles, cap
512): seconds per ``Engine.generate`` call on one CPU device, the first (compiling) call
apart. Run it on two checkouts one after the other to compare engine versions:

    python benchmarks/engine_r1_long.py --model bench-m --chunk 16 --reps 3
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrlhf import platform  # noqa: E402

platform.reuse_freed_host_memory()  # as python -m jaxrlhf.train on CPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import generate as g1  # noqa: E402
from benchmarks.g1_engine import engine_arguments  # noqa: E402
from benchmarks.rl_long import CAP, quantile_lengths  # noqa: E402
from jaxrlhf.generation import Sampler, SamplingParams  # noqa: E402
from jaxrlhf.generation.engine import Engine  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402

PROMPTS, SAMPLES, PROMPT = 8, 4, 64


def main() -> None:
    args = engine_arguments(__doc__.splitlines()[0], reps=3)
    cfg = g1.MODELS[args.model](max_position_embeddings=PROMPT + CAP)
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (PROMPTS, PROMPT))
    tokens = tokens.astype(np.int32)
    mask = np.ones_like(tokens, bool)
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=CAP, n=SAMPLES)
    engine = Engine(Sampler(cfg), slots=PROMPTS * SAMPLES, chunk=args.chunk)
    lengths = quantile_lengths()
    times = []
    for rep in range(args.reps + 1):
        start = time.perf_counter()
        out = engine.generate(
            params, tokens, mask, jax.random.key(rep), sampling, max_new_tokens=lengths
        )
        times.append(time.perf_counter() - start)
        if not np.array_equal(np.sort(out.finished.lengths), np.sort(lengths)):
            raise SystemExit("the engine did not decode the forced lengths")
    print(
        f"{args.model} on {g1.cpu_model()}, jax {jax.__version__}, chunk {args.chunk}: "
        f"{out.chunks} chunks, {int(lengths.sum())} tokens"
    )
    print(
        f"first call (compiles) {times[0]:.2f} s; then median {statistics.median(times[1:]):.2f} s "
        f"of {[round(t, 2) for t in times[1:]]}"
    )


if __name__ == "__main__":
    main()
