"""Text in, text out: sample from a Hugging Face export (a run's ``hf/``) and its tokenizer.

Typical use::

    from jaxrlhf.generation.text import TextGenerator

    generator = TextGenerator("runs/quickstart/ppo/hf")
    generator.generate(["sort 31415:", "sort 2718:"], max_new_tokens=8)  # greedy

Prompts are encoded as the training data encodes them (:class:`jaxrlhf.data.Encoder`:
``[BOS] + text``, or the chat template with its generation prompt), cut into batches of
``batch_size`` rows, left-padded and sampled by :class:`~jaxrlhf.generation.Sampler`. The
padded width is rounded up to a multiple of ``PAD_MULTIPLE`` and the last batch is filled
with copies of its last prompt, so that calls with different prompts reuse a few compiled
programs instead of compiling one per shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Bool, Int

from jaxrlhf.data import Encoder, TokenizerConfig, load_tokenizer
from jaxrlhf.data.tokenizer import Messages
from jaxrlhf.generation.params import SamplingParams
from jaxrlhf.generation.sampler import Sampler
from jaxrlhf.models.hf_checkpoint import load_hf
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.models.safetensors_io import CheckpointError
from jaxrlhf.sharding import GENERATE
from jaxrlhf.sharding.distributed import to_host
from jaxrlhf.sharding.model_sharding import param_shardings

PAD_MULTIPLE = 16
GENERATION_CONFIG = "generation_config.json"


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, *, rows: int, multiple: int = PAD_MULTIPLE
) -> tuple[Int[np.ndarray, "R P"], Bool[np.ndarray, "R P"]]:
    """Token ids of ``prompts`` as ``[rows, P]`` arrays, each prompt ending at column P - 1.

    P is the longest prompt rounded up to ``multiple``; rows past ``len(prompts)`` repeat
    the last prompt (every row needs a real token).

    Returns:
      ``(tokens, mask)``: int32 ids (``pad_id`` in the padding) and bool, True at real
      tokens.
    """
    if not prompts or len(prompts) > rows or not all(prompts):
        raise ValueError(
            f"need 1 to {rows} non-empty prompts, got lengths {list(map(len, prompts))}"
        )
    width = -(-max(map(len, prompts)) // multiple) * multiple
    tokens = np.full((rows, width), pad_id, np.int32)
    mask = np.zeros((rows, width), bool)
    for row in range(rows):
        ids = prompts[min(row, len(prompts) - 1)]
        tokens[row, width - len(ids) :] = ids
        mask[row, width - len(ids) :] = True
    return tokens, mask


class TextGenerator:
    """A model loaded from a Hugging Face directory, with its tokenizer, that samples text.

    Args:
      directory: a ``*ForCausalLM`` checkpoint with its tokenizer files (a run's ``hf/``).
      tokenizer: how prompts become tokens; default ``TokenizerConfig(path=directory)``
        (the chat template when the tokenizer has one, ``[BOS] + text`` otherwise). Pass
        the run's ``tokenizer`` section, with ``path`` set, to encode exactly as it did.
      mesh: devices to shard the model over (generation rules); None: the default device.
      batch_size: prompts sampled together; more are run in consecutive batches.
      **config_overrides: ModelConfig fields, e.g. ``dtype="bfloat16"``.

    Raises:
      CheckpointError, DataError: the model or tokenizer cannot be loaded, or they do not
        fit together (one line).
    """

    def __init__(
        self,
        directory: str,
        *,
        tokenizer: TokenizerConfig | None = None,
        mesh: Mesh | None = None,
        batch_size: int = 16,
        **config_overrides: Any,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        tok_cfg = tokenizer or TokenizerConfig(path=directory)
        self.tokenizer = load_tokenizer(tok_cfg)
        self.encoder = Encoder(self.tokenizer, tok_cfg)
        shardings = None
        if mesh is not None:
            cfg = load_hf_config(directory, **config_overrides)
            shardings = param_shardings(cfg, mesh, GENERATE)
        self.cfg, self.params = load_hf(directory, shardings=shardings, **config_overrides)
        if self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise CheckpointError(
                f"{directory}: the tokenizer has {self.tokenizer.vocab_size} tokens, more than "
                f"the model's vocab_size {self.cfg.vocab_size}"
            )
        self.sampler = Sampler(self.cfg, mesh)
        self.stop_token_ids = _stop_ids(directory, self.tokenizer.eos_id)
        self.batch_size = batch_size

    def encode(self, prompt: str | Messages) -> list[int]:
        """The prompt's token ids, as the training data encodes a prompt."""
        if not self.encoder.templated and not isinstance(prompt, str):
            raise ValueError(
                f"prompt {prompt!r} holds chat messages but {self.encoder.no_template}"
            )
        return self.encoder.prompt(prompt)

    def generate(
        self,
        prompts: Sequence[str | Messages],
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[str]:
        """One completion per prompt, decoded without special tokens.

        Args:
          prompts: text, or chat messages (``[{"role": ..., "content": ...}]``) when the
            tokenizer has a chat template.
          max_new_tokens: at most this many tokens per completion; a completion also ends
            at the tokenizer's EOS or the ``eos_token_id`` of ``generation_config.json``.
          temperature, top_k, top_p: see :class:`SamplingParams`; temperature 0 is greedy.
          seed: the sampling seed (batch b uses ``fold_in(key(seed), b)``).

        Returns:
          The completions, in the order of ``prompts``.
        """
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_id,
            return_model_logprobs=False,
        )
        ids = [self.encode(p) for p in prompts]
        longest = max(map(len, ids), default=0)
        if longest + max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(
                f"the longest prompt ({longest} tokens) + max_new_tokens {max_new_tokens} is "
                f"over the model's max_position_embeddings {self.cfg.max_position_embeddings}"
            )
        key = jax.random.key(seed)
        completions: list[str] = []
        for b, start in enumerate(range(0, len(ids), self.batch_size)):
            chunk = ids[start : start + self.batch_size]
            tokens, mask = left_pad(chunk, self.tokenizer.pad_id, rows=self.batch_size)
            out = self.sampler.generate(
                self.params, tokens, mask, jax.random.fold_in(key, b), sampling
            )
            sampled, lengths = to_host((out.tokens, out.lengths))
            completions += [
                self.tokenizer.decode(sampled[i, : lengths[i]]) for i in range(len(chunk))
            ]
        return completions


def generate(directory: str, prompts: Sequence[str | Messages], **kwargs: Any) -> list[str]:
    """One-off :meth:`TextGenerator.generate` (loads the model on every call).

    ``kwargs`` go to ``generate`` (``max_new_tokens``, ``temperature``, ...); use a
    :class:`TextGenerator` to keep the model loaded and its programs compiled.
    """
    return TextGenerator(directory).generate(prompts, **kwargs)


def _stop_ids(directory: str, eos_id: int | None) -> tuple[int, ...]:
    """The tokenizer's EOS and ``generation_config.json``'s ``eos_token_id`` (an int or a
    list: chat models often end a turn with a token other than the tokenizer's EOS)."""
    ids = [] if eos_id is None else [eos_id]
    path = os.path.join(directory, GENERATION_CONFIG)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                extra = json.load(f).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{path} is not a valid JSON object ({e})") from None
        extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
        ids += [int(i) for i in extra]
    return tuple(dict.fromkeys(ids))
