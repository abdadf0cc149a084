"""Logit parity with transformers' PyTorch models on the same safetensors weights.

Tolerance: fp32 max abs difference <= 1e-4 on logits of magnitude ~1-10; both sides compute
in float32, so differences are summation-order rounding (observed ~1e-6).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxrlhf.models import model as M
from jaxrlhf.models.hf_checkpoint import load_hf, save_hf
from tests.models.hf_fixtures import (
    FAMILY_CASES,
    hf_classes,
    hf_outputs,
    make_hf_model,
    padded_batch,
)
from tests.tiers import tiered

torch = pytest.importorskip("torch")
ATOL = 1e-4


def _ours(directory, tokens, mask, head="lm", **overrides):
    cfg, params = load_hf(directory, head=head, **overrides)
    return cfg, params, np.asarray(M.forward(M.build(cfg, head), params, tokens, mask))


# Every family left-padded (the sampler's layout); right padding takes the same mask path in
# every family, so two families with different position schemes (RoPE, learned) check it.
_PADDING_CASES = [(c, True) for c in sorted(FAMILY_CASES)] + [("llama", False), ("gpt2", False)]


@pytest.mark.parametrize(
    "case, left",
    _PADDING_CASES,
    ids=[f"{'left' if lp else 'right'}_pad-{c}" for c, lp in _PADDING_CASES],
)
def test_logits_match_transformers(case, left, tmp_path):
    hf_model = make_hf_model(case)
    hf_model.save_pretrained(tmp_path)
    tokens, mask = padded_batch(hf_model.config.vocab_size, left=left)
    expected = hf_outputs(hf_model, tokens, mask)
    _, _, got = _ours(str(tmp_path), tokens, mask)
    np.testing.assert_allclose(got[mask], expected[mask], atol=ATOL, rtol=0)
    assert np.abs(expected[mask]).max() > 0.5  # the comparison is not between near-zeros


_LONG_CASES = [(c, True) for c in ("llama", "mistral", "gemma2", "qwen2_sliding")]


@pytest.mark.parametrize(
    "case, left",
    tiered(_LONG_CASES + [("llama", False)], default=[("llama", True), ("gemma2", True)]),
)
def test_long_rows_match_transformers(case, left, tmp_path):
    """Rows of 200 slots: attention without a cache runs in 3 causal query blocks
    (models/attention.py, ``causal_blocks``), with full, windowed and mixed layers."""
    hf_model = make_hf_model(case)
    hf_model.save_pretrained(tmp_path)
    vocab = hf_model.config.vocab_size
    tokens, mask = padded_batch(vocab, lengths=(200, 131, 40), total=200, left=left)
    expected = hf_outputs(hf_model, tokens, mask)
    _, _, got = _ours(str(tmp_path), tokens, mask)
    np.testing.assert_allclose(got[mask], expected[mask], atol=ATOL, rtol=0)
    assert np.abs(expected[mask]).max() > 0.5


@pytest.mark.parametrize(
    "case", tiered(sorted(FAMILY_CASES), default=["llama", "gpt2", "gemma3", "qwen3_moe"])
)
def test_export_roundtrip_loads_in_transformers(case, tmp_path):
    hf_model = make_hf_model(case, seed=1)
    hf_model.save_pretrained(tmp_path / "in")
    tokens, mask = padded_batch(hf_model.config.vocab_size, seed=1)
    cfg, params, ours = _ours(str(tmp_path / "in"), tokens, mask)
    save_hf(str(tmp_path / "out"), cfg, params)
    _, model_cls = hf_classes(case)
    reloaded = model_cls.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(
        hf_outputs(reloaded, tokens, mask)[mask], ours[mask], atol=ATOL, rtol=0
    )
    # ... and the export imports back to bit-identical params.
    _, params_again = load_hf(str(tmp_path / "out"))
    for a, b in zip(jax_leaves(params), jax_leaves(params_again), strict=True):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    "case",
    tiered(["llama", "gpt2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral"], ["llama", "gpt2"]),
)
def test_scalar_head_matches_sequence_classifier(case, tmp_path):
    hf_model = make_hf_model(case, head="scalar", seed=2)
    hf_model.save_pretrained(tmp_path / "in")
    tokens, mask = padded_batch(hf_model.config.vocab_size, seed=2, left=False)
    expected = hf_outputs(hf_model, tokens, mask)
    cfg, params, values = _ours(str(tmp_path / "in"), tokens, mask, head="scalar")
    np.testing.assert_allclose(values[mask], expected[mask], atol=ATOL, rtol=0)
    # The reward readout is the score at each row's last real token; HF's classifier pools
    # the same position for right-padded rows.
    import torch

    with torch.no_grad():
        pooled = hf_model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        ).logits[:, 0]
    np.testing.assert_allclose(
        np.asarray(M.last_token_values(values, mask)), pooled.numpy(), atol=ATOL, rtol=0
    )
    save_hf(str(tmp_path / "out"), cfg, params, head="scalar")
    _, model_cls = hf_classes(case, "scalar")
    reloaded = model_cls.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(
        hf_outputs(reloaded, tokens, mask)[mask], values[mask], atol=ATOL, rtol=0
    )


# Reading an index and its shard files does not depend on the family: a dense and an MoE
# checkpoint (whose experts are stacked from many tensors) check it.
@pytest.mark.parametrize("case", ["gemma", "qwen3_moe"])
def test_sharded_checkpoint_with_index_loads(case, tmp_path):
    hf_model = make_hf_model(case, seed=3)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    n_files = len(
        set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())
    )
    assert n_files > 2
    tokens, mask = padded_batch(hf_model.config.vocab_size, seed=3)
    _, _, got = _ours(str(tmp_path), tokens, mask)
    np.testing.assert_allclose(
        got[mask], hf_outputs(hf_model, tokens, mask)[mask], atol=ATOL, rtol=0
    )


def test_our_sharded_export_loads_in_transformers(tmp_path):
    hf_model = make_hf_model("llama", seed=4)
    hf_model.save_pretrained(tmp_path / "in")
    cfg, params = load_hf(str(tmp_path / "in"))
    save_hf(str(tmp_path / "out"), cfg, params, max_shard_bytes=30_000)
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
    _, model_cls = hf_classes("llama")
    reloaded = model_cls.from_pretrained(tmp_path / "out").eval()
    tokens, mask = padded_batch(cfg.vocab_size, seed=4)
    np.testing.assert_allclose(
        hf_outputs(reloaded, tokens, mask)[mask],
        hf_outputs(hf_model, tokens, mask)[mask],
        atol=ATOL,
        rtol=0,
    )


def test_critic_from_causal_lm_checkpoint(tmp_path):
    """A causal-LM checkpoint initialises a scalar model when asked; the head starts at 0."""
    hf_model = make_hf_model("qwen2", seed=5)
    hf_model.save_pretrained(tmp_path)
    cfg, params = load_hf(str(tmp_path), head="scalar", init_missing_head=True)
    assert np.all(np.asarray(params["score"]) == 0)
    _, lm_params = load_hf(str(tmp_path))
    np.testing.assert_array_equal(
        np.asarray(params["decoder"]["embed"]["embedding"]),
        np.asarray(lm_params["decoder"]["embed"]["embedding"]),
    )
