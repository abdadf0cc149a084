"""Workload G1 (shared/bench/WORKLOADS.md): generation throughput, jaxrlhf vs transformers.

32 prompts x 64 random tokens, 128 new tokens each, temperature-1 sampling (top-k/top-p
off), no early stop, on the same random weights (seed 0) in float32. Metric: generated
tokens / second (32 * 128 / wall time of one full generate call, prompt prefill included),
median of the timed repetitions after one warm-up call. jaxrlhf's compile time is reported
apart (first call minus a steady call). Repetitions alternate between the two frameworks
and the ratio is taken per repetition (median reported).

On a shared 2-core machine other jobs steal cores, and both frameworks then slow down
erratically (PyTorch's OpenMP barriers worst of all: 10-30x). Each run therefore records
the share of its time in which runnable tasks waited for a CPU (Linux PSI); a repetition is
clean when both runs stayed under ``--max-stall``, and medians are over clean repetitions
only (the table says how many; all runs are printed).

The compute floor is the time the workload's matmul FLOPs take at this machine's measured
float32 matmul rate (decode-shaped [B, D] x [D, F] and prefill-shaped [B*P, D] x [D, F]
matmuls, measured in the same run with their weights in cache, the faster of XLA's dot and
jaxrlhf's CPU block-matmul kernel): no implementation can be faster on this CPU without
skipping work.

    python benchmarks/generate.py --models bench-s bench-m --reps 5

``--cpu-devices 2`` splits the host into two JAX CPU devices and runs the sampler on a
data-parallel mesh over them (16 rows each): the ``placement.generate_mesh`` of
docs/sharding.md, "Placement".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import platform as jaxrlhf_platform  # noqa: E402
from jaxrlhf.generation import Sampler, SamplingParams  # noqa: E402
from jaxrlhf.generation.decode import CPU_MATMUL_BLOCK  # noqa: E402
from jaxrlhf.kernels import block_matmul  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402
from jaxrlhf.models.config import ModelConfig  # noqa: E402
from jaxrlhf.sharding import MeshConfig, make_mesh  # noqa: E402

MODELS = {"bench-s": ModelConfig.bench_s, "bench-m": ModelConfig.bench_m}
BATCH, PROMPT, NEW = 32, 64, 128


@dataclasses.dataclass
class Result:
    model: str
    jax_tok_s: float
    hf_tok_s: float | None
    ratio: float | None
    jax_prefill_s: float
    jax_decode_s: float
    jax_compile_s: float
    floor_tok_s: float
    floor_fraction: float
    clean: int
    runs: int


# ---- machine ---------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_pressure() -> str:
    """Linux PSI: share of time runnable tasks waited for a CPU (other load on the box)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return "n/a"


def matmul_rate(m: int, k: int, n: int, reps: int, with_kernel: bool = True) -> float:
    """Best float32 FLOP/s of a chain of [m, k] x [k, n] and [m, n] x [n, k] matmuls.

    Timed inside one jitted loop (no dispatch), with the weights stored three ways: [in, out]
    and [out, in] (contracted on their last dim; which of the two XLA's CPU matmul runs faster
    at small m depends on the CPU) and, where jaxrlhf's CPU block-matmul kernel is available,
    as its 64-column blocks (unless ``with_kernel`` is False: XLA's own rate, the floor as
    issue 19 defined it). The fastest is kept; with the kernel, the floor derived from it is
    a lower bound on the time of any of the three layouts.
    """
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    def blocks(w: jax.Array) -> jax.Array:  # [in, out] -> [out / b, in, b]
        return w.reshape(w.shape[0], -1, CPU_MATMUL_BLOCK).transpose(1, 0, 2)

    def block_chain(x, a, b):
        def two(i, h):
            h = block_matmul.block_matmul(h, a).reshape(h.shape[0], -1)
            return block_matmul.block_matmul(h, b).reshape(h.shape[0], -1)

        return jax.lax.fori_loop(0, reps, two, x)

    x = normal(m, k)
    in_out = jax.jit(
        lambda x, a, b: jax.lax.fori_loop(0, reps, lambda i, h: (h @ a) @ b, x)
    )  # a [k, n], b [n, k]
    out_in = jax.jit(
        lambda x, a, b: jax.lax.fori_loop(
            0, reps, lambda i, h: jnp.einsum("mn,kn->mk", jnp.einsum("mk,nk->mn", h, a), b), x
        )
    )  # a [n, k], b [k, n]
    candidates = [
        (in_out, (x, normal(k, n), normal(n, k))),
        (out_in, (x, normal(n, k), normal(k, n))),
    ]
    blockable = n % CPU_MATMUL_BLOCK == 0 and k % CPU_MATMUL_BLOCK == 0
    if with_kernel and blockable and block_matmul.available():
        candidates.append((jax.jit(block_chain), (x, blocks(normal(k, n)), blocks(normal(n, k)))))
    best = float("inf")
    for fn, args in candidates:
        jax.block_until_ready(fn(*args))
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best = min(best, time.perf_counter() - t)
    return 4 * m * k * n * reps / best


