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
    # Experts: HF key j is row j of our one leaf's first (per-layer) axis, so a shard reads
    # only its experts' tensors; to_ours/to_hf then convert one expert at a time.
    stacked: bool = False


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


def _experts(hf_key: str, ours: str, num_experts: int, our_shape: tuple[int, ...]) -> TensorMap:
    """Per-expert torch Linear weights ``hf_key.format(j=j)`` [out, in] <-> our
    ``[E, in, out]`` kernel (``our_shape`` = (in, out))."""
    base = _linear(hf_key, ours, our_shape, 1)
    keys = tuple(hf_key.replace("{j}", str(j)) for j in range(num_experts))
    return TensorMap(
        keys, (ours,), base.hf_shapes * num_experts, base.to_ours, base.to_hf, stacked=True
    )


def _fused_rows(
    hf_key: str, ours: tuple[str, ...], our_shapes: tuple[tuple[int, ...], ...]
) -> TensorMap:
    """One torch Linear weight whose output rows are several of our kernels one after the
    other (Phi-3's qkv_proj, gate_up_proj) <-> those kernels ``[D, *out]``."""
    d = our_shapes[0][0]
    widths = [int(np.prod(shape[1:])) for shape in our_shapes]
    bounds = np.cumsum(widths)[:-1].tolist()
    return TensorMap(
        (hf_key,),
        ours,
        ((sum(widths), d),),
        lambda w: [
            x.T.reshape(shape) for x, shape in zip(np.split(w[0], bounds), our_shapes, strict=True)
        ],
        lambda w: [np.concatenate([x.reshape(d, -1).T for x in w], axis=0)],
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
        *_norm_maps(cfg),
        _linear(L + "self_attn.o_proj.weight", ours + "attn/o_kernel", (n, h, d), 2),
    ]
    if cfg.family == "phi3":
        maps.append(
            _fused_rows(
                L + "self_attn.qkv_proj.weight",
                tuple(ours + f"attn/{x}_kernel" for x in "qkv"),
                ((d, n, h), (d, k, h), (d, k, h)),
            )
        )
    else:
        maps += [
            _linear(L + "self_attn.q_proj.weight", ours + "attn/q_kernel", (d, n, h), 1),
            _linear(L + "self_attn.k_proj.weight", ours + "attn/k_kernel", (d, k, h), 1),
            _linear(L + "self_attn.v_proj.weight", ours + "attn/v_kernel", (d, k, h), 1),
        ]
    if cfg.qk_norm:
        for x in "qk":
            maps.append(
                _identity(L + f"self_attn.{x}_norm.weight", ours + f"attn/{x}_norm/scale", (h,))
            )
    maps += _feed_forward_maps(cfg)
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


def _norm_maps(cfg: ModelConfig) -> list[TensorMap]:
    """Layer norms. Gemma 2/3 have four: their ``post_attention_layernorm`` normalises the
    attention output, where the other families' normalises the MLP input."""
    d, L, ours = cfg.hidden_size, "model.layers.{i}.", "decoder/layers/"
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
    if cfg.post_norms:
        names = {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "post_attn_norm",
            "pre_feedforward_layernorm": "mlp_norm",
            "post_feedforward_layernorm": "post_mlp_norm",
        }
    return [_identity(L + f"{hf}.weight", ours + f"{o}/scale", (d,)) for hf, o in names.items()]


def _feed_forward_maps(cfg: ModelConfig) -> list[TensorMap]:
    """The dense MLP (Phi-3: gate and up fused in one tensor) or the experts and router
    (Mixtral: block_sparse_moe.experts.{j}.w1/w3/w2; Qwen3-MoE: mlp.experts.{j}.*_proj)."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, "model.layers.{i}."
    mlp = "decoder/layers/mlp/"
    if cfg.num_experts:
        e, fe, moe = cfg.num_experts, cfg.expert_size, "decoder/layers/moe/"
        if cfg.family == "mixtral":
            block, names = L + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            block, names = L + "mlp.", ("gate_proj", "up_proj", "down_proj")
        expert = block + "experts.{j}.{name}.weight"
        return [
            _linear(block + "gate.weight", moe + "router_kernel", (d, e), 1),
            _experts(expert.replace("{name}", names[0]), moe + "gate_kernel", e, (d, fe)),
            _experts(expert.replace("{name}", names[1]), moe + "up_kernel", e, (d, fe)),
            _experts(expert.replace("{name}", names[2]), moe + "down_kernel", e, (fe, d)),
        ]
    down = _linear(L + "mlp.down_proj.weight", mlp + "down_kernel", (f, d), 1)
    if cfg.family == "phi3":
        gate_up = (mlp + "gate_kernel", mlp + "up_kernel")
        return [_fused_rows(L + "mlp.gate_up_proj.weight", gate_up, ((d, f), (d, f))), down]
    return [
        _linear(L + "mlp.gate_proj.weight", mlp + "gate_kernel", (d, f), 1),
        _linear(L + "mlp.up_proj.weight", mlp + "up_kernel", (d, f), 1),
        down,
    ]


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
