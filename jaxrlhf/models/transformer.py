"""Decoder-only transformer (Flax Linen) covering Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3,
GPT-2 and the Mixtral / Qwen3-MoE mixtures of experts.

Layers run under ``nn.scan`` with parameters stacked on a leading ``layers`` axis, so compile
time does not grow with depth (stacks of at most ``UNROLL_MAX_LAYERS`` are unrolled: faster
at run time, see there). Every parameter carries logical axis names (models/axes.py);
activations are constrained through an optional ``constrain`` callable supplied by the
sharding package, so this module never names a mesh axis.

Every model here is causal: called without a KV cache, its attention mask must be False
wherever key slot s > query slot t (as ``attention.causal_mask`` and sequence packing's masks
are), because attention then skips the key blocks above the diagonal
(``attention.block_causal_attention``). A bidirectional or prefix-LM mask is not supported.

Param tree (``CausalLM``)::

    decoder/embed/embedding            [V, D]     (vocab, embed)
    decoder/pos_embed/embedding        [P, D]     (positions, embed)        GPT-2 only
    decoder/layers/attn_norm/scale     [L, D]     (layers, norm)            (+ bias for LayerNorm)
    decoder/layers/attn/q_kernel       [L, D, N, H]
    decoder/layers/attn/k_kernel       [L, D, K, H]   v_kernel alike
    decoder/layers/attn/o_kernel       [L, N, H, D]   (+ q/k/v/o biases where configured)
    decoder/layers/attn/q_norm/scale   [L, H]     k_norm alike              qk_norm only
    decoder/layers/post_attn_norm/scale [L, D]    post_mlp_norm alike       post_norms only
    decoder/layers/mlp_norm/scale      [L, D]
    decoder/layers/mlp/gate_kernel     [L, D, F]  up_kernel alike (gate only when gated)
    decoder/layers/mlp/down_kernel     [L, F, D]
    decoder/layers/moe/router_kernel   [L, D, E]  instead of mlp/ in MoE models
    decoder/layers/moe/gate_kernel     [L, E, D, F]  (layers, expert, embed, mlp); up alike
    decoder/layers/moe/down_kernel     [L, E, F, D]
    decoder/final_norm/scale           [D]
    lm_head                            [D, V]     (embed, vocab)            untied models only
``ScalarModel`` has ``score [D, 1]`` (embed, scalar) instead of ``lm_head`` (value or reward
head). Built with a :class:`~jaxrlhf.models.lora.LoraSpec`, the targeted attention and MLP
kernels get ``<name>_lora_a`` / ``<name>_lora_b`` adapters beside them (models/lora.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import axes, moe
from jaxrlhf.models.attention import (
    LayerMasks,
    RopeAngles,
    apply_rope,
    dot_product_attention,
    rope_angles,
    softcap,
)
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraSpec, lora_delta
from jaxrlhf.models.shared_prefix import SharedPrefixMask, shared_prefix_attention

Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


def no_constraint(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """The default activation constraint: leave layout to the compiler."""
    del names
    return x


@flax.struct.dataclass
class KVCache:
    """Per-layer key/value cache, stacked over layers.

    Attributes:
      k: [L, B, S, K, H] keys, already rotated by RoPE.
      v: [L, B, S, K, H] values.
    """

    k: jax.Array
    v: jax.Array

    @staticmethod
    def logical_axes() -> tuple[str | None, ...]:
        return (axes.LAYERS, axes.CACHE_BATCH, axes.CACHE_LENGTH, axes.CACHE_HEADS, None)


def param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple, init) -> jax.Array:
    """``module``'s parameter ``name`` stored in the weight dtype with logical axis
    ``names``, returned in the compute dtype."""
    cfg: ModelConfig = module.cfg
    return module.param(
        name, nn.with_logical_partitioning(init, names), shape, cfg.weight_dtype
    ).astype(cfg.compute_dtype)


def dense(x: Float[Array, "*B K"], kernel: Float[Array, "K N"]) -> Float[Array, "*B N"]:
    """``x @ kernel`` over the last axis, computed as one 2-D matmul ``[prod(B), K] x [K, N]``.

    Same result as ``jnp.einsum("BTK,KN->BTN", ...)`` but a much cheaper backward on XLA:CPU:
    the weight gradient of the 3-D einsum contracts two axes (B and T), which XLA
    canonicalises by physically transposing the ``[B, T, N]`` cotangent (fused with the
    activation's derivative, these copies were a large part of a small model's update). The
    2-D form's weight gradient ``x2ᵀ g2`` is one matmul with a transposed operand and no copy.
    """
    out = jnp.dot(x.reshape(-1, x.shape[-1]), kernel)
    return out.reshape(*x.shape[:-1], kernel.shape[-1])


def dense_init(cfg: ModelConfig):
    """The kernels' initializer: normal with the model's ``initializer_range``."""
    return nn.initializers.normal(stddev=cfg.initializer_range)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}

# Layer stacks up to this deep run their nn.scan fully unrolled (same params, same math). A
# scanned stack keeps each layer's activations for the backward in stacked [L, ...] buffers:
# zero-filled, written slice by slice in the forward and read back slice by slice in the
# backward; unrolled, XLA keeps them as plain per-layer arrays, which makes a small model's
# update on XLA:CPU measurably faster. Compile time grows with depth, so deeper stacks stay a
# loop (benchmarks/RESULTS.md has both figures).
UNROLL_MAX_LAYERS = 16


def unrolled(cfg: ModelConfig) -> bool:
    """Whether the layer stack runs unrolled: ``layer_loop`` says so, or ``auto`` and at
    most :data:`UNROLL_MAX_LAYERS` layers (by the model's depth, not a stack's: a deep
    model's Hydra branches loop too)."""
    if cfg.layer_loop != "auto":
        return cfg.layer_loop == "unroll"
    return cfg.num_layers <= UNROLL_MAX_LAYERS


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


class Norm(nn.Module):
    """RMSNorm (optionally Gemma's ``1 + w`` scale) or LayerNorm, computed in float32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        cfg = self.cfg
        dim = x.shape[-1]
        scale_init = nn.initializers.zeros if cfg.norm_unit_offset else nn.initializers.ones
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(scale_init, (axes.NORM,)),
            (dim,),
            cfg.weight_dtype,
        ).astype(jnp.float32)
        h = x.astype(jnp.float32)
        if cfg.norm_type == "layer":
            h = h - h.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + cfg.norm_eps)
        if cfg.norm_unit_offset:
            scale = 1.0 + scale
        if cfg.norm_type == "layer":
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.NORM,)),
                (dim,),
                cfg.weight_dtype,
            ).astype(jnp.float32)
            return (h * scale + bias).astype(cfg.compute_dtype)
        if cfg.norm_unit_offset:  # Gemma scales in float32, then casts
            return (h * scale).astype(cfg.compute_dtype)
        # Llama casts the normalised activations before the scale multiply.
        return scale.astype(cfg.compute_dtype) * h.astype(cfg.compute_dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self,
        x: Float[Array, "B T D"],
        rope: tuple[Float[Array, "B T R2"], Float[Array, "B T R2"]] | None,
        mask: Bool[Array, "B T S"],
        cache: tuple[jax.Array, jax.Array] | None,
        cache_index: Int[Array, ""] | None,
    ) -> tuple[Float[Array, "B T D"], tuple[jax.Array, jax.Array] | None]:
        """``rope``: this layer's RoPE cos and sin of every token (None: no RoPE;
        :meth:`~jaxrlhf.models.attention.RopeAngles.layer`)."""
        cfg = self.cfg
        d, n, k_heads, h = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        init = dense_init(cfg)
        zeros = nn.initializers.zeros

        def project(name: str, heads: int, head_axis: str) -> jax.Array:
            kernel = param(
                self, f"{name}_kernel", (d, heads, h), (axes.EMBED, head_axis, axes.HEAD_DIM), init
            )
            out = dense(x, kernel.reshape(d, heads * h)).reshape(*x.shape[:-1], heads, h)
            if self.adapts(name):
                out = out + lora_delta(
                    self,
                    self.lora,
                    name,
                    x,
                    (d,),
                    (heads, h),
                    (axes.EMBED,),
                    (head_axis, axes.HEAD_DIM),
                )
            if cfg.qkv_bias:
                out = out + param(
                    self, f"{name}_bias", (heads, h), (head_axis, axes.HEAD_DIM), zeros
                )
            return self.constrain(out, (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))

        q = project("q", n, axes.HEADS)
        k = project("k", k_heads, axes.KV_HEADS)
        v = project("v", k_heads, axes.KV_HEADS)
        if cfg.qk_norm:  # per head, over head_dim, before RoPE
            q = Norm(cfg, name="q_norm")(q)
            k = Norm(cfg, name="k_norm")(k)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)

        new_cache = None
        if cache is not None:
            cache_k, cache_v = cache
            start = (0, cache_index, 0, 0)
            k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), start)
            v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), start)
            new_cache = (k, v)
            k, v = k.astype(cfg.compute_dtype), v.astype(cfg.compute_dtype)

        scale, cap = cfg.attn_scale, cfg.attn_logit_softcap
        if isinstance(mask, SharedPrefixMask):  # packed groups (models/shared_prefix.py)
            out = shared_prefix_attention(q, k, v, mask, scale=scale, logit_cap=cap)
        else:
            # Without a cache the queries are the keys' own slots and every mask jaxrlhf
            # builds is causal in slot index (Decoder's ``mask``).
            out = dot_product_attention(
                q,
                k,
                v,
                mask,
                scale=scale,
                impl=cfg.attention_impl,
                logit_cap=cap,
                causal=cache is None,
            )
        o_kernel = param(self, "o_kernel", (n, h, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), init)
        attn = out
        out = dense(out.reshape(*out.shape[:-2], n * h), o_kernel.reshape(n * h, d))
        if self.adapts("o"):
            names = (axes.HEADS, axes.HEAD_DIM)
            out = out + lora_delta(self, self.lora, "o", attn, (n, h), (d,), names, (axes.EMBED,))
        if cfg.out_bias:
            out = out + param(self, "o_bias", (d,), (axes.EMBED,), zeros)
        return out, new_cache

    def adapts(self, name: str) -> bool:
        return self.lora is not None and name in self.lora.targets


class Mlp(nn.Module):
    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    def adapts(self, name: str) -> bool:
        return self.lora is not None and name in self.lora.targets

    def project(self, name: str, x: jax.Array, kernel: jax.Array, in_name: str, out_name: str):
        """``x @ kernel`` plus the LoRA update when ``name`` is adapted."""
        out = dense(x, kernel)
        if self.adapts(name):
            dims = ((kernel.shape[0],), (kernel.shape[1],), (in_name,), (out_name,))
            out = out + lora_delta(self, self.lora, name, x, *dims)
        return out

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        cfg = self.cfg
        d, f = cfg.hidden_size, cfg.intermediate_size
        init, zeros = dense_init(cfg), nn.initializers.zeros
        act = ACTIVATIONS[cfg.activation]
        act_names = (axes.BATCH, axes.LENGTH, axes.ACT_MLP)

        up_kernel = param(self, "up_kernel", (d, f), (axes.EMBED, axes.MLP), init)
        up = self.project("up", x, up_kernel, axes.EMBED, axes.MLP)
        if cfg.mlp_bias:
            up = up + param(self, "up_bias", (f,), (axes.MLP,), zeros)
        if cfg.gated_mlp:
            gate_kernel = param(self, "gate_kernel", (d, f), (axes.EMBED, axes.MLP), init)
            gate = self.project("gate", x, gate_kernel, axes.EMBED, axes.MLP)
            if cfg.mlp_bias:
                gate = gate + param(self, "gate_bias", (f,), (axes.MLP,), zeros)
            hidden = act(gate) * up
        else:
            hidden = act(up)
        hidden = self.constrain(hidden, act_names)
        down_kernel = param(self, "down_kernel", (f, d), (axes.MLP, axes.EMBED), init)
        out = self.project("down", hidden, down_kernel, axes.MLP, axes.EMBED)
        if cfg.mlp_bias:
            out = out + param(self, "down_bias", (d,), (axes.EMBED,), zeros)
        return out


class MoeMlp(nn.Module):
    """Mixture of gated experts with a top-k router (models/moe.py: dropless routing).

    The router's float32 logits are sown as ``intermediates/router_logits`` (read by
    :func:`jaxrlhf.models.moe.capture_router_logits`; free when not asked for).
    """

    cfg: ModelConfig
    constrain: Constrain = no_constraint

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        cfg = self.cfg
        d, f, e = cfg.hidden_size, cfg.expert_size, cfg.num_experts
        init = dense_init(cfg)
        router = param(self, "router_kernel", (d, e), (axes.EMBED, None), init)
        names = (axes.EXPERT, axes.EMBED, axes.MLP)
        gate = param(self, "gate_kernel", (e, d, f), names, init)
        up = param(self, "up_kernel", (e, d, f), names, init)
        down = param(self, "down_kernel", (e, f, d), (axes.EXPERT, axes.MLP, axes.EMBED), init)
        logits = dense(x, router).astype(jnp.float32)  # [B, T, E]
        self.sow("intermediates", "router_logits", logits)
        weights, experts = moe.route(
            logits.reshape(-1, e), cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
        act = ACTIVATIONS[cfg.activation]
        out = moe.expert_mlp(x.reshape(-1, d), weights, experts, gate, up, down, act)
        return out.reshape(x.shape)


def feed_forward(cfg: ModelConfig, constrain: Constrain, lora: LoraSpec | None) -> nn.Module:
    """The layer's MLP block: experts (named ``moe``; not adapted by LoRA) or a dense MLP
    (``mlp``)."""
    if cfg.num_experts:
        return MoeMlp(cfg, constrain, name="moe")
    return Mlp(cfg, constrain, lora, name="mlp")


def select_layer_mask(cfg: ModelConfig, mask: Any, layer: Int[Array, ""]) -> Any:
    """This layer's attention mask: a :class:`LayerMasks`' ``sliding`` or ``full`` part by
    ``cfg.sliding_layers`` (statically where every layer is alike), any other mask as is."""
    if not isinstance(mask, LayerMasks):
        return mask
    sliding = cfg.sliding_layers
    if all(sliding):
        return mask.sliding
    if not any(sliding):
        return mask.full
    is_sliding = jnp.asarray(sliding)[layer]
    return jax.tree.map(lambda full, win: jnp.where(is_sliding, win, full), mask.full, mask.sliding)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); with ``post_norms`` (Gemma 2/3)
    x + norm(attn(norm(x))) and x + norm(mlp(norm(.))). Scanned over layers; ``layer`` is
    this layer's index (per-layer windows and RoPE bases); ``rope``: every token's
    :class:`~jaxrlhf.models.attention.RopeAngles` (None without RoPE)."""

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(self, x, rope: RopeAngles | None, mask, cache, cache_index, layer):
        cfg = self.cfg
        residual_names = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)
        mask = select_layer_mask(cfg, mask, layer)
        attn_out, new_cache = Attention(cfg, self.constrain, self.lora, name="attn")(
            Norm(cfg, name="attn_norm")(x),
            None if rope is None else rope.layer(layer),
            mask,
            cache,
            cache_index,
        )
        if cfg.post_norms:
            attn_out = Norm(cfg, name="post_attn_norm")(attn_out)
        x = self.constrain(x + attn_out, residual_names)
        mlp_out = feed_forward(cfg, self.constrain, self.lora)(Norm(cfg, name="mlp_norm")(x))
        if cfg.post_norms:
            mlp_out = Norm(cfg, name="post_mlp_norm")(mlp_out)
        x = x + mlp_out
        return self.constrain(x, residual_names), new_cache


