"""Shared, cached building blocks for the generation tests (compiles are the cost)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.generation import Sampler
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt2",
    "mixtral",
    "qwen3_moe",
)


@functools.cache
def tiny_cfg(family: str) -> ModelConfig:
    # std-0.3 weights so that logits are spread (greedy has no near-ties) and errors show;
    # a Mistral window shorter than prompt + response so the window mask matters (Gemma 2/3's
    # tiny configs have a window of 4 on their first layer; Phi-3 gets half-rotated heads).
    overrides = {
        "mistral": dict(sliding_window=4),
        "phi3": dict(partial_rotary_factor=0.5),
    }.get(family, {})
    return ModelConfig.tiny(family, initializer_range=0.3, **overrides)


@functools.cache
def tiny_params(family: str, seed: int = 0):
    """Random params drawn with NumPy (compiling the model's init costs seconds per family):
    weights N(0, 0.3^2), norm scales around their identity value."""
    cfg = tiny_cfg(family)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            base = 0.0 if (cfg.norm_unit_offset or name.endswith("bias']")) else 1.0
            value = base + 0.1 * rng.standard_normal(leaf.shape)
        else:
            value = 0.3 * rng.standard_normal(leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, M.abstract_params(cfg))


@functools.cache
def sampler(family: str) -> Sampler:
    """One unsharded Sampler per family, so tests share its compiled functions."""
    return Sampler(tiny_cfg(family))


@functools.cache
def jit_forward(cfg: ModelConfig):
    """The training-style forward: float32 logits [B, T, V] of the whole sequence."""
    return jax.jit(functools.partial(M.forward, M.build(cfg)))


def prompts(vocab: int, lengths=(7, 4, 2, 5), total: int = 7, seed: int = 0, left: bool = True):
    """[B, P] int32 prompt ids and bool mask with rows of the given real lengths; the real
    tokens of a row are the same whichever side the padding is on."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), total), np.int32)
    mask = np.zeros((len(lengths), total), bool)
    for row, n in enumerate(lengths):
        cols = slice(total - n, total) if left else slice(0, n)
        tokens[row, cols] = rng.integers(1, vocab, n)
        mask[row, cols] = True
    return tokens, mask


def greedy_reference(cfg: ModelConfig, params, tokens, mask, new: int) -> np.ndarray:
    """No-cache greedy decoding: a full forward over the whole sequence at every step.

    The sequence lives in a fixed [B, P + new] buffer whose not-yet-generated slots are
    masked (right padding), so one compiled forward serves every step.
    """
    forward = jit_forward(cfg)
    batch, prompt_len = tokens.shape
    seq = np.concatenate([tokens, np.zeros((batch, new), np.int32)], 1)
    seq_mask = np.concatenate([mask, np.zeros((batch, new), bool)], 1)
    for t in range(new):
        logits = forward(params, seq, seq_mask)[:, prompt_len + t - 1]
        seq[:, prompt_len + t] = np.asarray(jnp.argmax(logits, -1))
        seq_mask[:, prompt_len + t] = True
    return seq[:, prompt_len:]


def recompute_logits(cfg: ModelConfig, params, out) -> np.ndarray:
    """Training-style forward over prompt + response: logits predicting each response token."""
    seq = np.concatenate([np.asarray(out.prompt_tokens), np.asarray(out.tokens)], 1)
    seq_mask = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.response_mask)], 1)
    logits = np.asarray(jit_forward(cfg)(params, seq, seq_mask))
    p = out.prompt_tokens.shape[1]
    return logits[:, p - 1 : -1]
