"""Masked reductions, loss aggregation, and log-probabilities / entropy from logits.

Conventions shared by every module in ``jaxrlhf.losses``:

* Shapes use one-letter names: ``B`` batch rows (sequences), ``T`` time (token positions),
  ``V`` vocabulary. Functions that reduce over "tokens" treat the last axis as ``T`` and every
  leading axis as a sequence axis, so a ``[G, B, T]`` input works where ``[B, T]`` is documented.
* Masks are named ``*_mask`` or ``mask``; True (or non-zero, any dtype is cast with
  ``.astype(bool)``) marks a real token that is counted. Values at masked positions never reach a
  result or a gradient: they are replaced with ``jnp.where`` before any arithmetic that could
  overflow, so padding may hold arbitrary finite numbers.
* Arithmetic runs in float32 (float64 inputs stay float64): logits and log-probabilities in bf16
  are upcast before ``logsumexp`` and before any sum.
* Denominators are ``max(count, 1)``, so an empty row (mask all False) contributes 0 and never
  produces NaN, in the value or in the gradient.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")

Scalar = Float[Array, ""]
Metrics = dict[str, Scalar]


def as_float(x: ArrayLike) -> Array:
    """Casts to at least float32 (bf16/f16/int -> f32; f64 stays f64)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def as_mask(mask: ArrayLike, shape: tuple[int, ...] | None = None) -> Bool[Array, "..."]:
    """Casts any-dtype mask to bool and optionally broadcasts it to ``shape``."""
    mask = jnp.asarray(mask).astype(bool)
    return mask if shape is None else jnp.broadcast_to(mask, shape)


