"""One decode step's attention over a per-row KV cache, by a C++ kernel on CPU.

The decode loop's cache holds every row's prompt and generated slots at the full width
(prompt plus the token budget), and most of them are not yet written or are padding. XLA
multiplies the query by all of them; :func:`decode_attention` runs the step as one XLA FFI
custom call (``decode_attention.cc``, compiled on first use by :mod:`jaxrlhf.kernels.build`)
that reads each row's cache only over the 16-slot chunks from its first attended slot to
its last, and ignores every slot it does not attend to (its score is dropped, its value
never read). On other platforms, where the kernel cannot be built, or for shapes it does
not take, it is :func:`xla_decode_attention`, the same function in XLA. It partitions over
the rows and the kv heads on any mesh. :func:`write_and_attend` writes the step's key and
value into each row's slot first, in the same kernel (the decode loop's use).

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
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.kernels import build
from jaxrlhf.kernels.mesh_axes import entry_names, spec_entry

TARGET = "jaxrlhf_decode_attention"
WRITE_TARGET = "jaxrlhf_decode_attention_write"
SOURCE = Path(__file__).with_name("decode_attention.cc")
LANES = 16  # the kernel's vector width: H must be a multiple of it

_MASKED = jnp.finfo(jnp.float32).min


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is built and registered with XLA (once per process), else why
    not (``JAXRLHF_CPU_KERNELS=0``, or the build failed, also warned)."""
    return build.register(
        SOURCE,
        {TARGET: "JaxrlhfDecodeAttention", WRITE_TARGET: "JaxrlhfDecodeAttentionWrite"},
        "CPU decode attention uses XLA's einsums",
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


def _specs(arg_shapes) -> tuple[object, object]:
    """The mesh axes of the cache's rows and kv heads (k, the largest operand, keeps its
    layout; q, ok and the output follow it). Other axes are gathered."""
    spec = tuple(arg_shapes[1].sharding.spec) + (None, None)
    rows = entry_names(spec[0])
    heads = tuple(a for a in entry_names(spec[1]) if a not in rows)
    return spec_entry(rows), spec_entry(heads)


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


def write_slot(
    k: Float[Array, "R K H S"],
    v: Float[Array, "R K S H"],
    k_new: Float[Array, "R K H"],
    v_new: Float[Array, "R K H"],
    slot: Int[Array, ""] | Int[Array, " R"],
) -> tuple[Float[Array, "R K H S"], Float[Array, "R K S H"]]:
    """The cache with each row's new key and value in its slot, in XLA (in place where the
    cache is given up, as a loop carry is): one ``dynamic_update_slice`` for a slot shared
    by every row ([], in ``[0, S)``), else a scatter of one slot per row ([R]; a slot
    outside ``[0, S)`` writes nothing). New entries are cast to the cache's dtype."""
    k, v, slot = jnp.asarray(k), jnp.asarray(v), jnp.asarray(slot)
    k_new, v_new = jnp.asarray(k_new, k.dtype), jnp.asarray(v_new, v.dtype)
    if slot.ndim == 0:
        k = jax.lax.dynamic_update_slice(k, k_new[..., None], (0, 0, 0, slot))
        v = jax.lax.dynamic_update_slice(v, v_new[:, :, None], (0, 0, slot, 0))
        return k, v
    each = jnp.arange(k.shape[0])
    slot = jnp.where(slot < 0, k.shape[3], slot)  # negative: past the cache, dropped
    k = k.at[each, :, :, slot].set(k_new, mode="drop")
    v = v.at[each, :, slot, :].set(v_new, mode="drop")
    return k, v


def xla_write_and_attend(
    q: Float[Array, "R K G H"],
    k: Float[Array, "R K H S"],
    v: Float[Array, "R K S H"],
    ok: Bool[Array, "R S"],
    k_new: Float[Array, "R K H"],
    v_new: Float[Array, "R K H"],
    slot: Int[Array, ""] | Int[Array, " R"],
    scale: float,
) -> tuple[Float[Array, "R K G H"], Float[Array, "R K H S"], Float[Array, "R K S H"]]:
    """:func:`write_and_attend` in XLA: :func:`write_slot`, then
    :func:`xla_decode_attention`."""
    k, v = write_slot(k, v, k_new, v_new, slot)
    return xla_decode_attention(q, k, v, ok, scale), k, v


def _write_kernel(q, k, v, ok, k_new, v_new, slot, *, scale: float):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call(WRITE_TARGET, shapes, input_output_aliases={1: 1, 2: 2})
    return tuple(call(q, k, v, ok, k_new, v_new, slot, scale=np.float32(scale)))


def _write_local(q, k, v, ok, k_new, v_new, slot, scale: float):
    """One device's write and attention: the kernel when the program is lowered for CPU."""
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        ok,
        k_new,
        v_new,
        slot,
        cpu=functools.partial(_write_kernel, scale=scale),
        default=functools.partial(xla_write_and_attend, scale=scale),
    )


def _write_infer(scale, mesh, arg_shapes, result_shape):
    rows, heads = _specs(arg_shapes)
    return tuple(NamedSharding(mesh, P(rows, heads, None, None)) for _ in range(3))


