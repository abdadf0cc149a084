"""LoRA in the trainers (``lora:`` in the config; the model side is ``models/lora.py``).

A LoRA learner's parameters come in two parts with their own shardings
(:class:`LoraLayout`): the frozen base, passed to every program as an argument of its own
(never donated, never checkpointed: it is rebuilt from the model source on resume), and the
trainable part (the adapters, and a scalar model's ``score`` head), which is the TrainState's
``params``, has the optimizer state and is checkpointed. The reference of DPO and of the RL
algorithms is the base itself, without adapters: no second copy of the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrlhf.config import RunConfig
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.models.hf_peft import save_peft_adapter
from jaxrlhf.sharding.model_sharding import param_shardings
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train.model_setup import init_params

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # beside the merged export hf/, in the run directory


def lora_spec(cfg: RunConfig) -> lora_lib.LoraSpec | None:
    """The run's adapters (None without a ``lora`` section)."""
    if cfg.lora is None:
        return None
    c = cfg.lora
    return lora_lib.LoraSpec(rank=c.rank, alpha=c.alpha, dropout=c.dropout, targets=c.targets)


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    """A LoRA model's two parts, abstract and sharded (static).

    Attributes:
      spec: the adapters.
      head: the model head (``lm`` or ``scalar``).
      frozen, trainable: their abstract trees (``jax.ShapeDtypeStruct``).
      frozen_shardings, trainable_shardings: their NamedSharding trees under the rules.
    """

    spec: lora_lib.LoraSpec
    head: str
    frozen: Any
    trainable: Any
    frozen_shardings: Any
    trainable_shardings: Any

    @property
    def plain_shardings(self) -> Any:
        """Shardings of the plain model's tree (the base, a scalar head's ``score`` included)."""
        return lora_lib.combine(self.frozen_shardings, _score(self.trainable_shardings))


def _score(tree: Any) -> dict[str, Any]:
    return {"score": tree["score"]} if "score" in tree else {}


def lora_layout(
    model: ModelConfig, mesh: Mesh, rules: Rules, head: str, spec: lora_lib.LoraSpec
) -> LoraLayout:
    """The frozen/trainable split of ``model`` with ``spec``'s adapters under ``rules``."""
    frozen, trainable = lora_lib.split_params(model_lib.abstract_params(model, head, spec))
    frozen_sh, trainable_sh = lora_lib.split_params(param_shardings(model, mesh, rules, head, spec))
    return LoraLayout(spec, head, frozen, trainable, frozen_sh, trainable_sh)


def initial_lora_params(
    cfg: RunConfig, model: ModelConfig, layout: LoraLayout, key: jax.Array
) -> tuple[Any, Any]:
    """``(frozen, trainable)``: the run's initial model (``model_setup.init_params``: random,
    or the checkpoint) split from its ``score`` head (a scalar model's, trained), and fresh
    adapters (``B = 0``, so the model starts as its base)."""
    params = init_params(cfg, model, layout.head, layout.plain_shardings, key)
    frozen, head = lora_lib.split_params(params)
    adapters = model_lib.init_adapters(
        model,
        layout.spec,
        jax.random.fold_in(key, 1),
        lora_lib.adapters_only(layout.trainable_shardings),
    )
    return frozen, lora_lib.combine(adapters, head)


def merged_params(spec: lora_lib.LoraSpec, frozen: Any, trainable: Any) -> Any:
    """The plain model's params with the adapters folded in (jitted; in the base's layout)."""
    return jax.jit(functools.partial(_merge, spec=spec))(frozen, trainable)


def _merge(frozen: Any, trainable: Any, *, spec: lora_lib.LoraSpec) -> Any:
    return lora_lib.merge(frozen, trainable, spec)


def export_lora(
    hf_dir: str,
    cfg: RunConfig,
    model: ModelConfig,
    spec: lora_lib.LoraSpec,
    head: str,
    frozen: Any,
    trainable: Any,
) -> str | None:
    """Writes the merged model to ``hf_dir`` (``*ForCausalLM`` / ``*ForSequenceClassification``)
    and the adapters in PEFT's format to ``ADAPTER_DIR`` beside it; returns that directory, or
    None when PEFT cannot express the targets for this family (logged; the merged export is
    written either way)."""
    dtype = cfg.checkpoint.export_dtype
    save_hf(hf_dir, model, merged_params(spec, frozen, trainable), head=head, dtype=dtype)
    adapter_dir = os.path.join(os.path.dirname(os.path.abspath(hf_dir)), ADAPTER_DIR)
    try:
        save_peft_adapter(
            adapter_dir,
            model,
            trainable,
            spec,
            head=head,
            base_model=cfg.model.hf_dir,
            dtype=dtype,
        )
    except ValueError as e:
        logger.warning("no PEFT adapter export: %s", e)
        return None
    return adapter_dir
