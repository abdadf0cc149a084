"""LoRA adapters in PEFT's on-disk format: ``adapter_model.safetensors`` and
``adapter_config.json``, which ``peft.PeftModel.from_pretrained(base, directory)`` loads onto
the Hugging Face base model.

PEFT's layout (peft 0.x, ``get_peft_model_state_dict``): for each adapted ``torch.nn.Linear``
named ``M`` in the base model, ``base_model.model.M.lora_A.weight [r, in]`` and
``base_model.model.M.lora_B.weight [out, r]``, the update being ``(lora_alpha / r) * B A x``;
a sequence classifier's trained head is saved whole as ``base_model.model.score.weight``
(``modules_to_save``). Module names come from the same tables as the full checkpoints
(``hf_mapping.tensor_maps``), so every family whose projections are separate Linear layers
exports (Llama, Mistral, Qwen2/3, Gemma 1-3, the attention of Mixtral and Qwen3-MoE); a
projection that Hugging Face fuses with others (Phi-3's ``qkv_proj`` / ``gate_up_proj``,
GPT-2's ``c_attn``) has no adapter of its own there and is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_mapping import tensor_maps
from jaxrlhf.models.lora import TARGET_MODULES, LoraSpec
from jaxrlhf.models.safetensors_io import PlannedTensor, write_safetensors

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
TASK_TYPES = {"lm": "CAUSAL_LM", "scalar": "SEQ_CLS"}


def peft_module_names(cfg: ModelConfig, spec: LoraSpec) -> dict[str, str]:
    """``{target: Hugging Face module name template}`` (with ``{i}`` for the layer), e.g.
    ``{"q": "model.layers.{i}.self_attn.q_proj"}``.

    Raises:
      ValueError: a target's kernel is stored fused with other projections in this family's
        checkpoints (the message names it).
    """
    out = {}
    maps = tensor_maps(cfg)
    for target in spec.targets:
        path = f"decoder/layers/{TARGET_MODULES[target]}/{target}_kernel"
        (m,) = [m for m in maps if path in m.ours]
        if len(m.ours) != 1 or len(m.hf_keys) != 1 or not m.hf_keys[0].endswith(".weight"):
            raise ValueError(
                f"lora.targets: {target!r} is part of {m.hf_keys[0]} in {cfg.family} "
                "checkpoints, fused with other projections, so PEFT has no adapter for it alone "
                "(the merged export in hf/ has it)"
            )
        if cfg.family == "gpt2":  # Conv1D, not Linear: PEFT would need fan_in_fan_out
            raise ValueError("lora: PEFT adapter export does not support gpt2's Conv1D layers")
        out[target] = m.hf_keys[0][: -len(".weight")]
    return out


def peft_config(
    cfg: ModelConfig, spec: LoraSpec, head: str = "lm", base_model: str | None = None
) -> dict[str, Any]:
    """The ``adapter_config.json`` of these adapters (PEFT's ``LoraConfig`` fields)."""
    names = peft_module_names(cfg, spec)
    return {
        "peft_type": "LORA",
        "task_type": TASK_TYPES[head],
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in names.values()}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": ["score"] if head == "scalar" else None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def save_peft_adapter(
    directory: str,
    cfg: ModelConfig,
    trainable: Any,
    spec: LoraSpec,
    *,
    head: str = "lm",
    base_model: str | None = None,
    dtype: str | None = None,
) -> None:
    """Writes the adapters (``trainable``: ``models.lora.split_params``' trainable part) in
    PEFT's format to ``directory`` (all processes take part in the gathers; process 0 writes).

    Args:
      directory: created if needed.
      cfg, spec: the model and its adapters.
      head: ``lm`` (task ``CAUSAL_LM``) or ``scalar`` (``SEQ_CLS``, with the score head).
      base_model: recorded as ``base_model_name_or_path`` (the checkpoint trained from).
      dtype: tensor dtype on disk (default: ``cfg.param_dtype``).

    Raises:
      ValueError: a target PEFT cannot express for this family (:func:`peft_module_names`).
    """
    config = peft_config(cfg, spec, head, base_model)
    names = peft_module_names(cfg, spec)
    out_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.param_dtype))
    layers = trainable["decoder"]["layers"]
    planned, sources = [], []
    for target, module in names.items():
        adapters = layers[TARGET_MODULES[target]]
        a, b = adapters[f"{target}_lora_a"], adapters[f"{target}_lora_b"]
        fan_in, fan_out = math.prod(a.shape[1:-1]), math.prod(b.shape[2:])
        for i in range(cfg.num_layers):
            name = PREFIX + module.format(i=i)
            planned.append(PlannedTensor(f"{name}.lora_A.weight", (spec.rank, fan_in), out_dtype))
            planned.append(PlannedTensor(f"{name}.lora_B.weight", (fan_out, spec.rank), out_dtype))
            sources.append((a, i, (fan_in, spec.rank)))
            sources.append((b, i, (spec.rank, fan_out)))
    if head == "scalar":
        planned.append(PlannedTensor(PREFIX + "score.weight", (1, cfg.hidden_size), out_dtype))

    def tensors() -> Iterator[np.ndarray]:
        for leaf, i, shape in sources:
            yield _host(leaf[i]).reshape(shape).T
        if head == "scalar":
            yield _host(trainable["score"]).T

    if jax.process_index() != 0:
        for _ in tensors():  # take part in the collective gathers
            pass
        return
    os.makedirs(directory, exist_ok=True)
    (written,) = write_safetensors(directory, planned, tensors(), max_shard_bytes=None)
    os.replace(os.path.join(directory, written), os.path.join(directory, ADAPTER_WEIGHTS))
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
