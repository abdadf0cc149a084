"""The standard workloads on one GPU, bfloat16, with a correctness check first.

One script, so that a short lease of a GPU runs all of it in one call; every part prints as
it goes and appends its results to ``--out/gpu_results.jsonl``, and a part that fails prints
its error and lets the next run. Parts (``--parts``, in this order by default):

* ``env``: versions, the device, and its measured ceilings (a device-to-device copy's
  bytes read + written per second; a 8192^3 bf16 matmul's FLOP/s), which the floors use.
* ``parity``: bench-M's logits on the GPU against transformers' PyTorch model on the GPU,
  same weights, float32 with full-precision matmuls on both (JAX ``highest``, PyTorch TF32
  off): the max abs difference (the CPU tests hold 1e-4); and bf16 compute against that
  float32 reference (relative RMS, bf16 rounding: ~1e-2 expected). Then the rollout engine
  against the static sampler on the GPU: same key, same tokens (exact) and log-probs.
* ``g1``: workload G1 (32 prompts x 64 tokens, 128 new, temperature 1, no stop) in bf16:
  the static sampler against transformers ``generate`` (PyTorch, bf16, on the GPU) with the
  same config (random weights: the cost does not depend on them). The decode floor is the
  weights' bytes read once per step at the measured copy bandwidth.
* ``g2``: workload G2 (long-tailed lengths, benchmarks/generate_longtail.py) in bf16: the
  rollout engine, the static sampler and transformers ``generate`` (EOS forced at each
  row's drawn length).
* ``r1``: workload R1 (benchmarks/rl_step.py) through the trainer, bf16 compute over float32
  master weights: seconds per iteration, the phase split, the GPU's peak bytes in use.
* ``r1long``: R1-long (benchmarks/rl_long.py): the static sampler against the engine with
  streamed scoring.

    python benchmarks/gpu.py --out /tmp/gpu                      # everything
    python benchmarks/gpu.py --out /tmp/gpu --parts env g1 --models bench-m
    JAX_PLATFORMS=cpu python benchmarks/gpu.py --platform cpu --models bench-s --quick

``--platform cpu --quick`` runs every part small on the CPU, to check the script before a
GPU is lent. Figures go to benchmarks/RESULTS.md ("On one GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("bench-s", "bench-m", "qwen2_5_1_5b", "llama3_2_1b")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu", help="folder for gpu_results.jsonl")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["env", "parity", "engine", "g1", "g2", "r1", "r1long"],
        choices=["env", "parity", "engine", "g1", "g2", "r1", "r1long"],
    )
    parser.add_argument("--models", nargs="+", default=["bench-m", "qwen2_5_1_5b"], choices=MODELS)
    parser.add_argument("--g2-models", nargs="+", default=["bench-m"], choices=MODELS)
    parser.add_argument("--rl-models", nargs="+", default=["bench-m"], choices=MODELS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--platform", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and one repetition (script check)"
    )
    return parser.parse_args(argv)


ARGS = parse(None if __name__ == "__main__" else [])
os.environ.setdefault("JAX_PLATFORMS", ARGS.platform)
# PyTorch shares the GPU with JAX in this process: JAX takes 60% up front, not 75%.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import generate as g1  # noqa: E402
from benchmarks import generate_longtail as g2  # noqa: E402
from benchmarks import rl_long, rl_step  # noqa: E402
from jaxrlhf.generation import Sampler, SamplingParams  # noqa: E402
from jaxrlhf.generation.engine import Engine  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402
from jaxrlhf.models.config import ModelConfig  # noqa: E402
from jaxrlhf.models.hf_config import to_hf_config  # noqa: E402

BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
CEILINGS: dict[str, float] = {}


def record(out: Path, part: str, **fields) -> None:
    line = {"part": part, **fields}
    print(f"[{part}] " + json.dumps(fields, default=str), flush=True)
    with open(out / "gpu_results.jsonl", "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def torch_device() -> str:
    return "cuda" if ARGS.platform == "cuda" else "cpu"


def model_config(name: str, **fields) -> ModelConfig:
    cfg = getattr(ModelConfig, rl_step.MODELS.get(name, name))(**fields)
    if ARGS.quick and name not in ("bench-s", "bench-m"):
        cfg = cfg.replace(num_layers=2)
    return cfg


def hf_model(cfg: ModelConfig, params=None):
    """transformers' CausalLM for ``cfg`` on the benchmark's device: holding ``params``
    (float32, through a Hugging Face export) or random weights in ``cfg``'s dtype."""
    import torch
    import transformers

    if params is not None:
        from benchmarks.pytorch_rl import hf_causal_lm

        return hf_causal_lm(cfg, params).to(torch_device())
    fields = to_hf_config(cfg)
    fields.pop("architectures", None)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.param_dtype]
    torch.manual_seed(0)
    with torch.device(torch_device()):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def weight_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ---- parts -----------------------------------------------------------------------------


