"""How a model runs over rollout rows: per-token log-probs, values and sequence scores.

Rollout arrays share one layout, ``[N, T]`` with ``N`` rows and ``T = P + R`` (the
left-padded prompt, then the right-padded response). Per-token outputs are *aligned to the
token they score*: ``x[:, t]`` belongs to token ``t`` (its log-prob given tokens ``< t``, or
the value of the state that produced it), so a response token's entries sit at its own index
and ``response_mask`` selects them. Outputs are computed for the response columns only
(``t >= P``) and hold 0 in the prompt's.

A :class:`RolloutForward` fixes, when a program is built, everything about the forward that
is not data: the module (and so its sharding rules), the response budget ``R`` (so
``P = T - R``) and the *packing*: with ``group_size = n > 1`` every group of ``n``
consecutive rows (one prompt, ``n`` responses) runs as one packed row
``[prompt | response 1 | ... | response n]`` with a block attention mask, so the prompt runs
through the model once (:mod:`jaxrlhf.models.shared_prefix`); outputs come back in the
``[N, T]`` layout above. With ``packing`` set, rows are instead packed by their real
lengths, several sequences per row (:mod:`jaxrlhf.models.packing`), by a plan each call
passes with the rows; the outputs come back in the same layout. The callers (scoring, the
losses, the reward model) never see the packing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.losses.common import token_logprobs_and_entropy
from jaxrlhf.models import model as model_lib
from jaxrlhf.models import packing as packing_lib
from jaxrlhf.models import shared_prefix
from jaxrlhf.models.packing import PackedShape, RowPacking


def _pad_front(x: Float[Array, "N R"], start: int) -> Float[Array, "N T"]:
    return jnp.pad(x, ((0, 0), (start, 0)))


@dataclasses.dataclass(frozen=True)
class RolloutForward:
    """A model applied to rollout rows ``[N, P + R]`` (static: closed over by programs).

    Attributes:
      module: the Linen module (``models.model.build`` or a sharded build).
      max_new_tokens: R, the response slots at the end of every row.
      group_size: rows per packed prompt group (1: every row runs on its own); must divide
        the rows of every batch it is applied to. Not used while ``packing`` is set.
      packing: pack sequences by their real lengths into this shape (every call then
        passes the rows' :class:`~jaxrlhf.models.packing.RowPacking`); None: the rows run as
        they are, or in prompt groups. Programs hold the largest shape and pick one per
        call (:meth:`with_packed_rows`).
    """

    module: Any
    max_new_tokens: int
    group_size: int = 1
    packing: PackedShape | None = None

    def with_packed_rows(self, rows: int | None) -> RolloutForward:
        """This forward packing sequences into ``rows`` packed rows per shard, or (None) not
        packing sequences."""
        if rows is None:
            return dataclasses.replace(self, packing=None)
        if self.packing is None:
            raise ValueError("this RolloutForward does not pack sequences")
        return dataclasses.replace(self, packing=dataclasses.replace(self.packing, rows=rows))

    @property
    def cfg(self) -> Any:
        """The model's ModelConfig."""
        return self.module.cfg

    def prompt_len(self, tokens: Int[Array, "N T"]) -> int:
        """P, the index of the first response slot (at least 1)."""
        return max(1, tokens.shape[1] - self.max_new_tokens)

    def _packed(self, tokens: Int[Array, "N T"], mask: Bool[Array, "N T"]):
        sliding_window = self.module.cfg.sliding_window
        start = self.prompt_len(tokens)
        return shared_prefix.pack_groups(tokens, mask, start, self.group_size, sliding_window)

    def _sequences(
        self, tokens: Int[Array, "N T"], mask: Bool[Array, "N T"], plan: RowPacking | None
    ) -> packing_lib.PackedSequences:
        if plan is None:
            raise ValueError("a sequence-packed RolloutForward needs the rows' packing plan")
        return packing_lib.pack(
            tokens,
            mask,
            plan,
            self.packing,
            self.prompt_len(tokens),
            self.module.cfg.sliding_window,
            self.module.constrain,
        )

    def _response_outputs(
        self,
        params: Any,
        tokens: Int[Array, "N T"],
        mask: Bool[Array, "N T"],
        plan: RowPacking | None,
    ) -> tuple[Any, Int[Array, "..."], Callable[[Array], Float[Array, "N T"]]]:
        """``(outputs, targets, back)``: the module's outputs (logits, or a Hydra model's
        ``(logits, values)``) at the positions that predict response tokens, the tokens they
        predict, and ``back``, which places a per-position array of those positions at the
        indices ``t >= P`` of ``[N, T]`` (0 elsewhere). The head runs on the response only:
        packed sequences (their real tokens), packed prompt groups, or plain rows from
        position P - 1."""
        start = self.prompt_len(tokens)
        if self.packing is not None:
            packed = self._sequences(tokens, mask, plan)
            select = functools.partial(
                packing_lib.response_inputs, packed=packed, constrain=self.module.constrain
            )
            outputs = model_lib.forward_packed(self.module, params, packed, select)  # [S, K, .]
            return outputs, packed.head_targets, lambda x: packing_lib.unpack_responses(x, packed)
        if self.group_size > 1:
            groups = self._packed(tokens, mask)
            select = functools.partial(shared_prefix.response_inputs, mask=groups.mask)
            outputs = model_lib.forward_packed(self.module, params, groups, select)  # [N, R, .]
            return outputs, tokens[:, start:], lambda x: _pad_front(x, start)
        # Position t - 1 predicts token t, so the head runs on positions start - 1 .. T - 1,
        # each scored against the token after it (the last against a dummy, dropped by
        # ``back``); slicing the logits instead would copy the whole [N, T', V] array.
        outputs = model_lib.forward(self.module, params, tokens, mask, head_from=start - 1)
        targets = jnp.roll(tokens, -1, axis=1)[:, start - 1 :]
        return outputs, targets, lambda x: _pad_front(x[:, :-1], start)

    def logprobs(
        self,
        params: Any,
        tokens: Int[Array, "N T"],
        mask: Bool[Array, "N T"],
        plan: RowPacking | None = None,
    ) -> tuple[Float[Array, "N T"], Float[Array, "N T"]]:
        """``(logprobs, entropy)``: log pi(token_t | tokens_<t) and the entropy of that
        distribution at index ``t >= P`` (0 before), float32. The LM head and the
        log-softmax run on the R response positions only (packed: on the real response
        tokens only, 0 at the padding). ``plan``: the rows' packing (packed forwards)."""
        logits, targets, back = self._response_outputs(params, tokens, mask, plan)
        logp, entropy = token_logprobs_and_entropy(logits, targets)
        return back(logp), back(entropy)

    def logprobs_and_values(
        self,
        params: Any,
        tokens: Int[Array, "N T"],
        mask: Bool[Array, "N T"],
        plan: RowPacking | None = None,
    ) -> tuple[Float[Array, "N T"], Float[Array, "N T"]]:
        """``(logprobs, values)`` from one forward of a model with both heads (a Hydra model,
        ``models/hydra.py``): :meth:`logprobs`' log-probs and the values at the response's
        indices ``t >= P`` (0 before, as :meth:`values` gives them packed; sequence packing:
        the real response tokens only). ``plan``: the rows' packing (packed forwards)."""
        (logits, values), targets, back = self._response_outputs(params, tokens, mask, plan)
        logp, _ = token_logprobs_and_entropy(logits, targets)
        return back(logp), back(values)

    def values(
        self,
        params: Any,
        tokens: Int[Array, "N T"],
        mask: Bool[Array, "N T"],
        plan: RowPacking | None = None,
    ) -> Float[Array, "N T"]:
        """V(state before token t) at index t from a scalar-head model: every index from 1
        unpacked; the response's indices ``t >= P`` only when packed (0 before; sequence
        packing: the real response tokens only), all that GAE and the value loss read."""
        if self.packing is not None or self.group_size > 1:
            out, _, back = self._response_outputs(params, tokens, mask, plan)
            return back(out)
        values = model_lib.forward(self.module, params, tokens, mask)[:, :-1]
        return jnp.pad(values, ((0, 0), (1, 0)))

    def sequence_scores(
        self,
        params: Any,
        tokens: Int[Array, "N T"],
        mask: Bool[Array, "N T"],
        plan: RowPacking | None = None,
    ) -> Float[Array, " N"]:
        """A scalar-head model's score of each row: its value at the row's last real token
        (a reward model's readout)."""
        if self.packing is not None:
            packed = self._sequences(tokens, mask, plan)
            select = functools.partial(
                packing_lib.last_token_inputs, packed=packed, constrain=self.module.constrain
            )
            return model_lib.forward_packed(self.module, params, packed, select).reshape(-1)
        if self.group_size > 1:
            packed = self._packed(tokens, mask)
            select = functools.partial(shared_prefix.last_token_inputs, packed=packed)
            return model_lib.forward_packed(self.module, params, packed, select)[:, 0]
        return model_lib.last_token_values(
            model_lib.forward(self.module, params, tokens, mask), mask
        )
