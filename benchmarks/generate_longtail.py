"""Workload G2: generation with long-tailed response lengths, the rollout engine against the
static sampler (scan and while-loop modes) and transformers ``generate``.

32 prompts x 4 samples, prompts of 64 random tokens, temperature-1 sampling on random
weights (seed 0), float32 on CPU. Response lengths are drawn once (seed 0) from a lognormal
distribution with median 48 tokens and sigma 1.439, so that 5% of draws exceed 512, and are
capped at 512; every implementation stops each row at its drawn length (the engine through
per-row budgets, transformers through a logits processor forcing EOS there; the static
sampler has no per-row stop and decodes all rows to the longest, 512, in scan or while-loop
mode alike). Metric: generated tokens (the drawn lengths' sum) per second of one full call,
prefill included; median over ``--reps`` alternating repetitions after one warm-up call each.

    python benchmarks/generate_longtail.py --models bench-s bench-m --reps 3 --cpu-devices 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.generate import cpu_model, cpu_pressure  # noqa: E402
from jaxrlhf import platform as jaxrlhf_platform  # noqa: E402
from jaxrlhf.generation import Sampler, SamplingParams  # noqa: E402
from jaxrlhf.generation.engine import Engine  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402
from jaxrlhf.models.config import ModelConfig  # noqa: E402
from jaxrlhf.sharding import MeshConfig, make_mesh  # noqa: E402

MODELS = {"bench-s": ModelConfig.bench_s, "bench-m": ModelConfig.bench_m}
PROMPTS, SAMPLES, PROMPT_LEN, CAP = 32, 4, 64, 512
MEDIAN, SIGMA = 48.0, 1.439  # P(lognormal > 512) = 5%


def draw_lengths(seed: int = 0) -> np.ndarray:
    """[128] response lengths in [1, 512], drawn once for every implementation."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(MEDIAN), SIGMA, PROMPTS * SAMPLES)
    return np.clip(np.ceil(raw), 1, CAP).astype(np.int32)


def prompts(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(1).integers(4, vocab, (PROMPTS, PROMPT_LEN)).astype(np.int32)
    return tokens, np.ones_like(tokens, bool)


def sampling() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=CAP, n=SAMPLES, pad_token_id=0)


class Jaxrlhf:
    """The engine and the static sampler on the same sampler (mesh, weights, layout)."""

    def __init__(self, cfg: ModelConfig, cpu_devices: int, slots: int, chunk: int):
        mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)) if cpu_devices > 1 else None
        self.sampler = Sampler(cfg, mesh)
        params = model_lib.init_params(cfg, jax.random.key(0))
        self.params = self.sampler.to_generate_layout(params)[0] if mesh is not None else params
        self.engine = Engine(self.sampler, slots=slots, chunk=chunk)
        self.engine_full = Engine(self.sampler, slots=slots, chunk=chunk, views=False)
        self.tokens, self.mask = prompts(cfg.vocab_size)

    def engine_call(self, lengths: np.ndarray, views: bool = True) -> float:
        engine = self.engine if views else self.engine_full
        start = time.perf_counter()
        out = engine.generate(
            self.params,
            self.tokens,
            self.mask,
            jax.random.key(2),
            sampling(),
            max_new_tokens=lengths,
        )
        seconds = time.perf_counter() - start
        assert np.array_equal(out.finished.lengths, lengths), "the engine stops at the lengths"
        return seconds

    def static_call(self, loop: str) -> float:
        start = time.perf_counter()
        out = self.sampler.generate(
            self.params, self.tokens, self.mask, jax.random.key(2), sampling(), loop=loop
        )
        jax.block_until_ready(out)
        return time.perf_counter() - start