def safe_sqrt(x: Array) -> Array:
    """``sqrt(x)`` for ``x >= 0`` whose gradient at 0 is 0 instead of inf (double ``where``)."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def masked_sum(
    x: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    axis: int | tuple[int, ...] | None = None,
) -> Float[Array, "*reduced"]:
    """Sum of ``x`` over positions where ``mask`` is True.

    ``sum_i m_i x_i`` in float32. ``mask`` broadcasts against ``x``.

    Args:
        x: values.
        mask: True = counted.
        axis: axes to reduce (all when None).

    Returns:
        The masked sum, reduced over ``axis``; 0 where nothing is counted.
    """
    x = as_float(x)
    mask = as_mask(mask, x.shape)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


def masked_mean(
    x: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    axis: int | tuple[int, ...] | None = None,
) -> Float[Array, "*reduced"]:
    """Mean of ``x`` over positions where ``mask`` is True.

    ``sum_i m_i x_i / max(sum_i m_i, 1)``: an empty selection gives 0, not NaN.

    Args:
        x: values.
        mask: True = counted; broadcasts against ``x``.
        axis: axes to reduce (all when None).

    Returns:
        The masked mean, reduced over ``axis``.
    """
    x = as_float(x)
    mask = as_mask(mask, x.shape)
    count = jnp.sum(mask, axis=axis, dtype=x.dtype)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis) / jnp.maximum(count, 1.0)


def masked_var(
    x: Float[Array, "*shape"], mask: Bool[Array, "*shape"], *, unbiased: bool = False
) -> Scalar:
    """Variance of ``x`` over all positions where ``mask`` is True.

    ``mu = masked_mean(x)``; ``var = sum_i m_i (x_i - mu)^2 / max(n - ddof, 1)`` with ``n`` the
    number of counted positions and ``ddof = 1`` when ``unbiased`` else 0 (trlX's ``whiten`` uses
    the biased form, which is the default here).

    Args:
        x: values.
        mask: True = counted.
        unbiased: apply Bessel's correction.

    Returns:
        Scalar variance; 0 when fewer than ``1 + ddof`` positions are counted.
    """
    x = as_float(x)
    mask = as_mask(mask, x.shape)
    n = jnp.sum(mask, dtype=x.dtype)
    mean = masked_mean(x, mask)
    sq = jnp.sum(jnp.where(mask, (x - mean) ** 2, 0.0))
    ddof = 1.0 if unbiased else 0.0
    return sq / jnp.maximum(n - ddof, 1.0)


def masked_whiten(
    x: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    *,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
) -> Float[Array, "*shape"]:
    """Normalises ``x`` with the mean and variance of its counted positions (the whole array).

    ``w_i = (x_i - mu) / sqrt(var + eps)``, plus ``mu`` again when ``shift_mean`` is False (so
    only the scale changes, as TRL does for reward whitening). ``mu`` and ``var`` come from
    ``masked_mean`` / ``masked_var`` over every position where ``mask`` is True, i.e. one
    global statistic for the batch, not one per row. Masked positions of the result are 0.

    ``var`` is biased (divides by ``n``, as trlX and OpenRLHF) unless ``unbiased`` (divides by
    ``n - 1``, as TRL's and verl's ``masked_whiten``). The default stays biased so existing runs
    are unchanged; the two differ by a factor ``sqrt(n / (n - 1))`` on the result, which is
    about 0.05% at 1000 valid tokens and matters only for tiny batches. With
    ``unbiased`` and a single counted position, ``var`` is 0 (not NaN; see ``masked_var``).

    Args:
        x: values.
        mask: True = counted, and the positions that get a non-zero output.
        shift_mean: subtract the mean (True) or keep it (False).
        unbiased: Bessel's correction in the variance.
        eps: added to the variance.

    Returns:
        Whitened array, same shape as ``x``.
    """
    x = as_float(x)
    mask = as_mask(mask, x.shape)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    white = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return jnp.where(mask, white, 0.0)


def aggregate_loss(
    loss: Float[Array, "*B T"],
    mask: Bool[Array, "*B T"],
    *,
    aggregation: str = "token_mean",
    norm_constant: float | Array | None = None,
) -> Scalar:
    """Reduces a per-token loss to a scalar; the choice GRPO variants differ on.

    With ``l`` the per-token loss, ``m`` the mask, rows ``b`` (every leading axis) and tokens ``t``
    (last axis), ``n_b = sum_t m_bt`` and ``R = #{b : n_b > 0}`` (rows with at least one token):

    * ``"token_mean"``: ``sum_bt m l / max(sum_b n_b, 1)``. Every token in the batch weighs the
      same (DAPO; verl ``token-mean``).
    * ``"seq_mean_token_mean"``: ``sum_{b: n_b>0} (sum_t m l / n_b) / max(R, 1)``. Mean per
      sequence, then mean over non-empty sequences (original GRPO).
    * ``"seq_mean_token_sum"``: ``sum_{b: n_b>0} sum_t m l / max(R, 1)``. Sum per sequence, mean
      over non-empty sequences.
    * ``"token_sum_norm"``: ``sum_bt m l / norm_constant``. A constant denominator, so no length
      bias (Dr.GRPO: ``norm_constant = B * max_response_len``, i.e. each sequence summed and
      divided by the generation budget, then averaged over the batch).

    Empty rows are left out of the sequence-level means (they neither add 0 nor count in ``R``).

    Args:
        loss: per-token loss.
        mask: True = the token counts.
        aggregation: one of ``AGGREGATIONS``.
        norm_constant: denominator for ``"token_sum_norm"`` (required there, ignored otherwise).

    Returns:
        Scalar loss.

    Raises:
        ValueError: unknown ``aggregation`` or ``"token_sum_norm"`` without ``norm_constant``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")
    loss = as_float(loss)
    mask = as_mask(mask, loss.shape)
    masked = jnp.where(mask, loss, 0.0)
    if aggregation == "token_mean":
        return jnp.sum(masked) / jnp.maximum(jnp.sum(mask, dtype=loss.dtype), 1.0)
    if aggregation == "token_sum_norm":
        if norm_constant is None:
            raise ValueError("aggregation='token_sum_norm' needs norm_constant")
        return jnp.sum(masked) / norm_constant
    row_sum = jnp.sum(masked, axis=-1)
    row_count = jnp.sum(mask, axis=-1, dtype=loss.dtype)
    rows = jnp.maximum(jnp.sum(row_count > 0, dtype=loss.dtype), 1.0)
    if aggregation == "seq_mean_token_mean":
        # Empty rows: row_sum is 0, so they add 0 to the numerator; they are not in `rows`.
        return jnp.sum(row_sum / jnp.maximum(row_count, 1.0)) / rows
    return jnp.sum(row_sum) / rows  # seq_mean_token_sum


def sequence_logprobs(
    logprobs: Float[Array, "*B T"], mask: Bool[Array, "*B T"], *, average: bool = False
) -> Float[Array, "*B"]:
    """Per-sequence log-probability: ``sum_t m_t logp_t``, or divided by ``max(n, 1)``.

    ``average=True`` gives the length-normalised value SimPO and ORPO use; an empty row gives 0.

    Args:
        logprobs: per-token log-probabilities of the targets.
        mask: True = the token belongs to the sequence being scored (e.g. the response).
        average: divide by the number of counted tokens.

    Returns:
        One value per row.
    """
    if average:
        return masked_mean(logprobs, mask, axis=-1)
    return masked_sum(logprobs, mask, axis=-1)