def part_env(out: Path) -> None:
    import torch
    import transformers

    try:
        import flax

        flax_version = flax.__version__
    except ImportError:
        flax_version = None
    dev = jax.devices()[0]
    n, passes = (2**28, 20) if not ARGS.quick else (2**20, 2)  # 1 GiB of float32
    x = jnp.ones((n,), jnp.float32) * 1.5
    # Each pass reads and writes the whole buffer; the passes run in one program, so the
    # launch and the host's wait are paid once. (A factor that rounds to 1 in the buffer's
    # dtype lets XLA drop the loop: 1.0001 does in bf16, not in float32.)
    copy = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda i, v: v * 1.0001, a))
    assert "while" in copy.lower(x).compile().as_text(), "XLA removed the copy loop"
    jax.block_until_ready(copy(x))
    best = min(_timed(lambda: jax.block_until_ready(copy(x))) for _ in range(5))
    CEILINGS["bandwidth"] = passes * 2 * n * 4 / best
    m = 8192 if not ARGS.quick else 512
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(m, m)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(m, m)), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(mm(a, b))
    best = min(_timed(lambda: jax.block_until_ready(mm(a, b))) for _ in range(10))
    CEILINGS["bf16_flops"] = 2 * m**3 / best
    record(
        out,
        "env",
        device=str(dev),
        device_kind=getattr(dev, "device_kind", None),
        jax=jax.__version__,
        flax=flax_version,
        torch=torch.__version__,
        transformers=transformers.__version__,
        cpu=g1.cpu_model(),
        copy_bytes_per_s=CEILINGS["bandwidth"],
        bf16_matmul_flops=CEILINGS["bf16_flops"],
    )


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def part_parity(out: Path) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = model_config("bench-m")
    params = model_lib.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (4, 128)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[1, :17] = False  # one left-padded row
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(model_lib.forward(model_lib.build(cfg), params, tokens, mask))
    model = hf_model(cfg, params)
    with torch.no_grad():
        theirs = model(
            input_ids=torch.as_tensor(tokens, dtype=torch.long, device=model.device),
            attention_mask=torch.as_tensor(mask, dtype=torch.long, device=model.device),
        ).logits.float()
    theirs = theirs.cpu().numpy()
    del model
    bf16 = cfg.replace(dtype="bfloat16")
    low = np.asarray(model_lib.forward(model_lib.build(bf16), params, tokens, mask))
    rel = float(np.sqrt(np.mean((low - ours)[mask] ** 2) / np.mean(ours[mask] ** 2)))
    record(
        out,
        "parity",
        model="bench-m",
        fp32_max_abs_diff=float(np.abs(ours - theirs)[mask].max()),
        logit_scale=float(np.abs(ours[mask]).max()),
        bf16_compute_rel_rms=rel,
    )


def part_engine(out: Path) -> None:
    """The rollout engine against the static sampler on this device: same key, per-row
    budgets, each row's tokens and log-probs up to its budget; with the device's default
    float32 matmuls (TF32 on NVIDIA GPUs) and with full-precision ones."""
    rng = np.random.default_rng(0)
    small = model_config("bench-s")
    params = model_lib.init_params(small, jax.random.key(1))
    tokens = rng.integers(4, small.vocab_size, (8, 16)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[0, :5] = False
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, n=2, pad_token_id=0)
    lengths = rng.integers(1, 33, 16)
    for precision in ("default", "highest"):
        sampler = Sampler(small)
        engine = Engine(sampler, slots=8, chunk=8)
        scope = (
            contextlib.nullcontext()
            if precision == "default"
            else jax.default_matmul_precision(precision)
        )
        with scope:
            t0 = time.perf_counter()
            static = sampler.generate(params, tokens, mask, jax.random.key(3), sp)
            s_tokens, s_lp = np.asarray(static.tokens), np.asarray(static.logprobs)
            t1 = time.perf_counter()
            f = engine.generate(
                params, tokens, mask, jax.random.key(3), sp, max_new_tokens=lengths
            ).finished
            t2 = time.perf_counter()
        equal_rows, lp_diff = 0, 0.0
        for i, row in enumerate(f.rows):
            n = int(f.lengths[i])
            equal_rows += bool(np.array_equal(f.tokens[i, :n], s_tokens[row, :n]))
            lp_diff = max(lp_diff, float(np.abs(f.logprobs[i, :n] - s_lp[row, :n]).max()))
        record(
            out,
            "engine",
            check="engine == static sampler (bench-S fp32, 16 rows, per-row budgets 1-32)",
            matmul_precision=precision,
            rows_equal=f"{equal_rows}/{len(f.rows)}",
            logprob_max_abs_diff=lp_diff,
            static_first_call_s=t1 - t0,
            engine_first_call_s=t2 - t1,
        )


