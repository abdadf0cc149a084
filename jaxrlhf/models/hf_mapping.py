"""Weight-name tables: Hugging Face tensors <-> jaxrlhf params, one table per family.

Each :class:`TensorMap` ties one or more HF tensors to one or more of our param leaves with a
pair of inverse transforms. Per-layer maps use ``{i}`` in the HF key and address one layer of
our stacked ``[L, ...]`` leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxrlhf.models.config import ModelConfig

Arrays = Sequence[np.ndarray]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """HF tensors ``hf_keys`` <-> our leaves ``ours`` (paths joined with "/").

    ``hf_shapes`` gives the expected HF shapes; ``to_ours``/``to_hf`` convert between the
    layouts (for one layer when ``per_layer``).
    """

    hf_keys: tuple[str, ...]
    ours: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable[[Arrays], list[np.ndarray]]
    to_hf: Callable[[Arrays], list[np.ndarray]]
    per_layer: bool = True


def _identity(hf_key: str, ours: str, shape: tuple[int, ...], per_layer: bool = True) -> TensorMap:
    return TensorMap((hf_key,), (ours,), (shape,), list, list, per_layer)


def _linear(hf_key: str, ours: str, our_shape: tuple[int, ...], in_ndim: int) -> TensorMap:
    """torch Linear weight [out, in] <-> our kernel [*in_dims, *out_dims]."""
    n_in = int(np.prod(our_shape[:in_ndim]))
    n_out = int(np.prod(our_shape[in_ndim:]))
    return TensorMap(
        (hf_key,),
        (ours,),
        ((n_out, n_in),),
        lambda w: [w[0].T.reshape(our_shape)],
        lambda w: [w[0].reshape(n_in, n_out).T],
    )


def _reshape(
    hf_key: str,
    ours: str,
    hf_shape: tuple[int, ...],
    our_shape: tuple[int, ...],
    per_layer: bool = True,
) -> TensorMap:
    return TensorMap(
        (hf_key,),
        (ours,),
        (hf_shape,),
        lambda w: [w[0].reshape(our_shape)],
        lambda w: [w[0].reshape(hf_shape)],
        per_layer,
    )


def _head_maps(cfg: ModelConfig, head: str) -> list[TensorMap]:
    d, v = cfg.hidden_size, cfg.vocab_size
    if head == "scalar":
        return [_linear("score.weight", "score", (d, 1), 1) | _top]
    if cfg.tie_embeddings:
        return []
    return [_linear("lm_head.weight", "lm_head", (d, v), 1) | _top]


class _TopLevel:
    """``map | _top`` marks a map as not per-layer (sugar to keep the tables readable)."""

    def __ror__(self, m: TensorMap) -> TensorMap:
        return dataclasses.replace(m, per_layer=False)


_top = _TopLevel()


def _llama_like(cfg: ModelConfig) -> list[TensorMap]:
    d, f, n, k, h, v = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.kv_heads,
        cfg.dim_per_head,
        cfg.vocab_size,
    )
    L = "model.layers.{i}."
    ours = "decoder/layers/"
    maps = [
        _identity("model.embed_tokens.weight", "decoder/embed/embedding", (v, d), False),
        _identity("model.norm.weight", "decoder/final_norm/scale", (d,), False),
        _identity(L + "input_layernorm.weight", ours + "attn_norm/scale", (d,)),
        _identity(L + "post_attention_layernorm.weight", ours + "mlp_norm/scale", (d,)),
        _linear(L + "self_attn.q_proj.weight", ours + "attn/q_kernel", (d, n, h), 1),
        _linear(L + "self_attn.k_proj.weight", ours + "attn/k_kernel", (d, k, h), 1),
        _linear(L + "self_attn.v_proj.weight", ours + "attn/v_kernel", (d, k, h), 1),
        _linear(L + "self_attn.o_proj.weight", ours + "attn/o_kernel", (n, h, d), 2),
        _linear(L + "mlp.gate_proj.weight", ours + "mlp/gate_kernel", (d, f), 1),
        _linear(L + "mlp.up_proj.weight", ours + "mlp/up_kernel", (d, f), 1),
        _linear(L + "mlp.down_proj.weight", ours + "mlp/down_kernel", (f, d), 1),
    ]
    if cfg.qkv_bias:
        for name, heads in (("q", n), ("k", k), ("v", k)):
            maps.append(
                _reshape(
                    L + f"self_attn.{name}_proj.bias",
                    ours + f"attn/{name}_bias",
                    (heads * h,),
                    (heads, h),
                )
            )
    if cfg.out_bias:
        maps.append(_identity(L + "self_attn.o_proj.bias", ours + "attn/o_bias", (d,)))
    if cfg.mlp_bias:
        for name, size in (("gate", f), ("up", f), ("down", d)):
            maps.append(_identity(L + f"mlp.{name}_proj.bias", ours + f"mlp/{name}_bias", (size,)))
    return maps


def _gpt2(cfg: ModelConfig) -> list[TensorMap]:
    d, f, n, h, v = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.dim_per_head,
        cfg.vocab_size,
    )
    L = "transformer.h.{i}."
    ours = "decoder/layers/"
    qkv_names = tuple(ours + f"attn/{x}_kernel" for x in "qkv")
    qkv_bias_names = tuple(ours + f"attn/{x}_bias" for x in "qkv")
    maps = [
        _identity("transformer.wte.weight", "decoder/embed/embedding", (v, d), False),
        _identity(
            "transformer.wpe.weight",
            "decoder/pos_embed/embedding",
            (cfg.max_position_embeddings, d),
            False,
        ),
        _identity("transformer.ln_f.weight", "decoder/final_norm/scale", (d,), False),
        _identity("transformer.ln_f.bias", "decoder/final_norm/bias", (d,), False),
        _identity(L + "ln_1.weight", ours + "attn_norm/scale", (d,)),
        _identity(L + "ln_1.bias", ours + "attn_norm/bias", (d,)),
        _identity(L + "ln_2.weight", ours + "mlp_norm/scale", (d,)),
        _identity(L + "ln_2.bias", ours + "mlp_norm/bias", (d,)),
        # Conv1D stores [in, out]; c_attn packs q, k and v along `out`.
        TensorMap(
            (L + "attn.c_attn.weight",),
            qkv_names,
            ((d, 3 * n * h),),
            lambda w: [x.reshape(d, n, h) for x in np.split(w[0], 3, axis=1)],
            lambda w: [np.concatenate([x.reshape(d, n * h) for x in w], axis=1)],
        ),
        TensorMap(
            (L + "attn.c_attn.bias",),
            qkv_bias_names,
            ((3 * n * h,),),
            lambda w: [x.reshape(n, h) for x in np.split(w[0], 3)],
            lambda w: [np.concatenate([x.reshape(n * h) for x in w])],
        ),
        _reshape(L + "attn.c_proj.weight", ours + "attn/o_kernel", (n * h, d), (n, h, d)),
        _identity(L + "attn.c_proj.bias", ours + "attn/o_bias", (d,)),
        _identity(L + "mlp.c_fc.weight", ours + "mlp/up_kernel", (d, f)),
        _identity(L + "mlp.c_fc.bias", ours + "mlp/up_bias", (f,)),
        _identity(L + "mlp.c_proj.weight", ours + "mlp/down_kernel", (f, d)),
        _identity(L + "mlp.c_proj.bias", ours + "mlp/down_bias", (d,)),
    ]
    return maps


def tensor_maps(cfg: ModelConfig, head: str = "lm") -> list[TensorMap]:
    """The full table for ``cfg`` with a "lm" or "scalar" head, HF keys in the layout that
    ``save_pretrained`` of the matching *ForCausalLM / *ForSequenceClassification writes."""
    body = _gpt2(cfg) if cfg.family == "gpt2" else _llama_like(cfg)
    return body + _head_maps(cfg, head)


def decoder_prefix(cfg: ModelConfig) -> str:
    """The prefix of decoder tensors in a full-model checkpoint ("model." or "transformer.")."""
    return "transformer." if cfg.family == "gpt2" else "model."


# Tensors a checkpoint may carry that we do not need (non-persistent buffers in old files).
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