def _token_logprobs(logits: Array, targets: Array) -> Array:
    logits = as_float(logits)
    # Gather first, then subtract logsumexp: only the [.., T] result and the logsumexp
    # reduction are materialised, never a second [.., T, V] log-softmax array.
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1, mode="clip")[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def token_logprobs(
    logits: Float[Array, "*B T V"],
    targets: Int[Array, "*B T"],
    *,
    chunk_size: int | None = None,
) -> Float[Array, "*B T"]:
    """Log-probability of each target token: ``logits[t, y_t] - logsumexp_v logits[t, v]``.

    Computed in float32 as gather minus ``logsumexp``, not as a full ``log_softmax`` followed by
    a gather. Targets outside ``[0, V)`` (e.g. an ignore index of -100) are clipped into range and
    give a finite but meaningless value: mask those positions downstream.

    Args:
        logits: unnormalised scores; position ``t`` must already predict ``targets[t]`` (shift
            before calling).
        targets: token ids.
        chunk_size: if set, process ``T`` in chunks of this size with ``lax.map``, bounding the
            float32 temporaries to ``[.., chunk_size, V]``. ``T`` must divide evenly.

    Returns:
        Float32 log-probabilities, same shape as ``targets``.

    Raises:
        ValueError: ``chunk_size`` does not divide ``T``.
    """
    t = logits.shape[-2]
    if chunk_size is None or chunk_size >= t:
        return _token_logprobs(logits, targets)
    if t % chunk_size:
        raise ValueError(f"chunk_size={chunk_size} must divide T={t}")
    axis = logits.ndim - 2

    def one_chunk(i):
        start = i * chunk_size
        lg = jax.lax.dynamic_slice_in_dim(logits, start, chunk_size, axis=axis)
        tg = jax.lax.dynamic_slice_in_dim(targets, start, chunk_size, axis=axis)
        return _token_logprobs(lg, tg)

    chunks = jax.lax.map(one_chunk, jnp.arange(t // chunk_size))  # [C, *B, chunk]
    return jnp.moveaxis(chunks, 0, -2).reshape(targets.shape)


def token_logprobs_and_entropy(
    logits: Float[Array, "*B T V"], targets: Int[Array, "*B T"]
) -> tuple[Float[Array, "*B T"], Float[Array, "*B T"]]:
    """``(token_logprobs(logits, targets), entropy_from_logits(logits))`` from one logsumexp.

    The same values (to float rounding) as the two functions, in fewer passes over the
    ``[.., T, V]`` logits: the policy loss needs both, and on CPU the passes over the logits
    cost as much as the LM head's backward matmuls.

    Args:
        logits: unnormalised scores; position ``t`` must already predict ``targets[t]``.
        targets: token ids (clipped into ``[0, V)``, see :func:`token_logprobs`).

    Returns:
        Float32 ``(log-probabilities of targets, entropy in nats)``, each shaped like ``targets``.
    """
    logits = as_float(logits)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1, mode="clip")
    return (picked - lse)[..., 0], _entropy(logits, lse)


def entropy_from_logits(logits: Float[Array, "*B T V"]) -> Float[Array, "*B T"]:
    """Entropy of ``softmax(logits)`` per position: ``H = -sum_v p_v log p_v``.

    Uses ``log p = z - logsumexp(z)`` in float32. Logits of ``-inf`` (masked vocabulary entries)
    contribute 0 to the value and to the gradient.

    Args:
        logits: unnormalised scores.

    Returns:
        Entropy in nats, one value per position.
    """
    logits = as_float(logits)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return _entropy(logits, lse)


def _entropy(logits: Float[Array, "*B V"], lse: Float[Array, "*B 1"]) -> Float[Array, "*B"]:
    """``-sum_v p_v log p_v`` from float32 logits and their logsumexp.

    ``log p`` is floored at the smallest float32, which changes no finite logit's value and
    makes a ``-inf`` logit's term ``0 * floor = 0`` (not ``0 * -inf``, NaN) with no gradient;
    a position whose logits are all ``-inf`` gets 0.
    The sum over ``V`` is a contraction: XLA:CPU (jax 0.10) runs a fused multiply-then-reduce
    over ``[1, T, V]`` logits about 70x slower than the same contraction as a dot, and a
    select on ``isfinite`` costs several more passes (benchmarks/cpu_reductions.py,
    benchmarks/RESULTS.md); other backends simplify either form alike. HIGHEST keeps float32
    products where a backend's default would round them (TPU)."""
    logp = jnp.maximum(logits - lse, jnp.finfo(jnp.float32).min)
    p = jnp.exp(logp)
    entropy = -jnp.einsum("...v,...v->...", p, logp, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.isfinite(lse[..., 0]), entropy, 0.0)  # a row of -inf logits: 0
