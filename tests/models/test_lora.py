"""LoRA adapters on the Linen model: the forward against NumPy and against PEFT on the same
Hugging Face weights, the merge, the logical axes and the PEFT file format.

Tolerances: float32 forwards of the same weights in different programs (ours, torch) agree to
~1e-6 relative; logits are O(1), so 1e-4 absolute as in the HF parity tests. Merged kernels
are a float32 sum of two products: 1e-6.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrlhf.models import axes, hf_peft
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import load_hf, save_hf
from jaxrlhf.sharding import GENERATE, TRAIN, MeshConfig, make_mesh
from jaxrlhf.sharding.model_sharding import param_shardings
from tests.models.hf_fixtures import make_hf_model, padded_batch

SPEC = lora_lib.LoraSpec(rank=4, alpha=8.0, targets=lora_lib.TARGETS)


def _random_adapters(cfg, spec, seed=1):
    """Adapters with B != 0 (fresh ones are B = 0, an identity update)."""
    adapters = M.init_adapters(cfg, spec, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    leaves = [
        0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


def test_fresh_adapters_leave_the_model_unchanged_and_a_is_peft_uniform():
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    adapters = M.init_adapters(cfg, SPEC, jax.random.key(1))
    tokens, mask = padded_batch(cfg.vocab_size)
    base = M.forward(M.build(cfg), params, tokens, mask)
    lora = M.forward(M.build(cfg, lora=SPEC), lora_lib.LoraParams(params, adapters), tokens, mask)
    np.testing.assert_array_equal(np.asarray(lora), np.asarray(base))  # B = 0: exactly
    attn = adapters["decoder"]["layers"]["attn"]
    assert not np.asarray(attn["q_lora_b"]).any()
    a = np.asarray(attn["q_lora_a"])  # [L, D, r], uniform in +-1/sqrt(D) (PEFT's kaiming)
    bound = 1 / np.sqrt(cfg.hidden_size)
    assert a.shape == (cfg.num_layers, cfg.hidden_size, 4)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound


def test_lora_forward_equals_numpy_and_the_merged_model():
    """One layer's q projection by hand (x W + alpha/r x A B), and the whole model against its
    merged weights (W + alpha/r A B folded in)."""
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    adapters = _random_adapters(cfg, SPEC)
    tokens, mask = padded_batch(cfg.vocab_size)
    lora_out = M.forward(
        M.build(cfg, lora=SPEC), lora_lib.LoraParams(params, adapters), tokens, mask
    )
    merged = lora_lib.merge(params, adapters, SPEC)
    np.testing.assert_allclose(
        np.asarray(M.forward(M.build(cfg), merged, tokens, mask)), lora_out, atol=1e-4, rtol=0
    )
    # The merged q kernel of layer 1 by NumPy: [D, N, H] + 2 * ([D, r] @ [r, N*H]).
    w = np.asarray(params["decoder"]["layers"]["attn"]["q_kernel"][1], np.float64)
    a = np.asarray(adapters["decoder"]["layers"]["attn"]["q_lora_a"][1], np.float64)
    b = np.asarray(adapters["decoder"]["layers"]["attn"]["q_lora_b"][1], np.float64)
    expected = w + SPEC.scale * (a @ b.reshape(4, -1)).reshape(w.shape)
    got = np.asarray(merged["decoder"]["layers"]["attn"]["q_kernel"][1])
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert set(merged["decoder"]["layers"]["attn"]) == set(params["decoder"]["layers"]["attn"])


def test_dropout_needs_a_key():
    cfg = ModelConfig.tiny()
    spec = lora_lib.LoraSpec(rank=4, alpha=8.0, dropout=0.5, targets=("q", "v"))
    params = M.init_params(cfg, jax.random.key(0))
    adapters = _random_adapters(cfg, spec)
    tokens, mask = padded_batch(cfg.vocab_size)
    module = M.build(cfg, lora=spec)
    plain = M.build(cfg, lora=dataclasses.replace(spec, dropout=0.0))
    without = M.forward(module, lora_lib.LoraParams(params, adapters), tokens, mask)
    reference = M.forward(plain, lora_lib.LoraParams(params, adapters), tokens, mask)
    np.testing.assert_array_equal(np.asarray(without), np.asarray(reference))
    key = jax.random.key(3)
    with_key = M.forward(module, lora_lib.LoraParams(params, adapters, key), tokens, mask)
    again = M.forward(module, lora_lib.LoraParams(params, adapters, key), tokens, mask)
    assert np.abs(np.asarray(with_key) - np.asarray(without)).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(with_key), np.asarray(again))


def test_split_and_combine_are_inverse():
    cfg = ModelConfig.tiny()
    tree = M.abstract_params(cfg, "scalar", SPEC)
    frozen, trainable = lora_lib.split_params(tree)
    plain = M.abstract_params(cfg, "scalar")
    assert frozen == {"decoder": plain["decoder"]}
    assert set(trainable) == {"decoder", "score"}
    names = {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(trainable)}
    assert names == {f"{t}_lora_{x}" for t in lora_lib.TARGETS for x in "ab"} | {"score"}
    assert jax.tree.structure(lora_lib.combine(frozen, trainable)) == jax.tree.structure(tree)
    assert jax.tree.structure(lora_lib.combine(frozen, {"score": trainable["score"]})) == (
        jax.tree.structure(plain)
    )


def test_adapters_carry_logical_axes_and_follow_the_rule_sets():
    cfg = ModelConfig.tiny()
    specs = M.logical_specs(cfg, "lm", SPEC)["decoder"]["layers"]
    L, D, R = axes.LAYERS, axes.EMBED, axes.LORA_RANK
    assert tuple(specs["attn"]["q_lora_a"]) == (L, D, R)
    assert tuple(specs["attn"]["q_lora_b"]) == (L, R, axes.HEADS, axes.HEAD_DIM)
    assert tuple(specs["attn"]["o_lora_a"]) == (L, axes.HEADS, axes.HEAD_DIM, R)
    assert tuple(specs["mlp"]["down_lora_a"]) == (L, axes.MLP, R)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    train = param_shardings(cfg, mesh, TRAIN, "lm", SPEC)["decoder"]["layers"]
    generate = param_shardings(cfg, mesh, GENERATE, "lm", SPEC)["decoder"]["layers"]
    P = jax.sharding.PartitionSpec
    assert train["attn"]["q_lora_a"].spec == P(None, "fsdp", None)  # like the kernel's D
    assert train["attn"]["q_lora_b"].spec == P(None, None, "tensor", None)  # like its heads
    assert train["mlp"]["down_lora_a"].spec == P(None, "tensor", None)
    assert generate["attn"]["q_lora_a"].spec == P(None, None, None)  # no fsdp in decode
    assert generate["mlp"]["up_lora_b"].spec == P(None, None, "tensor")


# ---- PEFT ----------------------------------------------------------------------------------


def _hf_base(tmp_path, case="llama"):
    """A random HF base model saved to ``tmp_path/base``, loaded back as ours."""
    model = make_hf_model(case)
    base_dir = str(tmp_path / "base")
    model.save_pretrained(base_dir)
    cfg, params = load_hf(base_dir)
    return model, base_dir, cfg, params


@pytest.mark.parametrize("case", ["llama", "gemma", "qwen2"])
def test_peft_loads_the_adapter_onto_the_base_with_equal_logits(tmp_path, case):
    pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import torch

    hf, base_dir, cfg, params = _hf_base(tmp_path, case)
    adapters = _random_adapters(cfg, SPEC)
    out = str(tmp_path / "adapter")
    hf_peft.save_peft_adapter(out, cfg, adapters, SPEC, base_model=base_dir)
    tokens, mask = padded_batch(cfg.vocab_size, left=False)
    ours = M.forward(M.build(cfg, lora=SPEC), lora_lib.LoraParams(params, adapters), tokens, mask)
    peft_model = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        ref = peft_model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        ).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours)[mask], ref[mask], atol=1e-4, rtol=0)
    base = M.forward(M.build(cfg), params, tokens, mask)
    assert np.abs(np.asarray(base) - np.asarray(ours))[mask].max() > 1e-2  # adapters matter


def test_peft_files_follow_the_documented_format(tmp_path):
    """Without peft: the keys, shapes and config fields PEFT documents, and the update
    ``W + lora_alpha / r * B A`` (PEFT's LoraLayer math, in torch's [out, in] layout)
    equals our merged export's weight for every adapted module."""
    cfg = ModelConfig.tiny()
    spec = lora_lib.LoraSpec(rank=4, alpha=8.0, targets=("q", "o", "down"))
    params = M.init_params(cfg, jax.random.key(0))
    adapters = _random_adapters(cfg, spec)
    out, base_dir, merged_dir = (str(tmp_path / d) for d in ("adapter", "base", "merged"))
    hf_peft.save_peft_adapter(out, cfg, adapters, spec, base_model="some/base")
    save_hf(base_dir, cfg, params)
    save_hf(merged_dir, cfg, lora_lib.merge(params, adapters, spec))
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj"]
    assert config["base_model_name_or_path"] == "some/base"
    assert config["bias"] == "none" and config["fan_in_fan_out"] is False
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert len(tensors) == 2 * 3 * cfg.num_layers
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    merged = load_file(os.path.join(merged_dir, "model.safetensors"))
    for i in range(cfg.num_layers):
        for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{module}"
            a = tensors[f"base_model.model.{name}.lora_A.weight"]
            b = tensors[f"base_model.model.{name}.lora_B.weight"]
            w = base[f"{name}.weight"]
            assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)
            expected = w.astype(np.float64) + 2.0 * b.astype(np.float64) @ a
            np.testing.assert_allclose(merged[f"{name}.weight"], expected, atol=1e-6, rtol=0)


