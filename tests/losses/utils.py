"""Shared helpers for the loss tests: random inputs with awkward masks, and transform checks."""

import jax
import jax.numpy as jnp
import numpy as np

RTOL = 1e-5
ATOL = 1e-5


def ref_aggregate(loss, m, mode, norm=None):
    """Loop reference for ``aggregate_loss`` (shared: every loss test aggregates with it)."""
    rows = []
    total, count = 0.0, 0
    for b in range(loss.shape[0]):
        vals = [loss[b, t] for t in range(loss.shape[1]) if m[b, t]]
        total += sum(vals)
        count += len(vals)
        if vals:
            rows.append((sum(vals), len(vals)))
    if mode == "token_mean":
        return total / max(count, 1)
    if mode == "token_sum_norm":
        return total / norm
    if not rows:
        return 0.0
    if mode == "seq_mean_token_mean":
        return np.mean([s / n for s, n in rows])
    return np.mean([s for s, _ in rows])  # seq_mean_token_sum


def make_mask(rng: np.random.Generator, b: int, t: int, *, holes: bool = False) -> np.ndarray:
    """[b, t] bool mask: row 0 empty, row 1 full, other rows a random span (left/right padding).

    With ``holes`` the other rows are i.i.d. Bernoulli(0.6) instead of a contiguous span.
    """
    mask = np.zeros((b, t), bool)
    mask[1] = True
    for i in range(2, b):
        if holes:
            mask[i] = rng.random(t) < 0.6
        else:
            start = rng.integers(0, t)
            end = rng.integers(start + 1, t + 1)
            mask[i, start:end] = True
    return mask


def garbage_like(rng: np.random.Generator, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``x`` with large random values at masked-out positions (they must not leak)."""
    return np.where(mask, x, rng.normal(0.0, 50.0, x.shape)).astype(x.dtype)


def assert_close(actual, expected, rtol: float = RTOL, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


def assert_trees_close(a, b, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def check_transforms(fn, args: tuple, other_args: tuple | None = None, grad_argnums=(0,)) -> None:
    """jit == eager; vmap over a stacked pair of inputs == per-input calls; finite gradients.

    vmap and grad run under jit: op-by-op dispatch compiles every primitive separately (~50 ms
    each on CPU), and the eager path is already covered by the first comparison.

    ``fn`` takes only array arguments (bind hyperparameters with a lambda/partial) and returns an
    array, or a tuple whose first element is the array to differentiate.
    """
    eager = fn(*args)
    assert_trees_close(jax.jit(fn)(*args), eager)
    if other_args is not None:
        stacked = jax.tree_util.tree_map(lambda x, y: np.stack([x, y]), args, other_args)
        batched = jax.jit(jax.vmap(fn))(*stacked)
        assert_trees_close(jax.tree_util.tree_map(lambda x: x[0], batched), eager)
        assert_trees_close(jax.tree_util.tree_map(lambda x: x[1], batched), fn(*other_args))

    grads = jax.jit(jax.grad(lambda *a: jnp.sum(_first(fn(*a))), argnums=grad_argnums))(*args)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(g))), "non-finite gradient"
    for leaf in jax.tree_util.tree_leaves(eager):
        assert np.all(np.isfinite(np.asarray(leaf))), "non-finite output"
