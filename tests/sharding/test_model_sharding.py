"""The model on an 8-device CPU mesh equals the model on one device.

Tolerances: sharded matmuls and reductions sum in a different order than the single-device
program, and the order also depends on the vector width XLA's CPU code uses on the machine.
In float32 with logits up to ~7 in size that is a few ulps of the largest logit: we use 2e-5
absolute on losses/logits (an Intel Emerald Rapids VM measured 1.02e-5 on one Mixtral logit,
expert-parallel over 4 devices), and atol 1e-6 + rtol 1e-4 on gradients (many are ~1e-4 in
size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.losses import token_logprobs
from jaxrlhf.models import axes
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.sharding import GENERATE, TRAIN, MeshConfig, activation_sharding, make_mesh, reshard
from jaxrlhf.sharding.model_sharding import build_sharded, bytes_per_device, param_shardings
from tests.tiers import tiered

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]


def _cfg(family="llama"):
    return ModelConfig.tiny(family, initializer_range=0.3)


def _batch(cfg, seed=0, batch=8, length=8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, cfg.vocab_size, (batch, length)).astype(np.int32)
    lengths = rng.integers(3, length + 1, batch)
    mask = np.arange(length)[None] >= (length - lengths)[:, None]  # left padded
    return np.where(mask, tokens, 0).astype(np.int32), mask


def _loss(module, params, tokens, mask):
    logits = M.forward(module, params, tokens, mask)
    logp = token_logprobs(logits[:, :-1], tokens[:, 1:])
    target_mask = mask[:, 1:] & mask[:, :-1]
    return -(logp * target_mask).sum() / target_mask.sum()


def _sgd_step(module, params, tokens, mask):
    loss, grads = jax.value_and_grad(functools.partial(_loss, module))(params, tokens, mask)
    new_params = optax.apply_updates(params, jax.tree.map(lambda g: -0.5 * g, grads))
    return new_params, loss, grads


def _mesh(shape):
    return make_mesh(MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]))


@pytest.mark.parametrize(
    "family, mesh_shape",
    # 8 devices == 1: every mesh shape for llama and one per family in the full tier; the
    # default tier keeps the data x fsdp x tensor mesh (tests/generation/test_sharded.py's
    # default case keeps an MoE's experts split over fsdp).
    tiered(
        [("llama", m) for m in MESHES]
        + [("gpt2", (2, 2, 2)), ("qwen3", (2, 2, 2)), ("gemma2", (1, 4, 2))]
        + [("gemma3", (2, 2, 2)), ("phi3", (2, 2, 2)), ("mixtral", (1, 4, 2))]
        + [("qwen3_moe", (2, 2, 2))],
        default=[("llama", (2, 2, 2))],
    ),
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x,
)
def test_sharded_forward_and_step_equal_single_device(family, mesh_shape):
    """Forward and one SGD step; for the MoEs with experts split over fsdp (expert
    parallelism: 4 experts on 4 or 2 fsdp devices)."""
    cfg = _cfg(family)
    tokens, mask = _batch(cfg)
    params = M.init_params(cfg, jax.random.key(0))
    module = M.build(cfg)
    ref_logits = jax.jit(functools.partial(M.forward, module))(params, tokens, mask)
    ref_params, ref_loss, ref_grads = jax.jit(functools.partial(_sgd_step, module))(
        params, tokens, mask
    )

    mesh = _mesh(mesh_shape)
    shardings = param_shardings(cfg, mesh, TRAIN)
    sharded_params = M.init_params(cfg, jax.random.key(0), shardings=shardings)
    # Initialised directly sharded, with exactly the single-device values.
    jax.tree.map(np.testing.assert_array_equal, sharded_params, params)
    batch_sharding = activation_sharding(mesh, TRAIN, (axes.BATCH, axes.LENGTH))
    tokens_s, mask_s = jax.device_put((tokens, mask), batch_sharding)
    sharded_module = build_sharded(cfg, mesh, TRAIN)

    logits = jax.jit(functools.partial(M.forward, sharded_module))(sharded_params, tokens_s, mask_s)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=0)

    step = jax.jit(
        functools.partial(_sgd_step, sharded_module),
        in_shardings=(shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, None, shardings),
        donate_argnums=0,
    )
    old_leaf = jax.tree.leaves(sharded_params)[0]
    new_params, loss, grads = step(sharded_params, tokens_s, mask_s)
    assert old_leaf.is_deleted()  # the state was donated to the step
    np.testing.assert_allclose(loss, ref_loss, atol=2e-5, rtol=0)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), grads, ref_grads
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), new_params, ref_params
    )
    for leaf, sharding in zip(jax.tree.leaves(new_params), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    if cfg.num_experts:
        gate = new_params["decoder"]["layers"]["moe"]["gate_kernel"]  # [L, E, D, F]
        assert gate.sharding.spec == P(None, "fsdp", None, "tensor")


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_train_rules_split_param_bytes_evenly(mesh_shape):
    """Each device holds exactly total / shard-count bytes of every param under TRAIN."""
    cfg = _cfg()
    mesh = _mesh(mesh_shape)
    shardings = param_shardings(cfg, mesh, TRAIN)
    params = M.init_params(cfg, jax.random.key(0), shardings=shardings)
    sizes = dict(mesh.shape)
    expected_per_device = 0
    for leaf in jax.tree.leaves(params):
        n_shards = int(
            np.prod(
                [
                    sizes[a]
                    for entry in leaf.sharding.spec
                    if entry
                    for a in ((entry,) if isinstance(entry, str) else entry)
                ]
            )
        )
        for shard in leaf.addressable_shards:
            assert shard.data.nbytes * n_shards == leaf.nbytes
        expected_per_device += leaf.nbytes // n_shards
    per_device = bytes_per_device(shardings, M.abstract_params(cfg))
    assert set(per_device.values()) == {expected_per_device}
    # Big matrices really are split: the q kernel is split over fsdp x tensor.
    q = params["decoder"]["layers"]["attn"]["q_kernel"]
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp", "tensor", None)), 4)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if mesh_shape == (2, 2, 2):
        assert expected_per_device < total / 3


def test_reshard_train_generate_train_is_exact():
    cfg = _cfg()
    mesh = _mesh((1, 4, 2))
    train_sh = param_shardings(cfg, mesh, TRAIN)
    gen_sh = param_shardings(cfg, mesh, GENERATE)
    params = M.init_params(cfg, jax.random.key(1), shardings=train_sh)
    host = jax.device_get(params)
    with jax.transfer_guard("disallow"):
        gen, to_gen = reshard(params, gen_sh)
        back, to_train = reshard(gen, train_sh)
    emb = gen["decoder"]["embed"]["embedding"]
    assert emb.sharding.spec == P("tensor", None)  # no fsdp split while generating
    assert to_gen.bytes_moved > 0 and to_train.bytes_moved == 0  # train slices are subsets
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(gen), host)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), host)


def test_generate_layout_forward_equals_train_layout():
    cfg = _cfg()
    mesh = _mesh((2, 2, 2))
    tokens, mask = _batch(cfg, seed=3)
    params = M.init_params(cfg, jax.random.key(2), shardings=param_shardings(cfg, mesh, TRAIN))
    gen_params, _ = reshard(params, param_shardings(cfg, mesh, GENERATE))
    out = {}
    for name, rules, p in (("train", TRAIN, params), ("generate", GENERATE, gen_params)):
        module = build_sharded(cfg, mesh, rules)
        batch = jax.device_put((tokens, mask), activation_sharding(mesh, rules, ("batch", None)))
        out[name] = jax.jit(functools.partial(M.forward, module))(p, *batch)
    np.testing.assert_allclose(out["generate"], out["train"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", tiered(["qwen2", "qwen3_moe"], ["qwen3_moe"]))
def test_hf_checkpoint_loads_straight_into_shards(case, tmp_path, monkeypatch):
    """Each device reads its shards only: with 4 experts over fsdp 4 (and their width over
    tensor 2), every expert's tensor is read by the 2 devices holding it, not by all 8."""
    pytest.importorskip("torch")
    from jaxrlhf.models import safetensors_io
    from jaxrlhf.models.hf_checkpoint import load_hf
    from tests.models.hf_fixtures import hf_outputs, make_hf_model, padded_batch

    hf_model = make_hf_model(case, seed=7)
    hf_model.save_pretrained(tmp_path)
    mesh = _mesh((2, 2, 2) if case == "qwen2" else (1, 4, 2))
    from jaxrlhf.models.hf_config import load_hf_config

    reads: list[str] = []
    get = safetensors_io.SafetensorsReader.get
    monkeypatch.setattr(
        safetensors_io.SafetensorsReader,
        "get",
        lambda self, key: reads.append(key) or get(self, key),
    )
    cfg = load_hf_config(str(tmp_path))
    shardings = param_shardings(cfg, mesh, TRAIN)
    _, params = load_hf(str(tmp_path), shardings=shardings)
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding == sharding
    if cfg.num_experts:
        for j in range(cfg.num_experts):
            assert reads.count(f"model.layers.1.mlp.experts.{j}.up_proj.weight") == 2
    tokens, mask = padded_batch(cfg.vocab_size, seed=7, lengths=(12, 9, 5, 12), total=12)
    module = build_sharded(cfg, mesh, TRAIN)
    batch = jax.device_put((tokens, mask), NamedSharding(mesh, P(("data", "fsdp"))))
    got = np.asarray(jax.jit(functools.partial(M.forward, module))(params, *batch))
    np.testing.assert_allclose(
        got[mask], hf_outputs(hf_model, tokens, mask)[mask], atol=1e-4, rtol=0
    )


@pytest.mark.slow
def test_scalar_model_sharded_equals_single_device():
    cfg = _cfg("gemma")
    tokens, mask = _batch(cfg, seed=4)
    params = M.init_params(cfg, jax.random.key(3), head="scalar")
    ref = M.last_token_values(M.forward(M.build(cfg, "scalar"), params, tokens, mask), mask)
    mesh = _mesh((2, 2, 2))
    shardings = param_shardings(cfg, mesh, TRAIN, head="scalar")
    sharded = jax.device_put(params, shardings)
    module = build_sharded(cfg, mesh, TRAIN, head="scalar")
    got = jax.jit(lambda p, t, m: M.last_token_values(M.forward(module, p, t, m), m))(
        sharded, tokens, jnp.asarray(mask)
    )
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
