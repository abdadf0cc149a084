"""``x @ w`` for weights stored as column blocks ``[P, K, B]``, by a C++ kernel on CPU.

The decode loop on CPU keeps its weight matmuls' kernels as contiguous column blocks
(``generation.decode.decode_weights``) and multiplies a few rows by all of them every step.
:func:`block_matmul` runs that product as one XLA FFI custom call (``block_matmul.cc``,
compiled on first use by :mod:`jaxrlhf.kernels.build`) that streams each block once and
keeps the rows' sums in registers; on other platforms, or where the kernel cannot be built,
it is XLA's einsum of the same blocks. It partitions like the einsum on any mesh (rows,
blocks or the contracted axis sharded; the last with a ``psum``).

``JAXRLHF_CPU_KERNELS=0`` in the environment (read once per process) turns the kernel off;
``JAXRLHF_KERNEL_CACHE`` says where built kernels live (:func:`build.cache_dir`).

The product is for inference: it has no gradient and no batching rule (``jax.grad`` and
``jax.vmap`` of it raise NotImplementedError), and inside ``jax.shard_map`` it needs
``check_vma=False``. The decode loop uses it under ``jax.jit`` only.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jaxrlhf.kernels import build
from jaxrlhf.kernels.mesh_axes import entry_names, spec_entry

TARGET = "jaxrlhf_block_matmul"
SOURCE = Path(__file__).with_name("block_matmul.cc")


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is built and registered with XLA (done once per process), else
    why not: turned off by ``JAXRLHF_CPU_KERNELS=0``, or the build failed (also warned)."""
    return build.register(
        SOURCE, {TARGET: "JaxrlhfBlockMatmul"}, "CPU decode matmuls use XLA's dot"
    )


def available() -> bool:
    """Whether :func:`block_matmul` runs the C++ kernel on CPU (builds it on first call)."""
    return unavailable_reason() is None


def einsum_block_matmul(x: Float[Array, "M K"], blocks: Float[Array, "P K B"]) -> jax.Array:
    """The product :func:`block_matmul` computes, as XLA's batched matmul over the blocks:
    ``[M, P, B]``."""
    out = jnp.einsum("PMK,PKB->PMB", jnp.broadcast_to(x, (blocks.shape[0], *x.shape)), blocks)
    return out.transpose(1, 0, 2)


def _kernel(x: jax.Array, blocks: jax.Array) -> jax.Array:
    shape = jax.ShapeDtypeStruct((x.shape[0], *blocks.shape[::2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, shape)(x, blocks)


def _local(x: jax.Array, blocks: jax.Array) -> jax.Array:
    """One device's product: the kernel when the program is lowered for CPU."""
    return jax.lax.platform_dependent(x, blocks, cpu=_kernel, default=einsum_block_matmul)


def _axes(arg_shapes) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Mesh axes of the rows (from x), the blocks and the contracted axis (from the blocks),
    each kept only where no earlier one uses the same mesh axis."""
    x_spec = tuple(arg_shapes[0].sharding.spec) + (None, None)
    w_spec = tuple(arg_shapes[1].sharding.spec) + (None, None, None)
    rows = entry_names(x_spec[0])
    blocks = tuple(a for a in entry_names(w_spec[0]) if a not in rows)
    contracted = tuple(a for a in entry_names(w_spec[1]) if a not in rows + blocks)
    return rows, blocks, contracted


def _infer(mesh, arg_shapes, result_shape) -> NamedSharding:
    rows, blocks, _ = _axes(arg_shapes)
    return NamedSharding(mesh, P(spec_entry(rows), spec_entry(blocks), None))


def _partition(mesh, arg_shapes, result_shape):
    rows, blocks, contracted = _axes(arg_shapes)
    m, p, k = (spec_entry(a) for a in (rows, blocks, contracted))

    def lower(x: jax.Array, w: jax.Array) -> jax.Array:
        out = _local(x, w)
        return jax.lax.psum(out, contracted) if contracted else out

    args = (NamedSharding(mesh, P(m, k)), NamedSharding(mesh, P(p, k, None)))
    return mesh, lower, NamedSharding(mesh, P(m, p, None)), args


@custom_partitioning
def _partitioned(x: jax.Array, blocks: jax.Array) -> jax.Array:
    return _local(x, blocks)


_partitioned.def_partition(
    infer_sharding_from_operands=_infer,
    partition=_partition,
    sharding_rule="m k, p k b -> m p b",
    reduction_factors=("k",),
)


def block_matmul(x: Float[Array, "M K"], blocks: Float[Array, "P K B"]) -> Float[Array, "M P B"]:
    """``out[m, p, b] = sum_k x[m, k] * blocks[p, k, b]``: ``x`` times the ``[K, P*B]``
    matrix whose column ``p*B + b`` is ``blocks[p, :, b]``.

    float32 on CPU with the kernel available: the C++ kernel (each output summed over ``k``
    in order with fused multiply-adds, so a row's result does not depend on the other rows).
    Anything else: :func:`einsum_block_matmul`. ``B`` must be a multiple of 16.
    """
    if x.ndim != 2 or blocks.ndim != 3 or x.shape[1] != blocks.shape[1]:
        raise ValueError(
            f"block_matmul: x {x.shape} and blocks {blocks.shape} must be [M, K] and [P, K, B]"
        )
    if x.dtype != jnp.float32 or blocks.dtype != jnp.float32 or blocks.shape[2] % 16:
        return einsum_block_matmul(x, blocks)
    # A non-CPU default backend never builds the kernel (its programs would not use it).
    if jax.default_backend() != "cpu" or not available():
        return einsum_block_matmul(x, blocks)
    # Chosen where the program is lowered: a CPU process may compile for a TPU topology
    # (the dry run's --topology), whose compiler has no partitioner for the kernel's call.
    return jax.lax.platform_dependent(x, blocks, cpu=_partitioned, default=einsum_block_matmul)
