"""The CPU decode-attention kernel (jaxrlhf/kernels) against a float64 NumPy reference,
XLA's einsums, and itself across masks, rows and meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.kernels import decode_attention as da

pytestmark = pytest.mark.skipif(
    not da.available(), reason=f"kernel unavailable: {da.unavailable_reason()}"
)

SCALE = 0.125


def _operands(r, kv, g, h, s, seed=0):
    """q, k, v and a mask with left padding, a gap and a different length per row (every
    row attends to at least one slot; a row may end anywhere, including the last slot)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((r, kv, g, h)).astype(np.float32)
    k = rng.standard_normal((r, kv, h, s)).astype(np.float32)
    v = rng.standard_normal((r, kv, s, h)).astype(np.float32)
    ok = np.zeros((r, s), bool)
    for row in range(r):
        start = int(rng.integers(0, s // 2))
        end = int(rng.integers(start + 1, s + 1)) if row else s  # row 0 ends at the last slot
        ok[row, start:end] = True
        if end - start > 3:
            ok[row, start + 1] = False  # a gap (a padded token inside the prompt)
    return q, k, v, ok


def _reference(q, k, v, ok):
    """float64 attention: softmax over the slots with ok, the values' weighted sum."""
    scores = np.einsum("rcgh,rchs->rcgs", q.astype(np.float64), k.astype(np.float64)) * SCALE
    scores = np.where(ok[:, None, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("rcgs,rcsh->rcgh", p, v.astype(np.float64))


def _attend(q, k, v, ok):
    return np.asarray(jax.jit(da.decode_attention, static_argnums=4)(q, k, v, ok, SCALE))


@pytest.mark.parametrize(
    "r,kv,g,h,s",
    [
        (1, 1, 1, 16, 16),  # one head, one chunk of slots
        (3, 2, 3, 64, 48),  # bench-M's heads (G = 3) over a width of 3 chunks
        (5, 1, 9, 32, 80),  # G = 9: query heads in groups of 4, 4 and 1
        (4, 4, 1, 128, 192),  # multi-head (G = 1), H = 128: the values in two passes
        (2, 2, 6, 80, 32),  # H = 80: 4 + 1 vectors of the head dimension
        (3, 2, 3, 16, 15),  # S < 16: one partial chunk
        (4, 2, 3, 64, 197),  # S = 12 chunks + 5 slots
    ],
)
def test_matches_float64_reference(r, kv, g, h, s):
    """Within 1e-5 of float64 attention (float32 scores of H terms and a softmax of S terms,
    exp within 2 ulp: a few 1e-7 on outputs of size ~1), and within 1e-6 of XLA's einsums."""
    q, k, v, ok = _operands(r, kv, g, h, s)
    out = _attend(q, k, v, ok)
    assert out.shape == (r, kv, g, h)
    np.testing.assert_allclose(out, _reference(q, k, v, ok), rtol=0, atol=1e-5)
    xla = np.asarray(da.xla_decode_attention(q, k, v, ok, SCALE))
    np.testing.assert_allclose(out, xla, rtol=0, atol=1e-6)


@pytest.mark.parametrize("s, wide", [(96, 32), (96, 5), (90, 37)])
def test_reads_only_attended_slots(s, wide):
    """Bitwise: NaN and inf in every slot a row does not attend to (padding, slots not yet
    written, past its last) change nothing; nor does widening the cache by unattended
    slots, to a width that need not be a multiple of 16 (the engine's views and the static
    sampler's cache differ in width)."""
    q, k, v, ok = _operands(6, 2, 3, 64, s, seed=1)
    ok[1, :40] = False  # a row whose first attended slot is past two whole chunks
    ok[1, 40:50] = True
    out = _attend(q, k, v, ok)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[np.broadcast_to(~ok[:, None, None, :], k.shape)] = np.nan
    v_bad[np.broadcast_to(~ok[:, None, :, None], v.shape)] = np.inf
    np.testing.assert_array_equal(_attend(q, k_bad, v_bad, ok), out)
    k_wide = np.concatenate([k, np.full((*k.shape[:3], wide), np.nan, np.float32)], 3)
    v_wide = np.concatenate([v, np.full((*v.shape[:2], wide, v.shape[3]), np.nan, np.float32)], 2)
    ok_wide = np.concatenate([ok, np.zeros((ok.shape[0], wide), bool)], 1)
    np.testing.assert_array_equal(_attend(q, k_wide, v_wide, ok_wide), out)
    # 32 unattended slots in front: the same lanes, two more chunks skipped.
    k_front = np.concatenate([np.full((*k.shape[:3], 32), np.nan, np.float32), k], 3)
    v_front = np.concatenate([np.full((*v.shape[:2], 32, v.shape[3]), np.nan, np.float32), v], 2)
    ok_front = np.concatenate([np.zeros((ok.shape[0], 32), bool), ok], 1)
    np.testing.assert_array_equal(_attend(q, k_front, v_front, ok_front), out)


def test_rows_in_a_partial_chunk_and_single_slots():
    """A row whose attended slots all lie in the partial last chunk (S = 45: slots 32..44),
    and rows of one attended slot (the output is that slot's value, exactly)."""
    q, k, v, ok = _operands(4, 2, 3, 32, 45, seed=8)
    ok[:] = False
    ok[0, 33:45] = True
    ok[1, 44] = True
    ok[2, 0] = True
    ok[3, 17] = True
    out = _attend(q, k, v, ok)
    np.testing.assert_allclose(out, _reference(q, k, v, ok), rtol=0, atol=1e-5)
    for row, slot in ((1, 44), (2, 0), (3, 17)):
        np.testing.assert_array_equal(out[row], np.repeat(v[row, :, slot][:, None], 3, 1))


def test_scores_far_below_the_max():
    """Scores spread over hundreds (exp reaches its underflow, below -86, and every
    exponent between): within 1e-5 of float64, and a row attending to no slot gives 0."""
    q, k, v, ok = _operands(4, 2, 3, 32, 64, seed=6)
    out = np.asarray(jax.jit(da.decode_attention, static_argnums=4)(q, k, v, ok, 10.0))
    scores = np.einsum("rcgh,rchs->rcgs", q.astype(np.float64), k.astype(np.float64)) * 10.0
    scores = np.where(ok[:, None, None, :], scores, -np.inf)
    assert (scores.max(-1) - np.where(np.isinf(scores), np.inf, scores).min(-1)).max() > 200
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("rcgs,rcsh->rcgh", p, v.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
    ok[2] = False
    out = _attend(q, k, v, ok)
    np.testing.assert_array_equal(out[2], 0.0)


def test_lowers_to_the_custom_call():
    """On CPU the jitted function is the FFI call (not XLA's fallback)."""
    q, k, v, ok = _operands(2, 2, 3, 16, 20, seed=7)
    text = jax.jit(da.decode_attention, static_argnums=4).lower(q, k, v, ok, SCALE).as_text()
    assert da.TARGET in text


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Bitwise: rows computed alone or in another batch equal the whole batch's."""
    q, k, v, ok = _operands(12, 2, 3, 64, 64, seed=2)
    whole = _attend(q, k, v, ok)
    for rows in (slice(0, 1), slice(3, 8), slice(11, 12)):
        np.testing.assert_array_equal(_attend(q[rows], k[rows], v[rows], ok[rows]), whole[rows])


def test_other_inputs_use_xla():
    """bfloat16, or a head dimension that is not a multiple of 16, is XLA's attention
    exactly; wrong shapes are a ValueError."""
    q, k, v, ok = _operands(2, 2, 2, 64, 48, seed=3)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    np.testing.assert_array_equal(
        np.asarray(da.decode_attention(qb, kb, vb, ok, SCALE)),
        np.asarray(da.xla_decode_attention(qb, kb, vb, ok, SCALE)),
    )
    q, k, v, ok = _operands(2, 2, 2, 24, 40, seed=4)
    np.testing.assert_array_equal(
        np.asarray(da.decode_attention(q, k, v, ok, SCALE)),
        np.asarray(da.xla_decode_attention(q, k, v, ok, SCALE)),
    )
    with pytest.raises(ValueError, match="must be"):
        da.decode_attention(q, k[:, :, :, :16], v, ok, SCALE)


@pytest.mark.parametrize(
    "spec",
    [P("data", None), P("data", "model"), P(None, "model"), P(("data", "model"), None)],
)
def test_partitions_over_rows_and_heads(spec):
    """On a 2 x 4 mesh of the suite's 8 CPU devices, rows and kv heads split any way give
    one device's result bitwise (each (row, head) is computed alone)."""
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))
    q, k, v, ok = _operands(8, 4, 3, 64, 64, seed=5)
    one = _attend(q, k, v, ok)
    cache = NamedSharding(mesh, P(*spec, None, None))
    rows = NamedSharding(mesh, P(spec[0], None))
    args = [jax.device_put(x, cache) for x in (q, k, v)] + [jax.device_put(ok, rows)]
    out = jax.jit(da.decode_attention, static_argnums=4)(*args, SCALE)
    np.testing.assert_array_equal(np.asarray(out), one)
    assert (*out.sharding.spec, None, None)[:2] == tuple(spec)  # no gather of the output
    # q and ok laid out otherwise (replicated): the kernel follows the cache's layout.
    args[0] = jax.device_put(q, NamedSharding(mesh, P()))
    args[3] = jax.device_put(ok, NamedSharding(mesh, P()))
    out = jax.jit(da.decode_attention, static_argnums=4)(*args, SCALE)
    np.testing.assert_array_equal(np.asarray(out), one)


def _new_entries(r, kv, h, s, seed):
    """Each row's new key and value, and its slot: row 1's is past the cache (>= S), so it
    writes nothing; the others are spread over the width, the last row at slot S - 1."""
    rng = np.random.default_rng(seed)
    k_new = rng.standard_normal((r, kv, h)).astype(np.float32)
    v_new = rng.standard_normal((r, kv, h)).astype(np.float32)
    slot = rng.integers(0, s, r).astype(np.int32)
    slot[1], slot[-1] = s + 3, s - 1
    if r > 3:
        slot[2] = -1  # negative: past the cache too (XLA's scatter would wrap it)
    return k_new, v_new, slot


def _write_and_attend(*args):
    return jax.jit(da.write_and_attend, static_argnums=7)(*args, SCALE)


@pytest.mark.parametrize("r,kv,g,h,s", [(4, 2, 3, 64, 48), (5, 1, 2, 16, 21)])
def test_write_and_attend_equals_the_scatter_then_the_attention(r, kv, g, h, s):
    """Bitwise: the kernel's updated cache is XLA's scatter of one slot per row (a slot >= S
    writes nothing), and its attention is :func:`decode_attention` over that cache (the
    rows attend to their new slot: ok includes it)."""
    q, k, v, ok = _operands(r, kv, g, h, s, seed=11)
    k_new, v_new, slot = _new_entries(r, kv, h, s, seed=12)
    ok[np.arange(r), np.minimum(slot, s - 1)] = True
    out, k_out, v_out = _write_and_attend(q, k, v, ok, k_new, v_new, slot)
    _, k_ref, v_ref = da.xla_write_and_attend(q, k, v, ok, k_new, v_new, slot, SCALE)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))
    np.testing.assert_array_equal(np.asarray(k_out)[1], k[1])  # slot past the cache
    if r > 3:
        np.testing.assert_array_equal(np.asarray(v_out)[2], v[2])  # a negative slot
    np.testing.assert_array_equal(np.asarray(out), _attend(q, np.asarray(k_ref), v_ref, ok))
    text = jax.jit(da.write_and_attend, static_argnums=7).lower(
        q, k, v, ok, k_new, v_new, slot, SCALE
    )
    assert da.WRITE_TARGET in text.as_text()


def test_write_and_attend_updates_a_donated_cache_in_place():
    """With the cache donated (as the decode loop's carry is), the updated cache is the
    input's buffer: no copy of the cache is made."""
    q, k, v, ok = _operands(3, 2, 3, 64, 32, seed=13)
    k_new, v_new, slot = _new_entries(3, 2, 64, 32, seed=14)
    k_in, v_in = jnp.asarray(k), jnp.asarray(v)
    pointers = (k_in.unsafe_buffer_pointer(), v_in.unsafe_buffer_pointer())
    step = jax.jit(da.write_and_attend, static_argnums=7, donate_argnums=(1, 2))
    _, k_out, v_out = step(q, k_in, v_in, ok, k_new, v_new, slot, SCALE)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    want = da.xla_write_and_attend(q, k, v, ok, k_new, v_new, slot, SCALE)
    for a, b in zip((k_out, v_out), want[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hlo = step.lower(q, k, v, ok, k_new, v_new, slot, SCALE).compile().as_text()
    caches = ("f32[3,2,64,32]", "f32[3,2,32,64]")
    assert not [
        line
        for line in hlo.splitlines()
        if " copy(" in line and line.count(caches[0]) + line.count(caches[1])
    ]


def test_write_and_attend_one_slot_for_every_row():
    """A scalar slot (the static sampler's step) is the same slot in every row: bitwise the
    kernel's result for that slot broadcast, and in XLA one dynamic_update_slice."""
    q, k, v, ok = _operands(3, 2, 3, 64, 32, seed=19)
    k_new, v_new, _ = _new_entries(3, 2, 64, 32, seed=20)
    ok[:, 9] = True
    got = _write_and_attend(q, k, v, ok, k_new, v_new, np.int32(9))
    want = _write_and_attend(q, k, v, ok, k_new, v_new, np.full(3, 9, np.int32))
    xla = da.xla_write_and_attend(q, k, v, ok, k_new, v_new, np.int32(9), SCALE)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(got[1:], xla[1:], strict=True):  # the cache; out sums in another order
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = (
        jax.jit(da.xla_write_and_attend, static_argnums=7)
        .lower(q, k, v, ok, k_new, v_new, np.int32(9), SCALE)
        .as_text()
    )
    assert "dynamic_update_slice" in text and "scatter" not in text


def test_write_and_attend_other_inputs_use_xla():
    """A head dimension that is not a multiple of 16 is XLA's scatter and attention
    exactly; wrong shapes of the new entries are a ValueError."""
    q, k, v, ok = _operands(3, 2, 2, 24, 40, seed=15)
    k_new, v_new, slot = _new_entries(3, 2, 24, 40, seed=16)
    got = da.write_and_attend(q, k, v, ok, k_new, v_new, slot, SCALE)
    want = da.xla_write_and_attend(q, k, v, ok, k_new, v_new, slot, SCALE)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = (
        jax.jit(da.write_and_attend, static_argnums=7)
        .lower(q, k, v, ok, k_new, v_new, slot, SCALE)
        .as_text()
    )
    assert da.WRITE_TARGET not in text
    with pytest.raises(ValueError, match="k_new"):
        da.write_and_attend(q, k, v, ok, k_new[:, :1], v_new, slot, SCALE)


@pytest.mark.parametrize("spec", [P("data", None), P("data", "model"), P(None, "model")])
def test_write_and_attend_partitions_over_rows_and_heads(spec):
    """On a 2 x 4 mesh, rows and kv heads split any way give one device's results bitwise,
    laid out as the cache was."""
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))
    q, k, v, ok = _operands(8, 4, 3, 64, 64, seed=17)
    k_new, v_new, slot = _new_entries(8, 4, 64, 64, seed=18)
    one = _write_and_attend(q, k, v, ok, k_new, v_new, slot)
    four = NamedSharding(mesh, P(*spec, None, None))
    three = NamedSharding(mesh, P(*spec, None))
    rows = NamedSharding(mesh, P(spec[0]))
    args = [jax.device_put(x, four) for x in (q, k, v)]
    args += [jax.device_put(ok, NamedSharding(mesh, P(spec[0], None)))]
    args += [jax.device_put(x, three) for x in (k_new, v_new)] + [jax.device_put(slot, rows)]
    got = _write_and_attend(*args)
    for a, b in zip(got, one, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert (*a.sharding.spec, None, None)[:2] == tuple(spec)
