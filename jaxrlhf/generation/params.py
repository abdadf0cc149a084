"""SamplingParams: what to sample, validated once, split into static and traced parts.

The sampler compiles one program per *static* choice (greedy or not, whether a sort is
needed for top-k/top-p, output length, samples per prompt) and feeds everything else
(temperature, the k of top-k, the p of top-p, stop ids, pad id) in as arrays, so changing
those values between calls never recompiles (anchor: gemma ``gm`` "converted to array to
avoid re-compilation").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample continuations.

    Attributes:
      temperature: softmax temperature, >= 0. 0 means greedy (argmax); the sampling
        distribution is then a point mass and ``SampleOutput.logprobs`` are 0.
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus sampling: keep the smallest set of most likely tokens whose
        probability reaches ``top_p`` (1.0 = off). Applied after top-k, as in transformers.
      max_new_tokens: tokens generated per row (the output width T_new), >= 1.
      stop_token_ids: a row ends at the first of these tokens; it is part of the response.
      n: samples per prompt (GRPO/RLOO groups); output rows are prompt-major
        (prompt 0's n samples, then prompt 1's, ...).
      pad_token_id: written into ``tokens`` after a row has ended.
      return_model_logprobs: also return the log-prob of each token under the unmodified
        model distribution (temperature 1, no truncation): the one PPO's ratio needs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    pad_token_id: int = 0
    return_model_logprobs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={self.top_p} is not in (0, 1] (1 = off)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1"
            )
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r} must be an int >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids={self.stop_token_ids} must be token ids >= 0"
            )
        if not _is_int(self.pad_token_id) or self.pad_token_id < 0:
            raise ValueError(f"SamplingParams.pad_token_id={self.pad_token_id!r} must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raises if a token id or k does not fit a vocabulary of ``vocab_size``."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("pad_token_id", (self.pad_token_id,)),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} {bad} not in [0, {vocab_size})")
        if self.top_k > vocab_size:
            raise ValueError(f"SamplingParams.top_k={self.top_k} is not in [0, {vocab_size}]")

    def static(self) -> SamplingStatics:
        """The part of these params that selects a compiled program."""
        return SamplingStatics(
            greedy=self.greedy,
            use_top_k=not self.greedy and self.top_k > 0,
            use_top_p=not self.greedy and self.top_p < 1.0,
            max_new_tokens=self.max_new_tokens,
            n=self.n,
            return_model_logprobs=self.return_model_logprobs,
        )

    def arrays(self) -> dict[str, Any]:
        """The traced part: changing these values does not recompile.

        ``stop_ids`` has at least one entry (-1, which matches no token, when none are
        given); its length is part of the compiled shape.
        """
        stop = self.stop_token_ids or (-1,)
        return {
            # A greedy program ignores temperature; 1.0 keeps the array finite to divide by.
            "temperature": jnp.asarray(self.temperature or 1.0, jnp.float32),
            "top_k": jnp.asarray(self.top_k, jnp.int32),
            "top_p": jnp.asarray(self.top_p, jnp.float32),
            "stop_ids": jnp.asarray(stop, jnp.int32),
            "pad_id": jnp.asarray(self.pad_token_id, jnp.int32),
        }


@dataclasses.dataclass(frozen=True)
class SamplingStatics:
    """Compile-time sampling choices (hashable; a static argument of the jitted steps)."""

    greedy: bool
    use_top_k: bool
    use_top_p: bool
    max_new_tokens: int
    n: int
    return_model_logprobs: bool


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)