def embeddings(cfg: ModelConfig) -> tuple[nn.Module, nn.Module | None]:
    """The token embedding and, for learned positions (GPT-2), the position embedding
    (unbound: assign them in a module's ``setup``)."""
    emb_init = nn.with_logical_partitioning(
        nn.initializers.normal(stddev=cfg.initializer_range), (axes.VOCAB, axes.EMBED)
    )
    embed = nn.Embed(
        cfg.vocab_size,
        cfg.hidden_size,
        embedding_init=emb_init,
        param_dtype=cfg.weight_dtype,
        dtype=cfg.compute_dtype,
    )
    if cfg.position_embedding != "learned":
        return embed, None
    pos_init = nn.with_logical_partitioning(
        nn.initializers.normal(stddev=cfg.initializer_range), (axes.POSITIONS, axes.EMBED)
    )
    pos_embed = nn.Embed(
        cfg.max_position_embeddings,
        cfg.hidden_size,
        embedding_init=pos_init,
        param_dtype=cfg.weight_dtype,
        dtype=cfg.compute_dtype,
    )
    return embed, pos_embed


def embed_inputs(
    cfg: ModelConfig,
    constrain: Constrain,
    embed: nn.Module,
    pos_embed: nn.Module | None,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
) -> Float[Array, "B T D"]:
    """The residual stream's input: token embeddings (scaled for Gemma) plus learned
    positions (GPT-2)."""
    x = embed(tokens)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=cfg.compute_dtype)
    if pos_embed is not None:
        x = x + pos_embed(positions)
    return constrain(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))