class Transformers:
    """transformers ``generate`` on the same weights, EOS forced at each row's length."""

    def __init__(self, cfg: ModelConfig, lengths: np.ndarray, model=None):
        """``model``: a transformers CausalLM to run (on its device and dtype); None builds
        one on the CPU holding jaxrlhf's seed-0 weights."""
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        from benchmarks.pytorch_rl import hf_causal_lm

        torch.manual_seed(0)
        self.torch = torch
        if model is None:
            model = hf_causal_lm(cfg, model_lib.init_params(cfg, jax.random.key(0)))
        self.model = model
        self.eos = cfg.vocab_size - 1
        self.model.generation_config.eos_token_id = self.eos
        self.model.generation_config.pad_token_id = 0
        tokens, _ = prompts(cfg.vocab_size)
        self.inputs = torch.as_tensor(tokens, dtype=torch.long, device=model.device)
        stop_at = torch.as_tensor(lengths, dtype=torch.long, device=model.device)
        eos, start = self.eos, PROMPT_LEN

        class ForceEos(LogitsProcessor):
            def __call__(self, input_ids, scores):
                generated = input_ids.shape[1] - start  # tokens already sampled
                force = stop_at == generated + 1
                scores[force] = -float("inf")
                scores[force, eos] = 0.0
                scores[~force, eos] = -float("inf")
                return scores

        self.processors = LogitsProcessorList([ForceEos()])

    def call(self) -> float:
        start = time.perf_counter()
        with self.torch.no_grad():
            self.model.generate(
                self.inputs,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=CAP,
                num_return_sequences=SAMPLES,
                logits_processor=self.processors,
            )
        if self.model.device.type == "cuda":
            self.torch.cuda.synchronize()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bench-s"], choices=sorted(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=1)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument(
        "--full-views",
        action="store_true",
        help="also time the engine decoding every slot over the whole cache (views=False)",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument(
        "--skip-while", action="store_true", help="leave out the static while-loop mode"
    )
    args = parser.parse_args()
    if args.cpu_devices > 1 and jaxrlhf_platform.set_cpu_devices(args.cpu_devices) is not None:
        sys.exit("--cpu-devices: JAX had already started")
    host = jaxrlhf_platform.reuse_freed_host_memory()
    lengths = draw_lengths()
    tokens = int(lengths.sum())
    print(
        f"# {datetime.date.today()}, {cpu_model()}, jax {jax.__version__}, "
        f"{jax.device_count()} CPU device(s), host memory reuse: {host or 'on'}"
    )
    print(
        f"# G2 lengths: median {np.median(lengths):.0f}, mean {lengths.mean():.1f}, "
        f"{(lengths == CAP).mean():.1%} at {CAP}; {tokens} tokens; engine slots {args.slots}, "
        f"chunk {args.chunk}"
    )
    for name in args.models:
        cfg = MODELS[name]()
        ours = Jaxrlhf(cfg, args.cpu_devices, args.slots, args.chunk)
        runners = {"engine": lambda o=ours: o.engine_call(lengths)}
        if args.full_views:
            runners["engine full"] = lambda o=ours: o.engine_call(lengths, views=False)
        if not args.skip_static:
            runners["static scan"] = lambda o=ours: o.static_call("scan")
            if not args.skip_while:
                runners["static while"] = lambda o=ours: o.static_call("while")
        if not args.skip_hf:
            hf = Transformers(cfg, lengths)
            runners["transformers"] = hf.call
        times: dict[str, list[float]] = {k: [] for k in runners}
        for fn in runners.values():
            fn()  # warm-up (compiles)
        for rep in range(args.reps):
            names = list(runners) if rep % 2 == 0 else list(reversed(runners))
            for k in names:
                times[k].append(runners[k]())
            print(f"# rep {rep + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in runners))
        median = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}: tokens/s, median of {args.reps} (CPU pressure now: {cpu_pressure()})")
        for k, seconds in median.items():
            line = f"  {k:13s} {tokens / seconds:9.0f} tok/s  ({seconds:.2f} s)"
            if k != "engine":
                line += f"  engine is {seconds / median['engine']:.2f}x"
            print(line)


if __name__ == "__main__":
    main()