def test_peft_sequence_classifier_saves_the_score_head(tmp_path):
    cfg = ModelConfig.tiny()
    spec = lora_lib.LoraSpec(rank=2, alpha=2.0, targets=("v",))
    _, trainable = lora_lib.split_params(M.init_params(cfg, jax.random.key(0), head="scalar"))
    trainable = dict(_random_adapters(cfg, spec), score=trainable["score"] + 1.0)
    out = str(tmp_path / "adapter")
    hf_peft.save_peft_adapter(out, cfg, trainable, spec, head="scalar")
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    np.testing.assert_array_equal(
        tensors["base_model.model.score.weight"], np.asarray(trainable["score"]).T
    )


def test_fused_projections_are_refused_with_the_field():
    phi3 = ModelConfig.tiny("phi3")
    with pytest.raises(ValueError, match=r"^lora.targets: 'q' is part of .*qkv_proj"):
        hf_peft.peft_module_names(phi3, lora_lib.LoraSpec(rank=2, alpha=2.0, targets=("q",)))
    names = hf_peft.peft_module_names(phi3, lora_lib.LoraSpec(rank=2, alpha=2.0, targets=("o",)))
    assert names == {"o": "model.layers.{i}.self_attn.o_proj"}


def test_lora_spec_checks():
    with pytest.raises(ValueError, match="^rank: "):
        lora_lib.LoraSpec(rank=0, alpha=1.0)
    with pytest.raises(ValueError, match="^targets: "):
        lora_lib.LoraSpec(rank=2, alpha=1.0, targets=("qkv",))


def test_jit_and_eager_lora_forward_agree():
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    adapters = _random_adapters(cfg, SPEC)
    tokens, mask = padded_batch(cfg.vocab_size)
    module = M.build(cfg, lora=SPEC)

    def fn(p, a):
        return M.forward(module, lora_lib.LoraParams(p, a), jnp.asarray(tokens), mask)

    np.testing.assert_allclose(jax.jit(fn)(params, adapters), fn(params, adapters), atol=1e-5)
