"""Load Hugging Face safetensors checkpoints into sharded params, and export them back.

Loading builds every param leaf with ``jax.make_array_from_callback``: each device's shard
is read from the memory-mapped safetensors files, converted to our layout one layer at a time
and placed straight on that device. No process ever holds the whole model in host memory and
no device holds more than its shards. Every tensor in the checkpoint must be used, every param
filled, and every shape must match, or loading fails with a one-line
:class:`CheckpointError`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_config import load_hf_config, to_hf_config
from jaxrlhf.models.hf_mapping import (
    IGNORABLE_SUFFIXES,
    TensorMap,
    decoder_prefix,
    tensor_maps,
)
from jaxrlhf.models.model import abstract_params
from jaxrlhf.models.safetensors_io import (
    CheckpointError,
    PlannedTensor,
    SafetensorsReader,
    write_safetensors,
)


def _flatten(tree: Any) -> dict[str, Any]:
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat["/".join(str(getattr(p, "key", p)) for p in path)] = leaf
    return flat


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = tree
        *parents, name = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return tree


def _resolve_key(reader: SafetensorsReader, key: str, cfg: ModelConfig) -> str:
    """HF key as stored: full-model files prefix the decoder ("model."), base-model files
    (e.g. the original GPT-2 release) do not."""
    if key in reader:
        return key
    prefix = decoder_prefix(cfg)
    if key.startswith(prefix) and key[len(prefix) :] in reader:
        return key[len(prefix) :]
    return key


def _check_tensors(
    reader: SafetensorsReader, cfg: ModelConfig, maps: list[TensorMap], skip_head: bool
) -> None:
    used = set()
    for m in maps:
        if skip_head and m.ours[0] in ("score", "lm_head"):
            continue
        layers = range(cfg.num_layers) if m.per_layer else [None]
        for key_template, shape in zip(m.hf_keys, m.hf_shapes, strict=True):
            for i in layers:
                key = _resolve_key(reader, key_template.format(i=i), cfg)
                if key not in reader:
                    raise CheckpointError(
                        f"checkpoint {reader.directory} has no tensor {key!r}, which a "
                        f"{cfg.family} model with this config.json needs"
                    )
                info = reader.info(key)
                if info.shape != shape:
                    raise CheckpointError(
                        f"tensor {key!r} in {info.file} has shape {list(info.shape)}, but "
                        f"config.json implies {list(shape)}"
                    )
                used.add(key)
    extra = sorted(
        k
        for k in reader.keys()
        if k not in used
        and not k.endswith(IGNORABLE_SUFFIXES)
        and k not in ("lm_head.weight", "score.weight")
    )
    if extra:
        raise CheckpointError(
            f"checkpoint {reader.directory} has {len(extra)} tensors this {cfg.family} config "
            f"does not use, e.g. {extra[:3]}"
        )


def load_params(
    directory: str,
    cfg: ModelConfig,
    *,
    head: str = "lm",
    shardings: Any | None = None,
    init_missing_head: bool = False,
) -> Any:
    """Params for ``cfg`` from the safetensors in ``directory``, placed in ``shardings``.

    Args:
      directory: a Hugging Face model directory (config.json + safetensors).
      cfg: the model config (usually ``load_hf_config(directory)``).
      head: "lm" (needs ``lm_head.weight`` unless tied) or "scalar" (``score.weight``).
      shardings: NamedSharding tree matching the params; default: first local device.
      init_missing_head: for a scalar head, allow a checkpoint without ``score.weight`` (a
        causal LM used to initialise a critic or reward model); the head is then zeros.

    Raises:
      CheckpointError: missing/extra tensors or files, wrong shapes.
    """
    reader = SafetensorsReader(directory)
    maps = tensor_maps(cfg, head)
    skip_head = head == "scalar" and init_missing_head and "score.weight" not in reader
    _check_tensors(reader, cfg, maps, skip_head)
    abstract = _flatten(abstract_params(cfg, head))
    if shardings is None:
        device = jax.local_devices()[0]
        shardings = jax.tree.map(
            lambda _: jax.sharding.SingleDeviceSharding(device), abstract_params(cfg, head)
        )
    flat_shardings = _flatten(shardings)

    @functools.lru_cache(maxsize=4)
    def converted(map_index: int, layer: int | None) -> tuple[np.ndarray, ...]:
        m = maps[map_index]
        hf = [reader.get(_resolve_key(reader, k.format(i=layer), cfg)) for k in m.hf_keys]
        return tuple(m.to_ours(hf))

    def expert_rows(m: TensorMap, layer: int, index: tuple, dtype: Any) -> np.ndarray:
        keys = m.hf_keys[index[0]]  # the experts of this shard
        hf = [reader.get(_resolve_key(reader, k.format(i=layer), cfg)) for k in keys]
        return np.stack([np.asarray(m.to_ours([w])[0][index[1:]], dtype=dtype) for w in hf])

    flat: dict[str, jax.Array] = {}
    for map_index, m in enumerate(maps):
        for slot, path in enumerate(m.ours):
            target = abstract[path]
            if skip_head and path == "score":
                flat[path] = jax.device_put(
                    np.zeros(target.shape, target.dtype), flat_shardings[path]
                )
                continue

            def shard(index, m=m, map_index=map_index, slot=slot, dtype=target.dtype):
                if not m.per_layer:
                    return np.asarray(converted(map_index, None)[slot][index], dtype=dtype)
                rows = range(*index[0].indices(cfg.num_layers))
                if m.stacked:  # read only this shard's experts
                    return np.stack([expert_rows(m, i, index[1:], dtype) for i in rows])
                return np.stack(
                    [
                        np.asarray(converted(map_index, i)[slot][index[1:]], dtype=dtype)
                        for i in rows
                    ]
                )

            flat[path] = jax.make_array_from_callback(target.shape, flat_shardings[path], shard)
    missing = sorted(set(abstract) - set(flat))
    if missing:  # a table bug, not a user error; still say exactly what
        raise CheckpointError(f"no Hugging Face tensor maps to params {missing}")
    return _unflatten(flat)


def load_hf(
    directory: str,
    *,
    head: str = "lm",
    shardings: Any | None = None,
    init_missing_head: bool = False,
    **config_overrides: Any,
) -> tuple[ModelConfig, Any]:
    """``(cfg, params)`` from a Hugging Face directory; ``config_overrides`` set ModelConfig
    fields such as ``dtype="bfloat16"`` or ``remat="full"``."""
    cfg = load_hf_config(directory, **config_overrides)
    return cfg, load_params(
        directory, cfg, head=head, shardings=shardings, init_missing_head=init_missing_head
    )


def _host_layer(leaf: jax.Array, layer: int | None) -> np.ndarray:
    part = leaf if layer is None else leaf[layer]
    if not part.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(part, tiled=True))
    return np.asarray(jax.device_get(part))


def save_hf(
    directory: str,
    cfg: ModelConfig,
    params: Any,
    *,
    head: str = "lm",
    dtype: str | None = None,
    max_shard_bytes: int | None = 5 * 2**30,
) -> None:
    """Write ``params`` as a Hugging Face checkpoint that ``from_pretrained`` loads.

    The LM head exports as ``*ForCausalLM``; the scalar head as a one-label
    ``*ForSequenceClassification``. Tensors are gathered one layer at a time (all processes
    take part in the gathers; only process 0 writes).

    Args:
      directory: created if needed.
      cfg, params: the model.
      head: "lm" or "scalar".
      dtype: tensor dtype on disk (default: ``cfg.param_dtype``).
      max_shard_bytes: split into several files with an index above this size.
    """
    maps = tensor_maps(cfg, head)
    flat = _flatten(params)
    out_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.param_dtype))
    planned = []
    for m in maps:
        for i in range(cfg.num_layers) if m.per_layer else [None]:
            for key, shape in zip(m.hf_keys, m.hf_shapes, strict=True):
                planned.append(PlannedTensor(key.format(i=i), shape, out_dtype))

    def tensors() -> Iterator[np.ndarray]:
        for m in maps:
            for i in range(cfg.num_layers) if m.per_layer else [None]:
                ours = [_host_layer(flat[p], i) for p in m.ours]
                if m.stacked:  # one HF tensor per expert
                    yield from (m.to_hf([expert])[0] for expert in ours[0])
                else:
                    yield from m.to_hf(ours)

    is_writer = jax.process_index() == 0
    if is_writer:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(to_hf_config(cfg, head), f, indent=2, sort_keys=True)
        write_safetensors(directory, planned, tensors(), max_shard_bytes=max_shard_bytes)
    else:
        for _ in tensors():  # take part in the collective gathers
            pass