def part_g1(out: Path, name: str) -> None:
    import torch

    cfg = model_config(name, **BF16)
    batch, prompt, new = (g1.BATCH, g1.PROMPT, g1.NEW) if not ARGS.quick else (4, 8, 8)
    params = model_lib.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch, prompt)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new)
    sampler = Sampler(cfg)
    tj, mj = jnp.asarray(tokens), jnp.asarray(mask)

    def ours(seed: int) -> tuple[float, float, float]:
        return g1.run_jax(sampler, params, tj, mj, sp, jax.random.key(seed))

    first = _timed(lambda: ours(0))
    model = hf_model(cfg)
    inputs = torch.as_tensor(tokens, dtype=torch.long, device=model.device)

    def theirs(seed: int) -> float:
        return g1.run_hf(model, inputs, torch.ones_like(inputs), seed, new=new)

    theirs(0)
    ours_runs, hf_runs = [], []
    for rep in range(ARGS.reps):
        if rep % 2:
            hf_runs.append(theirs(rep + 1))
        ours_runs.append(ours(rep + 1))
        if not rep % 2:
            hf_runs.append(theirs(rep + 1))
    total = statistics.median(r[0] for r in ours_runs)
    decode = statistics.median(r[2] for r in ours_runs)
    w = weight_bytes(params)
    floor_step = w / CEILINGS.get("bandwidth", float("nan"))
    record(
        out,
        "g1",
        model=name,
        dtype="bfloat16",
        jaxrlhf_tok_s=batch * new / total,
        transformers_tok_s=batch * new / statistics.median(hf_runs),
        ratio=statistics.median(hf_runs) / total,
        prefill_s=statistics.median(r[1] for r in ours_runs),
        decode_ms_per_step=1e3 * decode / (new - 1),
        floor_ms_per_step=1e3 * floor_step,
        weight_gib=w / 2**30,
        compile_s=first - total,
        reps=ARGS.reps,
    )


def part_g2(out: Path, name: str) -> None:
    cfg = model_config(name, **BF16)
    lengths = g2.draw_lengths()
    if ARGS.quick:
        lengths = np.minimum(lengths, 24)
    ours = g2.Jaxrlhf(cfg, 1, slots=g2.PROMPTS * g2.SAMPLES // 4, chunk=16)
    runners = {
        "engine": lambda: ours.engine_call(lengths),
        "static scan": lambda: ours.static_call("scan"),
    }
    runners["transformers"] = g2.Transformers(cfg, lengths, model=hf_model(cfg)).call
    times: dict[str, list[float]] = {k: [] for k in runners}
    for fn in runners.values():
        fn()
    for rep in range(ARGS.reps):
        for k in list(runners) if rep % 2 == 0 else list(reversed(runners)):
            times[k].append(runners[k]())
    tokens = int(lengths.sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    record(
        out,
        "g2",
        model=name,
        dtype="bfloat16",
        tokens=tokens,
        slots=ours.engine.slots,
        **{f"{k.replace(' ', '_')}_tok_s": tokens / s for k, s in med.items()},
        engine_over_static=med["static scan"] / med["engine"],
        engine_over_transformers=med["transformers"] / med["engine"],
        reps=ARGS.reps,
    )


def part_r1(out: Path, name: str) -> None:
    fields = {"dtype": "bfloat16"}
    if ARGS.quick:
        fields["num_layers"] = 2
    with tempfile.TemporaryDirectory() as tmp:
        r = rl_step.run("R1", name, ARGS.reps, tmp, pytorch=False, model_fields=fields)
    record(out, "r1", model=name, compute="bfloat16 (float32 master)", peak=peak_bytes(), **r)


def part_r1long(out: Path, name: str) -> None:
    fields = {"dtype": "bfloat16"}
    lengths = rl_long.quantile_lengths()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in rl_long.ENGINES:
            d = os.path.join(tmp, engine)
            os.makedirs(d)
            trainer = rl_long._trainer(name, engine, "all", d, 4, fields)
            rl_long.force_lengths(trainer, lengths)
            trainer.step()
            rows = [trainer.step().metrics for _ in range(ARGS.reps)]
            result[engine] = statistics.median(r["time/iteration_s"] for r in rows)
            for p in ("generate", "score_streamed", "score", "train"):
                result[f"{engine}_{p}_s"] = statistics.median(
                    r.get(f"time/{p}_s", 0.0) for r in rows
                )
            del trainer
    result["speedup"] = result["static"] / result["engine+stream"]
    record(out, "r1long", model=name, compute="bfloat16 (float32 master)", **result)


def main() -> None:
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = []
    for part in ARGS.parts:
        if part == "g1":
            plan += [(part, m) for m in ARGS.models]
        elif part == "g2":
            plan += [(part, m) for m in ARGS.g2_models]
        elif part in ("r1", "r1long"):
            plan += [(part, m) for m in ARGS.rl_models]
        else:
            plan.append((part, None))
    for part, name in plan:
        fn = globals()[f"part_{part}"]
        start = time.perf_counter()
        try:
            fn(out) if name is None else fn(out, name)
        except Exception as e:  # report and go on: one lease runs every part
            traceback.print_exc()
            record(out, part, model=name, error=f"{type(e).__name__}: {e}"[:500])
        print(f"# {part} {name or ''}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
