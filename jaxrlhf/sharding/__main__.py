"""Smallest real run: build (or load) a model sharded on this machine's devices and run a
forward pass.

    python -m jaxrlhf.sharding                      # tiny Llama, random weights
    python -m jaxrlhf.sharding --preset bench_s --mesh 1,-1,1
    python -m jaxrlhf.sharding --hf-dir /path/to/hf/model --dtype bfloat16

Prints the parameter count, the bytes each device holds under the training rules, the
time of the first (compiling) and a second forward pass, and a checksum of the logits.
"""

from __future__ import annotations

import argparse
import sys
import time

PRESETS = ("tiny", "bench_s", "bench_m")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.sharding",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--hf-dir", help="load a Hugging Face model directory instead")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (-1 = rest)")
    parser.add_argument("--dtype", default="float32", help="compute dtype")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from jaxrlhf.models import model as M
    from jaxrlhf.models.config import ModelConfig
    from jaxrlhf.models.hf_checkpoint import load_params
    from jaxrlhf.models.hf_config import load_hf_config
    from jaxrlhf.models.safetensors_io import CheckpointError
    from jaxrlhf.sharding import TRAIN, MeshConfig, activation_sharding, make_mesh
    from jaxrlhf.sharding.mesh import MeshError
    from jaxrlhf.sharding.model_sharding import build_sharded, bytes_per_device, param_shardings

    try:
        sizes = [int(x) for x in args.mesh.split(",")]
        if len(sizes) != 3:
            raise ValueError
    except ValueError:
        print(f"error: --mesh {args.mesh!r}: expected three ints data,fsdp,tensor", file=sys.stderr)
        return 2
    try:
        mesh = make_mesh(MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2]))
        if args.hf_dir:
            cfg = load_hf_config(args.hf_dir, dtype=args.dtype)
        else:
            cfg = getattr(ModelConfig, args.preset)().replace(dtype=args.dtype)
        shardings = param_shardings(cfg, mesh, TRAIN)
        if args.hf_dir:
            params = load_params(args.hf_dir, cfg, shardings=shardings)
        else:
            params = M.init_params(cfg, jax.random.key(0), shardings=shardings)
    except (CheckpointError, MeshError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    per_device = bytes_per_device(shardings, M.abstract_params(cfg))
    print(
        f"model: {cfg.family}, {M.param_count(params) / 1e6:.2f}M params, mesh "
        f"{dict(mesh.shape)}, {max(per_device.values()) / 2**20:.2f} MiB params per device"
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.length)).astype(np.int32)
    mask = np.ones_like(tokens, dtype=bool)
    batch = jax.device_put((tokens, mask), activation_sharding(mesh, TRAIN, ("batch", "length")))
    forward = jax.jit(lambda p, t, m: M.forward(build_sharded(cfg, mesh, TRAIN), p, t, m))
    for label in ("first forward (compile + run)", "second forward"):
        start = time.perf_counter()
        logits = jax.block_until_ready(forward(params, *batch))
        print(f"{label}: {time.perf_counter() - start:.3f} s")
    print(
        f"logits {tuple(logits.shape)} {logits.dtype}, mean {float(logits.mean()):+.6f}, "
        f"std {float(logits.std()):.6f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
