"""One decode step's attention over a per-row KV cache, by a C++ kernel on CPU.

The decode loop's cache holds every row's prompt and generated slots at the full width
(prompt plus the token budget), and most of them are not yet written or are padding. XLA
multiplies the query by all of them; :func:`decode_attention` runs the step as one XLA FFI
custom call (``decode_attention.cc``, compiled on first use by :mod:`jaxrlhf.kernels.build`)
that reads each row's cache only over the 16-slot chunks from its first attended slot to
its last, and ignores every slot it does not attend to (its score is dropped, its value
never read). On other platforms, where the kernel cannot be built, or for shapes it does
not take, it is :func:`xla_decode_attention`, the same function in XLA. It partitions over
the rows and the kv heads on any mesh.

``JAXRLHF_CPU_KERNELS=0`` turns it off (with the block-matmul kernel). For inference only:
no gradient, no batching rule, and inside ``jax.shard_map`` it needs ``check_vma=False``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from jaxrlhf.kernels import build

TARGET = "jaxrlhf_decode_attention"
SOURCE = Path(__file__).with_name("decode_attention.cc")
LANES = 16  # the kernel's vector width: H must be a multiple of it

_MASKED = jnp.finfo(jnp.float32).min


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is built and registered with XLA (once per process), else why
    not (``JAXRLHF_CPU_KERNELS=0``, or the build failed, also warned)."""
    return build.register(
        SOURCE, TARGET, "JaxrlhfDecodeAttention", "CPU decode attention uses XLA's einsums"
    )


def available() -> bool:
    """Whether :func:`decode_attention` runs the C++ kernel on CPU (builds it on first call)."""
    return unavailable_reason() is None


def xla_decode_attention(
    q: Float[Array, "R K G H"],
    k: Float[Array, "R K H S"],
    v: Float[Array, "R K S H"],
    ok: Bool[Array, "R S"],
    scale: float,
) -> Float[Array, "R K G H"]:
    """:func:`decode_attention` in XLA: float32 scores, masked softmax, the values' mix."""
    scores = jnp.einsum("RKGH,RKHS->RKGS", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(ok[:, None, None, :], scores * scale, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("RKGS,RKSH->RKGH", probs, v.astype(q.dtype))


def _kernel(q, k, v, ok, *, scale: float) -> jax.Array:
    shape = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, shape)(q, k, v, ok, scale=np.float32(scale))


def _local(q, k, v, ok, scale: float) -> jax.Array:
    """One device's attention: the kernel when the program is lowered for CPU."""
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        ok,
        cpu=functools.partial(_kernel, scale=scale),
        default=functools.partial(xla_decode_attention, scale=scale),
    )


def _entry(spec: tuple, i: int) -> object:
    return spec[i] if i < len(spec) else None


def _axes(entry: object) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _as_entry(axes: tuple[str, ...]) -> object:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _specs(arg_shapes) -> tuple[object, object]:
    """The mesh axes of the cache's rows and kv heads (k, the largest operand, keeps its
    layout; q, ok and the output follow it). Other axes are gathered."""
    spec = tuple(arg_shapes[1].sharding.spec)
    rows = _axes(_entry(spec, 0))
    heads = tuple(a for a in _axes(_entry(spec, 1)) if a not in rows)
    return _as_entry(rows), _as_entry(heads)


def _infer(scale, mesh, arg_shapes, result_shape) -> NamedSharding:
    rows, heads = _specs(arg_shapes)
    return NamedSharding(mesh, P(rows, heads, None, None))


def _partition(scale, mesh, arg_shapes, result_shape):
    rows, heads = _specs(arg_shapes)
    args = (
        NamedSharding(mesh, P(rows, heads, None, None)),
        NamedSharding(mesh, P(rows, heads, None, None)),
        NamedSharding(mesh, P(rows, heads, None, None)),
        NamedSharding(mesh, P(rows, None)),
    )

    def lower(q, k, v, ok):
        return _local(q, k, v, ok, scale)

    return mesh, lower, NamedSharding(mesh, P(rows, heads, None, None)), args


@functools.partial(custom_partitioning, static_argnums=(4,))
def _partitioned(q, k, v, ok, scale: float) -> jax.Array:
    return _local(q, k, v, ok, scale)


_partitioned.def_partition(
    infer_sharding_from_operands=_infer,
    partition=_partition,
    sharding_rule="r c g h, r c h s, r c s h, r s -> r c g h",
)


def decode_attention(
    q: Float[Array, "R K G H"],
    k: Float[Array, "R K H S"],
    v: Float[Array, "R K S H"],
    ok: Bool[Array, "R S"],
    scale: float,
) -> Float[Array, "R K G H"]:
    """Attention of one query token per row over its cache: ``out[r, c, g] = sum_s
    softmax_s(scale * q[r, c, g] . k[r, c, :, s] over the slots with ok[r, s]) *
    v[r, c, s]``, for the G query heads of kv head c.

    Shapes: R rows, K kv heads, G query heads per kv head, H the head dimension, S cache
    slots; ``k`` is head-major ``[H, S]`` per head, as ``generation/cache.py`` stores it.
    Every row must attend to at least one slot.

    float32 on CPU with the kernel available and H a multiple of 16: the C++ kernel
    (``decode_attention.cc`` states its summation order; a row's result does not depend on
    the other rows, on unattended slots appended past its last attended one or prepended in
    whole 16-slot chunks, or on what unattended slots hold). Anything else:
    :func:`xla_decode_attention`. A row that attends to no slot gets 0 from the kernel and
    the mean of its values from XLA (the decode masks out every slot of an engine slot that
    does not decode the step; its output is dropped).
    """
    r, c, _, h = q.shape if q.ndim == 4 else (None,) * 4
    s = ok.shape[-1]
    if q.ndim != 4 or k.shape != (r, c, h, s) or v.shape != (r, c, s, h) or ok.shape != (r, s):
        raise ValueError(
            f"decode_attention: q {q.shape}, k {k.shape}, v {v.shape}, ok {ok.shape} must be "
            "[R, K, G, H], [R, K, H, S], [R, K, S, H], [R, S]"
        )
    kernel_ok = all(x.dtype == jnp.float32 for x in (q, k, v)) and q.shape[3] % LANES == 0
    # A non-CPU default backend never builds the kernel (its programs would not use it).
    if not kernel_ok or jax.default_backend() != "cpu" or not available():
        return xla_decode_attention(q, k, v, ok, scale)
    return _partitioned(q, k, v, ok.astype(jnp.bool_), float(scale))