# ---- workload FLOPs ---------------------------------------------------------------------


def workload_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(prefill, decode) FLOPs of G1: 2 * params-in-matmuls * tokens + attention + LM head.

    Prefill processes B*P tokens and applies the LM head to each row's last token; decode
    runs NEW - 1 one-token forwards (the last sampled token is never fed back). Attention
    counts only causal, real keys (QK^T and PV: 4 * heads * head_dim FLOPs per key).
    """
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.dim_per_head
    n, k, v = cfg.num_heads, cfg.kv_heads, cfg.vocab_size
    per_layer = d * n * h * 2 + d * k * h * 2 + d * f * (3 if cfg.gated_mlp else 2)
    layer_params = cfg.num_layers * per_layer
    attn_per_key = 4 * n * h * cfg.num_layers
    prefill = (
        2 * layer_params * BATCH * PROMPT
        + attn_per_key * BATCH * PROMPT * (PROMPT + 1) / 2
        + 2 * d * v * BATCH
    )
    steps = NEW - 1
    keys = sum(PROMPT + i + 1 for i in range(steps))
    decode = (
        2 * layer_params * BATCH * steps + attn_per_key * BATCH * keys + 2 * d * v * BATCH * steps
    )
    return prefill, decode


# ---- the two frameworks -----------------------------------------------------------------


def run_jax(sampler, params, tokens, mask, sp, key) -> tuple[float, float, float]:
    """(total, prefill, decode) wall seconds of one generate call."""
    t0 = time.perf_counter()
    state = sampler.prefill(params, tokens, mask, key, sp)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    _, out = sampler.decode(params, state, sp)
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    assert out.tokens.shape == (tokens.shape[0], sp.max_new_tokens)
    assert bool(out.response_mask.all())
    return t2 - t0, t1 - t0, t2 - t1


def run_hf(model, tokens_t, mask_t, seed: int, new: int = NEW) -> float:
    """Wall seconds of one transformers ``generate`` call of ``new`` tokens per row (on the
    model's device; a GPU is synchronised before the clock stops)."""
    import torch

    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=tokens_t,
            attention_mask=mask_t,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            use_cache=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    assert out.shape == (tokens_t.shape[0], tokens_t.shape[1] + new)
    return elapsed


def stall_seconds() -> float | None:
    """Cumulative seconds in which some runnable task on this machine waited for a CPU
    (Linux PSI ``/proc/pressure/cpu`` "some" total); None where PSI is unavailable."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def timed(fn, *args):
    """``(result, wall seconds, stall fraction)``: the share of the wall time in which
    runnable tasks (ours or other processes') waited for a CPU. On an otherwise idle box it
    stays near 0; other jobs on the 2 cores push it up and make any timing meaningless."""
    s0, t0 = stall_seconds(), time.perf_counter()
    out = fn(*args)
    wall = time.perf_counter() - t0
    s1 = stall_seconds()
    return out, wall, (s1 - s0) / wall if s0 is not None and s1 is not None else 0.0


def bench_model(name: str, args) -> Result:
    cfg = MODELS[name]()
    params = model_lib.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    mask = np.ones((BATCH, PROMPT), bool)
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW)
    if args.cpu_devices > 1:
        sampler = Sampler(cfg, make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)))
        params, _ = sampler.to_generate_layout(params)
    else:
        sampler = Sampler(cfg)
    tokens_j, mask_j = jnp.asarray(tokens), jnp.asarray(mask)

    t = time.perf_counter()
    run_jax(sampler, params, tokens_j, mask_j, sp, jax.random.key(0))  # compile + warm-up
    first = time.perf_counter() - t

    hf_model = None
    if not args.skip_hf:
        import torch

        from benchmarks.pytorch_rl import hf_causal_lm

        torch.set_num_threads(args.threads)
        hf_model = hf_causal_lm(cfg, params)
        tokens_t, mask_t = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask).long()
        run_hf(hf_model, tokens_t, mask_t, seed=0)  # warm-up

    # Repetitions alternate the order of the two frameworks. A repetition counts as clean
    # when neither run waited for a CPU more than --max-stall of its time; medians are over
    # clean repetitions (over all of them, flagged, if none is clean).
    reps: list[dict] = []
    attempt = 0
    while sum(r["clean"] for r in reps) < args.reps and attempt < args.reps * args.max_attempts:
        attempt += 1
        key = jax.random.key(attempt)
        order = ("jax", "hf") if attempt % 2 else ("hf", "jax")
        rep: dict = {"hf": None, "hf_stall": 0.0}
        for which in order:
            if which == "jax":
                (total, pre, dec), _, stall = timed(
                    run_jax, sampler, params, tokens_j, mask_j, sp, key
                )
                rep.update(jax=total, prefill=pre, decode=dec, jax_stall=stall)
            elif hf_model is not None:
                elapsed, _, stall = timed(run_hf, hf_model, tokens_t, mask_t, attempt)
                rep.update(hf=elapsed, hf_stall=stall)
        rep["clean"] = max(rep["jax_stall"], rep["hf_stall"]) <= args.max_stall
        reps.append(rep)
        hf_text = (
            f"  transformers {BATCH * NEW / rep['hf']:7.0f} tok/s (stall {rep['hf_stall']:4.0%})"
            if rep["hf"]
            else ""
        )
        print(
            f"  {name} run {attempt}: jaxrlhf {BATCH * NEW / rep['jax']:7.0f} tok/s "
            f"(stall {rep['jax_stall']:4.0%}){hf_text}{'' if rep['clean'] else '  [contended]'}",
            flush=True,
        )

    used = [r for r in reps if r["clean"]] or reps
    med = statistics.median(r["jax"] for r in used)
    prefill_flops, decode_flops = workload_flops(cfg)
    d, f = cfg.hidden_size, cfg.intermediate_size
    decode_rate = matmul_rate(BATCH, d, f, reps=200 if name == "bench-s" else 40)
    prefill_rate = matmul_rate(BATCH * PROMPT, d, f, reps=10 if name == "bench-s" else 2)
    floor_s = prefill_flops / prefill_rate + decode_flops / decode_rate
    print(
        f"  {name}: matmul rate {decode_rate / 1e9:.0f} GFLOP/s at [{BATCH},{d}]x[{d},{f}], "
        f"{prefill_rate / 1e9:.0f} GFLOP/s at [{BATCH * PROMPT},{d}]x[{d},{f}]; workload "
        f"{(prefill_flops + decode_flops) / 1e9:.1f} GFLOP -> floor {floor_s:.3f} s",
        flush=True,
    )
    with_hf = [r for r in used if r["hf"]]
    return Result(
        model=name,
        jax_tok_s=BATCH * NEW / med,
        hf_tok_s=BATCH * NEW / statistics.median(r["hf"] for r in with_hf) if with_hf else None,
        ratio=statistics.median(r["hf"] / r["jax"] for r in with_hf) if with_hf else None,
        jax_prefill_s=statistics.median(r["prefill"] for r in used),
        jax_decode_s=statistics.median(r["decode"] for r in used),
        jax_compile_s=first - med,
        floor_tok_s=BATCH * NEW / floor_s,
        floor_fraction=floor_s / med,
        clean=sum(r["clean"] for r in reps),
        runs=len(reps),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bench-s", "bench-m"], choices=MODELS)
    parser.add_argument("--reps", type=int, default=3, help="clean timed repetitions (median)")
    parser.add_argument(
        "--max-stall",
        type=float,
        default=0.05,
        help="a repetition is clean if no run waited for a CPU more than this share of its time",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=4, help="give up after reps * this many repetitions"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--skip-hf", action="store_true", help="time jaxrlhf only")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=1,
        help="JAX CPU devices to split the host into; >1 samples on a data-parallel mesh over them",
    )
    args = parser.parse_args(argv)
    if args.cpu_devices < 1:
        parser.error("--cpu-devices must be >= 1")
    if args.cpu_devices > 1 and jaxrlhf_platform.set_cpu_devices(args.cpu_devices) is not None:
        parser.error("--cpu-devices: JAX has already started")
    host = jaxrlhf_platform.reuse_freed_host_memory()  # as `python -m jaxrlhf.train` on CPU

    import torch
    import transformers

    print(f"# G1 generation benchmark  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(
        f"# machine: {cpu_model()}, {os.cpu_count()} CPUs; jax {jax.__version__}, "
        f"torch {torch.__version__} ({args.threads} threads), transformers "
        f"{transformers.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"host memory reuse: {host or 'on'}; sampler on {jax.device_count()} CPU device(s)"
    )
    print(f"# cpu pressure at start: {cpu_pressure()}")
    print(f"# workload: {BATCH} prompts x {PROMPT} tokens, {NEW} new tokens, temperature 1.0")
    results = [bench_model(name, args) for name in args.models]
    print(f"# cpu pressure at end: {cpu_pressure()}")
    print()
    print(
        "| model | jaxrlhf tok/s | transformers tok/s | ratio | jaxrlhf prefill s | "
        "jaxrlhf decode s | compile s | floor tok/s | floor / jaxrlhf time | clean runs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        hf = f"{r.hf_tok_s:.0f}" if r.hf_tok_s else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        print(
            f"| {r.model} | {r.jax_tok_s:.0f} | {hf} | {ratio} | {r.jax_prefill_s:.3f} | "
            f"{r.jax_decode_s:.3f} | {r.jax_compile_s:.1f} | {r.floor_tok_s:.0f} | "
            f"{r.floor_fraction:.0%} | {r.clean}/{r.runs} |"
        )


if __name__ == "__main__":
    main()
