"""The CPU block-matmul kernel (jaxrlhf/kernels) against NumPy, across shapes and meshes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.kernels import block_matmul as bm
from jaxrlhf.kernels import build

pytestmark = pytest.mark.skipif(
    not bm.available(), reason=f"kernel unavailable: {bm.unavailable_reason()}"
)


def _operands(m: int, k: int, p: int, b: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((p, k, b)) / np.sqrt(k)).astype(np.float32)
    return x, w


def _reference(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact product (float64) and the float32 error bound of a K-term sum, K * 2^-24 *
    (|x| @ |w|) (recursive summation: gamma_K ~ K u, u = 2^-24)."""
    exact = np.einsum("mk,pkb->mpb", x.astype(np.float64), w.astype(np.float64))
    scale = np.einsum("mk,pkb->mpb", np.abs(x).astype(np.float64), np.abs(w).astype(np.float64))
    return exact, x.shape[1] * 2.0**-24 * scale


@pytest.mark.parametrize(
    "m,k,p,b",
    [
        (1, 1, 1, 16),
        (2, 37, 3, 32),
        (5, 64, 2, 64),
        (6, 100, 1, 48),
        (7, 256, 4, 64),
        (13, 768, 3, 64),
        (32, 96, 5, 32),
        (40, 33, 2, 16),
        (9, 128, 67, 16),
        (32, 200, 40, 64),
    ],
)
def test_matches_numpy(m, k, p, b):
    """Every shape, including row counts that leave partial tiles (not multiples of 6),
    blocks narrower than a tile's columns, and enough blocks that the threads claim several
    chunks of them (each thread claims its next chunk ahead, to prefetch its first block),
    within the float32 summation bound."""
    x, w = _operands(m, k, p, b)
    out = np.asarray(jax.jit(bm.block_matmul)(jnp.asarray(x), jnp.asarray(w)))
    exact, bound = _reference(x, w)
    assert out.shape == (m, p, b)
    assert np.all(np.abs(out - exact) <= bound)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Bitwise: row r of a 32-row product equals the same row multiplied alone or among 7
    (the kernel sums each element in k order whatever tile the row lands in)."""
    x, w = _operands(32, 300, 3, 64, seed=1)
    f = jax.jit(bm.block_matmul)
    whole = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
    for rows in (slice(0, 1), slice(5, 12), slice(29, 32)):
        np.testing.assert_array_equal(
            np.asarray(f(jnp.asarray(x[rows]), jnp.asarray(w))), whole[rows]
        )


def test_other_dtypes_use_xla():
    """bfloat16 (not a kernel type) falls back to XLA's batched matmul of the blocks."""
    x, w = _operands(4, 64, 2, 32)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    out = bm.block_matmul(xb, wb)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(bm.einsum_block_matmul(xb, wb)))
    # Against the exact product of the bfloat16-rounded operands: the output's own rounding
    # (2^-8 relative) plus float32 accumulation.
    exact, _ = _reference(np.asarray(xb, np.float32), np.asarray(wb, np.float32))
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=2**-7, atol=1e-2)
    with pytest.raises(ValueError, match="must be"):
        bm.block_matmul(jnp.asarray(x), jnp.asarray(w[:, :10]))


@pytest.mark.parametrize(
    "x_spec,w_spec",
    [
        (P("data", None), P(None, None, None)),  # rows split (data-parallel decode)
        (P("data", None), P("model", None, None)),  # rows and blocks split
        (P(None, None), P("model", None, None)),  # blocks split (tensor-parallel outputs)
        (P(None, "model"), P(None, "model", None)),  # contracted axis split: psum
        (P("data", None), P("data", None, None)),  # one mesh axis asked for twice
    ],
)
def test_partitions_like_the_einsum(x_spec, w_spec):
    """On a 2 x 4 mesh of the suite's 8 CPU devices the product equals one device's:
    bitwise where rows or blocks are split (each device runs the same per-element sums),
    within the summation bound where the contracted axis is split (partial sums added)."""
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))
    x, w = _operands(16, 128, 8, 32, seed=2)
    one = np.asarray(jax.jit(bm.block_matmul)(jnp.asarray(x), jnp.asarray(w)))
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    out = np.asarray(jax.jit(bm.block_matmul)(xs, ws))
    if x_spec[1] is None:
        np.testing.assert_array_equal(out, one)
    else:
        exact, bound = _reference(x, w)
        assert np.all(np.abs(out - exact) <= bound)


def test_build_caches_and_reports_errors(tmp_path, monkeypatch):
    """A build lands in the cache once (a second call compiles nothing) and readable by
    others; a source that does not compile (the message has the compiler's error), a
    compiler past its time limit, an unwritable cache, or no compiler, is a one-line
    KernelBuildError."""
    monkeypatch.setenv("JAXRLHF_KERNEL_CACHE", str(tmp_path / "cache"))
    library = build.build(bm.SOURCE)
    assert library.parent == tmp_path / "cache"
    stamp = os.stat(library).st_mtime_ns
    assert os.stat(library).st_mode & 0o777 == 0o755
    assert build.build(bm.SOURCE) == library and os.stat(library).st_mtime_ns == stamp
    assert [p.name for p in library.parent.iterdir()] == [library.name]  # no temporary left

    broken = tmp_path / "broken.cc"
    broken.write_text("int f( {\n")
    with pytest.raises(build.KernelBuildError, match="could not compile broken.cc") as e:
        build.build(broken)
    assert "\n" not in str(e.value) and "error" in str(e.value)  # the compiler's error line
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1e-3)  # a compiler that hangs
    monkeypatch.setenv("JAXRLHF_KERNEL_CACHE", str(tmp_path / "other"))
    with pytest.raises(build.KernelBuildError, match="timed out"):
        build.build(bm.SOURCE)
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    monkeypatch.setenv("JAXRLHF_KERNEL_CACHE", str(unwritable / "cache"))
    with pytest.raises(build.KernelBuildError, match="cannot write the kernel cache"):
        build.build(bm.SOURCE)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler"):
        build.build(bm.SOURCE)


def test_turned_off_by_the_environment(monkeypatch):
    """JAXRLHF_CPU_KERNELS=0 keeps XLA's matmul (what the benchmarks compare against)."""
    monkeypatch.setenv("JAXRLHF_CPU_KERNELS", "0")
    bm.unavailable_reason.cache_clear()
    try:
        assert not bm.available() and "JAXRLHF_CPU_KERNELS=0" in bm.unavailable_reason()
    finally:
        monkeypatch.delenv("JAXRLHF_CPU_KERNELS")
        bm.unavailable_reason.cache_clear()
    assert bm.available()