def _write_partition(scale, mesh, arg_shapes, result_shape):
    rows, heads = _specs(arg_shapes)
    four = NamedSharding(mesh, P(rows, heads, None, None))
    new = NamedSharding(mesh, P(rows, heads, None))
    args = (
        four,
        four,
        four,
        NamedSharding(mesh, P(rows, None)),
        new,
        new,
        NamedSharding(mesh, P(rows)),
    )

    def lower(q, k, v, ok, k_new, v_new, slot):
        return _write_local(q, k, v, ok, k_new, v_new, slot, scale)

    return mesh, lower, (four, four, four), args


@functools.partial(custom_partitioning, static_argnums=(7,))
def _write_partitioned(q, k, v, ok, k_new, v_new, slot, scale: float):
    return _write_local(q, k, v, ok, k_new, v_new, slot, scale)


_write_partitioned.def_partition(
    infer_sharding_from_operands=_write_infer,
    partition=_write_partition,
    sharding_rule=("r c g h, r c h s, r c s h, r s, r c h, r c h, r -> r c g h, r c h s, r c s h"),
)


def _check_shapes(name: str, q, k, v, ok) -> None:
    r, c, _, h = q.shape if q.ndim == 4 else (None,) * 4
    s = ok.shape[-1]
    if q.ndim != 4 or k.shape != (r, c, h, s) or v.shape != (r, c, s, h) or ok.shape != (r, s):
        raise ValueError(
            f"{name}: q {q.shape}, k {k.shape}, v {v.shape}, ok {ok.shape} must be "
            "[R, K, G, H], [R, K, H, S], [R, K, S, H], [R, S]"
        )


def _kernel_takes(q, k, v) -> bool:
    """Whether the C++ kernel runs: float32, H a multiple of 16, CPU, and built (a non-CPU
    default backend never builds it: its programs would not use it)."""
    kernel_ok = all(x.dtype == jnp.float32 for x in (q, k, v)) and q.shape[3] % LANES == 0
    return kernel_ok and jax.default_backend() == "cpu" and available()


def write_and_attend(
    q: Float[Array, "R K G H"],
    k: Float[Array, "R K H S"],
    v: Float[Array, "R K S H"],
    ok: Bool[Array, "R S"],
    k_new: Float[Array, "R K H"],
    v_new: Float[Array, "R K H"],
    slot: Int[Array, ""] | Int[Array, " R"],
    scale: float,
) -> tuple[Float[Array, "R K G H"], Float[Array, "R K H S"], Float[Array, "R K S H"]]:
    """Writes each row's new key and value into its cache slot, then attends over the cache:
    ``(out, k, v)`` with ``k[r, :, :, slot[r]] = k_new[r]`` and ``v[r, :, slot[r]] =
    v_new[r]`` and ``out`` as :func:`decode_attention` of the updated cache.

    ``slot`` is one slot per row ([R]; a slot outside ``[0, S)`` writes nothing: the
    engine's slots that do not decode the step) or one for every row ([], in ``[0, S)``:
    the static sampler's step).

    The decode step of a per-row cache writes one slot per row, and in the head-major ``k``
    that slot is one float in each of ``K * H`` cache lines, which XLA's CPU scatter writes
    one after another, each a miss. Where :func:`decode_attention` runs its kernel, this
    runs the same kernel with the write folded in (each (row, kv head) writes its slot right
    before reading the lines it is in) and the cache updated in place (the outputs alias
    ``k`` and ``v``; give up the inputs, as a loop carry does, or XLA copies them first).
    Elsewhere: :func:`xla_write_and_attend`. The results are the same either way, bit for bit
    in ``k`` and ``v``.
    """
    _check_shapes("write_and_attend", q, k, v, ok)
    rows, heads, _, h = q.shape
    slot = jnp.asarray(slot)
    entries_ok = k_new.shape == v_new.shape == (rows, heads, h)
    if not entries_ok or slot.shape not in ((), (rows,)):
        raise ValueError(
            f"write_and_attend: k_new {k_new.shape}, v_new {v_new.shape} and slot {slot.shape} "
            f"must be {(rows, heads, h)}, {(rows, heads, h)} and () or {(rows,)}"
        )
    if not _kernel_takes(q, k, v) or k_new.dtype != jnp.float32 or v_new.dtype != jnp.float32:
        return xla_write_and_attend(q, k, v, ok, k_new, v_new, slot, scale)
    slots = jnp.broadcast_to(slot.astype(jnp.int32), (rows,))
    # Chosen where the program is lowered: a CPU process may compile for a TPU topology
    # (the dry run's --topology), whose compiler has no partitioner for the kernel's call.
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        ok.astype(jnp.bool_),
        k_new,
        v_new,
        slots,
        cpu=lambda *args: _write_partitioned(*args, float(scale)),
        default=functools.partial(xla_write_and_attend, scale=scale),
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
    _check_shapes("decode_attention", q, k, v, ok)
    if not _kernel_takes(q, k, v):
        return xla_decode_attention(q, k, v, ok, scale)
    # Chosen where the program is lowered (see write_and_attend).
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        ok.astype(jnp.bool_),
        cpu=lambda *args: _partitioned(*args, float(scale)),
        default=functools.partial(xla_decode_attention, scale=scale),
    )