def layer_stack(
    cfg: ModelConfig, constrain: Constrain, lora: LoraSpec | None, count: int
) -> nn.Module:
    """``count`` decoder layers under ``nn.scan`` (params stacked on a leading ``layers``
    axis), rematerialised per ``cfg.remat``; called as ``(x, rope_angles(cfg, positions),
    mask, cache, cache_index, layer_ids [count])``."""
    layer = DecoderLayer
    if cfg.remat != "none":
        layer = nn.remat(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return nn.scan(
        layer,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, 0),
        length=count,
        unroll=count if unrolled(cfg) else 1,
        metadata_params={nn.PARTITION_NAME: axes.LAYERS},
    )(cfg, constrain, lora)


class Decoder(nn.Module):
    """Embeddings, the scanned layer stack and the final norm: tokens -> hidden states."""

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    def setup(self) -> None:
        cfg = self.cfg
        self.embed, pos_embed = embeddings(cfg)
        if pos_embed is not None:
            self.pos_embed = pos_embed
        self.layers = layer_stack(cfg, self.constrain, self.lora, cfg.num_layers)
        self.final_norm = Norm(cfg)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        mask: Bool[Array, "B T S"] | LayerMasks,
        cache: KVCache | None = None,
        cache_index: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "B T D"], KVCache | None]:
        """``mask``: one attention mask for every layer, or :class:`LayerMasks` (each layer
        takes the part its ``layer_types`` entry names). Without a ``cache`` it must be
        causal in slot index (False wherever key slot s > query slot t), as
        :func:`~jaxrlhf.models.attention.causal_mask` and sequence packing's block mask are:
        attention skips the key blocks above the diagonal."""
        cfg = self.cfg
        pos_embed = self.pos_embed if cfg.position_embedding == "learned" else None
        x = embed_inputs(cfg, self.constrain, self.embed, pos_embed, tokens, positions)
        layer_cache = None if cache is None else (cache.k, cache.v)
        layer_ids = jnp.arange(cfg.num_layers)
        rope = rope_angles(cfg, positions)
        x, new_layer_cache = self.layers(x, rope, mask, layer_cache, cache_index, layer_ids)
        new_cache = None if cache is None else KVCache(*new_layer_cache)
        return self.final_norm(x), new_cache

    def attend(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """Tied LM head: logits = hidden · embeddingᵀ."""
        return self.embed.attend(hidden)


class CausalLM(nn.Module):
    """Decoder with a language-model head. Returns float32 logits [B, T, V].

    ``head_from`` (a Python int) applies the head to positions ``head_from:`` only, giving
    ``[B, T - head_from, V]``: the RL scorer needs the response's logits alone, and on CPU the
    head and the log-softmax over the vocabulary are a large share of a small model's step.
    ``select`` (a function of the ``[B, T, D]`` final hidden states) instead picks the
    positions the head runs on, e.g. :func:`jaxrlhf.models.shared_prefix.response_inputs`.
    """

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self, tokens, positions, mask, cache=None, cache_index=None, *, head_from=0, select=None
    ):
        decoder, hidden, new_cache = head_inputs(
            self, tokens, positions, mask, cache, cache_index, head_from, select
        )
        return lm_logits(self, decoder, hidden), new_cache


