"""Getting a run's model ready: special token ids from the tokenizer, and the initial
parameters (random, or a Hugging Face checkpoint) straight into their shardings."""

from __future__ import annotations

from typing import Any

import jax

from jaxrlhf.config import ConfigError, RunConfig
from jaxrlhf.data.tokenizer import Tokenizer
from jaxrlhf.models import ilql
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import load_params


def model_with_tokenizer_ids(cfg: RunConfig, model: ModelConfig, tok: Tokenizer) -> ModelConfig:
    """``model`` checked against the tokenizer; a fresh model (no ``model.hf_dir``) takes
    its BOS/EOS/pad ids from the tokenizer where its config sets none.

    Raises:
      ConfigError: the tokenizer has more ids than the model's vocabulary.
    """
    if tok.vocab_size > model.vocab_size:
        raise ConfigError(
            f"tokenizer.path: the tokenizer has {tok.vocab_size} ids but the model's "
            f"vocab_size is {model.vocab_size}"
        )
    if cfg.model.hf_dir is not None:
        return model

    def pick(own: int | None, from_tokenizer: int | None) -> int | None:
        return own if own is not None else from_tokenizer

    return model.replace(
        bos_token_id=pick(model.bos_token_id, tok.bos_id),
        eos_token_id=pick(model.eos_token_id, tok.eos_id),
        pad_token_id=pick(model.pad_token_id, tok.pad_id),
    )


def init_params(
    cfg: RunConfig, model: ModelConfig, head: str, shardings: Any, key: jax.Array
) -> Any:
    """The run's initial parameters in ``shardings``: random from ``key`` for a preset, else
    ``model.hf_dir``'s weights (a causal LM checkpoint may start a reward model: its scalar
    head is then zeros; or ILQL's model: its value and Q heads are then random from ``key``).
    ILQL's target Q heads start equal to its Q heads."""
    if head == "ilql":
        return _ilql_params(cfg, model, shardings, key)
    if cfg.model.hf_dir is None:
        return model_lib.init_params(model, key, head=head, shardings=shardings)
    return load_params(
        cfg.model.hf_dir, model, head=head, shardings=shardings, init_missing_head=head == "scalar"
    )


def _ilql_params(cfg: RunConfig, model: ModelConfig, shardings: Any, key: jax.Array) -> Any:
    if cfg.model.hf_dir is None:
        return ilql.copy_q_to_target(model_lib.init_params(model, key, "ilql", shardings))
    names = ilql.head_param_names()

    def heads(k: jax.Array) -> Any:  # the LM's random init is dead code XLA drops
        params = ilql.copy_q_to_target(model_lib.init_params(model, k, head="ilql"))
        return {name: params[name] for name in names}

    lm = load_params(cfg.model.hf_dir, model, head="lm", shardings=ilql.lm_params(shardings))
    head_shardings = {name: shardings[name] for name in names}
    return {**lm, **jax.jit(heads, out_shardings=head_shardings)(key)}
