"""Sequence packing: run rollout rows on their real tokens, several sequences per packed row.

Rollout rows are ``[N, T]``: a left-padded prompt of ``P`` slots, then a right-padded
response of ``R``, so each row's real tokens are one contiguous span
``[P - prompt_len, P + response_len)``. RL responses have long-tailed lengths (most stop
early, a few reach the budget), so most of the ``N x T`` slots a padded forward runs are
padding. Packing places the real tokens only into ``M`` packed rows of ``L = T`` slots::

    packed row:  [ prompt a | response a | prompt b | response b | response b' | pad ... ]

Each sequence keeps its own position ids (reset to 0 at its first token) and attends only
to earlier tokens of its own sequence (a block-diagonal causal mask; sliding windows in
positions, as in the padded rows). Rows whose prompts are identical (a prompt group's
samples) may share one copy of the prompt, as :mod:`jaxrlhf.models.shared_prefix` does for
a whole group: a *unit* is one prompt copy and the responses placed after it, and a
response attends to its unit's prompt and to itself. Every token therefore sees exactly the
keys, values and positions it sees in its padded row: same math, another summation order.

Two halves:

* The host plan (:func:`plan_rows`, numpy): which packed row and slots each rollout row's
  prompt and response take. Deterministic first-fit decreasing within each micro-batch's
  data shard, so every shard packs only its own rows and the packed batch is split over
  the devices like the rows were (no data moves between devices). The plan is a
  :class:`RowPacking`, three ints per row, which travels with the rows through shuffles
  and micro-batch splits.
* The device side (:func:`pack`, jittable): scatters a micro-batch's rows into the packed
  layout, builds the block mask, and maps outputs back (:func:`unpack_responses`). The
  model's head runs on the real response tokens only, gathered into ``K = min(b R, m L)``
  slots per shard (``b`` rows and ``m`` packed rows per shard): the LM head and the
  log-softmax over the vocabulary skip the response padding too.

Static shapes: ``L = T`` (every sequence fits in one row, and a packed row's attention
costs no more than a padded row's) and ``m``, the packed rows per shard, rounded up to one
of a few sizes (:func:`bucket_sizes`: geometric steps from ``b / buckets`` to ``b``), so a
program compiles at most ``buckets`` times whatever the lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import axes
from jaxrlhf.models.attention import LayerMasks, positions_from_mask

Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


@flax.struct.dataclass
class RowPacking:
    """Where each rollout row's real tokens sit in its micro-batch's packed rows.

    Slots are counted within the row's data shard: shard ``s`` of a micro-batch (its rows
    ``s*b .. s*b + b - 1``) packs into its own packed rows ``0 .. m - 1``. Leaves are ``[N]``
    (or ``[N, E]``, one plan per epoch of the update).

    Attributes:
      row: the packed row (within the shard's block).
      prompt_slot: the slot of the first real prompt token (shared by the rows of a unit).
      response_slot: the slot of the first response token (where it would be when empty).
    """

    row: Int[Array, " N"]
    prompt_slot: Int[Array, " N"]
    response_slot: Int[Array, " N"]


@dataclasses.dataclass(frozen=True)
class PackedShape:
    """The static shape of a packed micro-batch.

    Attributes:
      shards: S, the data shards its rows are split over (each packs its own rows).
      rows: m, packed rows per shard.
    """

    shards: int
    rows: int


# ---- the host plan --------------------------------------------------------------------------


def bucket_sizes(rows_per_shard: int, buckets: int) -> tuple[int, ...]:
    """The packed rows per shard a program is compiled for: ``buckets`` sizes in geometric
    steps from ``ceil(b / buckets)`` to ``b`` (``ceil(b * buckets ** (i / (buckets - 1) -
    1))`` for ``i = 0 .. buckets - 1``, deduplicated), ``b`` the rows each shard holds
    unpacked.

    The same range as equal steps of ``b / buckets`` but finer at the small end, where
    long-tailed RL lengths put most packed micro-batches (with 4 buckets and ``b = 32``:
    8, 13, 21, 32 rather than 8, 16, 24, 32), so a size is never more than
    ``buckets ** (1 / (buckets - 1))`` times what it holds (1.59x for 4)."""
    if buckets == 1:
        return (rows_per_shard,)
    sizes = {
        math.ceil(rows_per_shard * buckets ** (i / (buckets - 1) - 1) - 1e-9)
        for i in range(buckets)
    }
    return tuple(sorted(sizes | {rows_per_shard}))


def bucket_for(needed: int, rows_per_shard: int, buckets: int) -> int:
    """The smallest of :func:`bucket_sizes` that holds ``needed`` packed rows."""
    return next(m for m in bucket_sizes(rows_per_shard, buckets) if m >= needed)


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """What a plan packs.

    Attributes:
      needed: the most packed rows any shard of any micro-batch needs.
      tokens: the real tokens placed (a shared prompt once).
    """

    needed: int
    tokens: int


def _first_fit(
    rows: np.ndarray,
    lengths: tuple[np.ndarray, np.ndarray],
    prompts: Sequence[bytes] | None,
    length: int,
    out: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[int, int]:
    """First-fit decreasing of one shard's ``rows`` into packed rows of ``length`` slots,
    written into ``out`` (row, prompt slot, response slot); returns (packed rows, tokens).

    With ``prompts`` (one key per rollout row), a row whose prompt already sits in a packed
    row with room for its response joins that unit (its response only is placed)."""
    prompt_len, response_len = lengths
    used = np.zeros(len(rows), np.int64)  # slots taken in each packed row (at most one per row)
    opened, tokens = 0, 0
    units: dict[bytes, list[tuple[int, int]]] = {}
    total = prompt_len[rows] + response_len[rows]
    order = np.argsort(-total, kind="stable")  # longest first, ties in row order
    for q in order:
        r = rows[q]
        plen, rlen = int(prompt_len[r]), int(response_len[r])
        key = None if prompts is None else prompts[r]
        for packed_row, slot in units.get(key, []) if key is not None else []:
            if used[packed_row] + rlen <= length:
                out[0][r], out[1][r], out[2][r] = packed_row, slot, used[packed_row]
                used[packed_row] += rlen
                tokens += rlen
                break
        else:
            fits = np.flatnonzero(used[:opened] + plen + rlen <= length)
            packed_row = int(fits[0]) if len(fits) else opened
            opened = max(opened, packed_row + 1)
            slot = int(used[packed_row])
            out[0][r], out[1][r], out[2][r] = packed_row, slot, slot + plen
            used[packed_row] += plen + rlen
            tokens += plen + rlen
            if key is not None:
                units.setdefault(key, []).append((packed_row, slot))
    return opened, tokens


def plan_rows(
    tokens: np.ndarray,
    mask: np.ndarray,
    prompt_len: int,
    micro_rows: np.ndarray,
    shards: int,
    share_prompts: bool = True,
) -> tuple[RowPacking, PlanStats]:
    """The host plan of one layout of the rollout into micro-batches.

    Args:
      tokens: [N, T] rollout rows (host).
      mask: [N, T] True at real tokens: left-padded prompts, right-padded responses.
      prompt_len: P, the prompt slots.
      micro_rows: [n, B] the rollout rows of each micro-batch, in the order the program
        holds them (every row once); each splits into ``shards`` blocks of ``B / shards``.
      shards: S, the data shards each micro-batch is split over.
      share_prompts: rows of one shard with identical prompts may share a prompt copy.

    Returns:
      The :class:`RowPacking` (numpy ``[N]`` int32) and its :class:`PlanStats`.

    Raises:
      ValueError: a row's real tokens are not one left-padded prompt and one right-padded
        response.
    """
    n, length = mask.shape
    mask = np.asarray(mask, bool)
    prompt_lens = mask[:, :prompt_len].sum(1)
    response_lens = mask[:, prompt_len:].sum(1)
    col = np.arange(length)[None]
    contiguous = (col >= prompt_len - prompt_lens[:, None]) & (
        col < prompt_len + response_lens[:, None]
    )
    bad = np.flatnonzero((mask != contiguous).any(1))
    if len(bad):
        raise ValueError(
            f"rollout row {bad[0]}: real tokens must be a left-padded prompt of {prompt_len} "
            "slots and a right-padded response to pack sequences"
        )
    prompts = None
    if share_prompts:
        prompts = [
            tokens[r, prompt_len - prompt_lens[r] : prompt_len].astype(np.int64).tobytes()
            for r in range(n)
        ]
    out = tuple(np.zeros(n, np.int32) for _ in range(3))
    needed = tokens_placed = 0
    for micro in np.asarray(micro_rows):
        b = len(micro) // shards
        for s in range(shards):
            opened, placed = _first_fit(
                micro[s * b : (s + 1) * b], (prompt_lens, response_lens), prompts, length, out
            )
            needed, tokens_placed = max(needed, opened), tokens_placed + placed
    return RowPacking(*out), PlanStats(needed=needed, tokens=tokens_placed)


# ---- the device side ------------------------------------------------------------------------


@flax.struct.dataclass
class PackedSequences:
    """A micro-batch of rollout rows packed by a :class:`RowPacking` (see :func:`pack`).

    Packed arrays are ``[S*m, L]`` (shard ``s``'s packed rows first ``s*m .. s*m + m - 1``);
    index arrays are per shard, ``[S, ...]``, into its flattened ``[m*L]`` slots.

    Attributes:
      tokens: [S*m, L] token ids (0 in padding slots).
      positions: [S*m, L] each token's position in its own sequence.
      token_mask: [S*m, L] True at real tokens.
      mask: [S*m, L, L] True where query slot may attend key slot (full-attention layers).
      sliding: the same windowed to the model's ``sliding_window`` positions, or None.
      dest: [S, b, T] the packed slot of each rollout token (``m*L`` at padding).
      head_slots: [S, K] the slot of the hidden state predicting each real response token,
        compacted in row-major rollout order (padding entries 0).
      head_targets: [S, K] those response tokens.
      head_index: [S, b, T] each real response token's entry in ``head_slots`` (K elsewhere).
      last_slots: [S, b] the slot of each row's last real token.
    """

    tokens: Int[Array, "M L"]
    positions: Int[Array, "M L"]
    token_mask: Bool[Array, "M L"]
    mask: Bool[Array, "M L L"]
    dest: Int[Array, "S b T"]
    head_slots: Int[Array, "S K"]
    head_targets: Int[Array, "S K"]
    head_index: Int[Array, "S b T"]
    last_slots: Int[Array, "S b"]
    sliding: Bool[Array, "M L L"] | None = None

    def layer_masks(self) -> Bool[Array, "M L L"] | LayerMasks:
        """The model's mask argument: both masks with a window (each layer picks its own,
        ``ModelConfig.layer_types``), else the full one."""
        if self.sliding is None:
            return self.mask
        return LayerMasks(full=self.mask, sliding=self.sliding)


def _no_constraint(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    del names
    return x


def _pack_shard(tokens, mask, plan: RowPacking, *, rows: int, prompt_len: int, head: int):
    """:func:`pack`'s index work for one shard: ``[b, T]`` rows -> ``[m*L, 4]`` packed
    (token, position, unit, member) and the index arrays."""
    b, t = tokens.shape
    p, slots = prompt_len, rows * t
    col = jnp.arange(t)[None, :]
    in_prompt = col < p
    plen = mask[:, :p].sum(1, keepdims=True)
    column = jnp.where(
        in_prompt,
        plan.prompt_slot[:, None] + col - (p - plen),
        plan.response_slot[:, None] + col - p,
    )
    dest = jnp.where(mask, plan.row[:, None] * t + column, slots)  # [b, T]
    # unit: the prompt copy's slot + 1 (0: padding); member: 0 in a prompt, else the row's
    # index + 1. Rows sharing a prompt write the same values to its slots.
    values = jnp.stack(
        [
            tokens,
            positions_from_mask(mask),
            jnp.broadcast_to(plan.row[:, None] * t + plan.prompt_slot[:, None] + 1, (b, t)),
            jnp.where(in_prompt, 0, jnp.arange(1, b + 1)[:, None]),
        ],
        axis=-1,
    ).astype(jnp.int32)
    packed = (
        jnp.zeros((slots, 4), jnp.int32)
        .at[dest.reshape(-1)]
        .set(values.reshape(b * t, 4), mode="drop")
    )
    response = (mask & ~in_prompt).reshape(-1)
    index = jnp.where(response, jnp.cumsum(response) - 1, head)  # [b*T], head = dropped
    before = jnp.concatenate([jnp.full((b, 1), slots), dest[:, :-1]], axis=1)  # token t - 1
    head_slots = jnp.zeros(head, jnp.int32).at[index].set(before.reshape(-1), mode="drop")
    head_targets = jnp.zeros(head, jnp.int32).at[index].set(tokens.reshape(-1), mode="drop")
    last = t - 1 - jnp.argmax(jnp.flip(mask, axis=-1), axis=-1)
    last_slots = jnp.take_along_axis(dest, last[:, None], axis=1)[:, 0]
    return packed, dest, head_slots, head_targets, index.reshape(b, t), last_slots


def _block_mask(unit, member, positions, window: int | None = None) -> Bool[Array, "M L L"]:
    """Query slot i may attend key slot j: same unit, j <= i, j real, and j in the prompt
    or in i's own response (and within ``window`` positions)."""
    length = unit.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    same = unit[:, :, None] == unit[:, None, :]
    visible = (member[:, None, :] == 0) | (member[:, None, :] == member[:, :, None])
    allowed = causal & same & visible & (unit[:, None, :] > 0)
    if window is not None:
        allowed &= positions[:, :, None] - positions[:, None, :] < window
    return allowed


def pack(
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    plan: RowPacking,
    shape: PackedShape,
    prompt_len: int,
    sliding_window: int | None = None,
    constrain: Constrain = _no_constraint,
) -> PackedSequences:
    """Packs a micro-batch of rollout rows by its ``plan`` (module docstring).

    Args:
      tokens: [N, T] rows ``[prompt | response]``, split over ``shape.shards`` data shards.
      mask: [N, T] True at real tokens.
      plan: each row's place (``[N]`` leaves), from :func:`plan_rows`.
      shape: S and m; the packed rows are ``L = T`` slots long.
      prompt_len: P, the prompt slots.
      sliding_window: the model's attention window in positions, if any: the result then
        carries a windowed mask too, for the model's sliding layers.
      constrain: the model's activation constraint (keeps the ``[S, ...]`` arrays split
        over the data shards).

    Returns:
      The packed micro-batch; read its outputs with :func:`response_inputs` /
      :func:`unpack_responses` or :func:`last_token_inputs`.
    """
    n, t = tokens.shape
    s, m = shape.shards, shape.rows
    if n % s:
        raise ValueError(f"{n} rollout rows do not split over {s} data shards")
    b = n // s
    head = min(b * (t - prompt_len), m * t)

    def sharded(x):  # the leading dim over the data shards
        return constrain(x, (axes.BATCH,) + (None,) * (x.ndim - 1))

    def per_shard(x):  # [N, ...] -> [S, b, ...]
        return sharded(x.reshape(s, b, *x.shape[1:]))

    outs = jax.vmap(lambda *a: _pack_shard(*a, rows=m, prompt_len=prompt_len, head=head))(
        per_shard(tokens), per_shard(mask.astype(bool)), jax.tree.map(per_shard, plan)
    )
    packed, dest, head_slots, head_targets, head_index, last_slots = map(sharded, outs)
    tok, pos, unit, member = (sharded(packed[..., i].reshape(s * m, t)) for i in range(4))
    full = _block_mask(unit, member, pos)
    sliding = None if sliding_window is None else _block_mask(unit, member, pos, sliding_window)
    return PackedSequences(
        tokens=tok,
        positions=pos,
        token_mask=unit > 0,
        mask=full,
        dest=dest,
        head_slots=head_slots,
        head_targets=head_targets,
        head_index=head_index,
        last_slots=last_slots,
        sliding=sliding,
    )


def _gather_slots(
    hidden: Float[Array, "M L D"], slots: Int[Array, "S K"], constrain: Constrain
) -> Float[Array, "S K D"]:
    """Per shard, the hidden states at ``slots`` of its packed rows (a gather local to each
    data shard: its operand, indices and result are all split on the leading dim)."""
    s = slots.shape[0]
    names = (axes.BATCH, None, axes.ACT_EMBED)
    flat = constrain(hidden.reshape(s, -1, hidden.shape[-1]), names)  # [S, m*L, D]
    picked = jax.vmap(lambda h, i: jnp.take(h, i, axis=0, mode="clip"))(flat, slots)
    return constrain(picked, names)


def response_inputs(
    hidden: Float[Array, "M L D"], packed: PackedSequences, constrain: Constrain = _no_constraint
) -> Float[Array, "S K D"]:
    """The hidden states that predict each real response token (compacted per shard): the
    LM head runs on these ``K`` per shard instead of ``b x R`` padded response slots.
    ``constrain``: the model's activation constraint."""
    return _gather_slots(hidden, packed.head_slots, constrain)


def last_token_inputs(
    hidden: Float[Array, "M L D"], packed: PackedSequences, constrain: Constrain = _no_constraint
) -> Float[Array, "S b D"]:
    """The hidden state at each row's last real token (a reward model's readout): its
    response's last token, or its prompt's for an empty response."""
    return _gather_slots(hidden, packed.last_slots, constrain)


def unpack_responses(x: Float[Array, "S K"], packed: PackedSequences) -> Float[Array, "N T"]:
    """Compacted per-token results back to the rollout layout: ``out[r, t]`` is the entry of
    response token ``t`` of row ``r`` (aligned to the token it scores), 0 elsewhere."""
    s, b, t = packed.head_index.shape
    head = x.shape[1]
    index = packed.head_index.reshape(s, b * t)
    picked = jnp.take_along_axis(x, jnp.minimum(index, head - 1), axis=1)
    return jnp.where(index < head, picked, 0.0).reshape(s * b, t)