def head_inputs(
    module: nn.Module, tokens, positions, mask, cache, cache_index, head_from: int, select
) -> tuple[Decoder, Float[Array, "B T D"], KVCache | None]:
    """``(decoder, hidden, new_cache)`` of a compact model with a head (``module``: its
    ``cfg``, ``constrain`` and ``lora``): the ``decoder`` submodule run on the inputs, and
    its final hidden states at the positions the head reads (``head_from:``, or what
    ``select`` picks)."""
    decoder = Decoder(module.cfg, module.constrain, module.lora, name="decoder")
    hidden, new_cache = decoder(tokens, positions, mask, cache, cache_index)
    hidden = hidden[:, head_from:] if select is None else select(hidden)
    return decoder, hidden, new_cache


def lm_logits(module: nn.Module, decoder: Decoder, hidden: Float[Array, "B T D"]) -> jax.Array:
    """The language-model head of ``module`` (a compact Linen module with ``cfg`` and
    ``constrain``) on ``hidden``: float32 logits ``[B, T, V]``, tied to ``decoder``'s
    embedding or from ``module``'s own ``lm_head`` param, soft-capped as the model says."""
    cfg = module.cfg
    if cfg.tie_embeddings:
        logits = decoder.attend(hidden)
    else:
        kernel = param(
            module,
            "lm_head",
            (cfg.hidden_size, cfg.vocab_size),
            (axes.EMBED, axes.VOCAB),
            dense_init(cfg),
        )
        logits = dense(hidden, kernel)
    logits = module.constrain(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))
    return softcap(logits.astype(jnp.float32), cfg.final_logit_softcap)


class ScalarModel(nn.Module):
    """Decoder with a scalar head (``score``, no bias): per-token values [B, T] in float32.

    Used as the critic (value per token) and as the reward model (the value at each row's
    last real token, see :func:`jaxrlhf.models.heads.last_token_values`). ``head_from`` and
    ``select`` as for :class:`CausalLM`. The head is stored in float32 whatever
    ``param_dtype`` (it is trained beside a frozen base, e.g. with LoRA, where bfloat16
    would round its small updates away) and cast to the compute dtype at use.
    """

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self, tokens, positions, mask, cache=None, cache_index=None, *, head_from=0, select=None
    ):
        cfg = self.cfg
        _, hidden, new_cache = head_inputs(
            self, tokens, positions, mask, cache, cache_index, head_from, select
        )
        init = nn.with_logical_partitioning(dense_init(cfg), (axes.EMBED, axes.SCALAR))
        kernel = self.param("score", init, (cfg.hidden_size, 1), jnp.float32)
        values = dense(hidden, kernel.astype(cfg.compute_dtype))[..., 0]
        return values.astype(jnp.float32), new_cache


HEADS: dict[str, Any] = {"lm": CausalLM, "scalar": ScalarModel}
