"""The sampler's weights in the compute dtype, cast once per weight sync.

A tiny Llama with float32 masters and bfloat16 compute, trained layout on a 2 x 2 x 2 mesh:
``Sampler.to_generate_layout`` casts the weights the model casts at use to bfloat16 before
resharding them, keeps the norm scales (read in float32) as they are, and moves half the
bytes. Its samples and log-probs equal, bitwise, those of float32 masters resharded as they
are and cast inside every decode matmul: the matmuls read the same bfloat16 values either
way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.precision import compute_dtype_params, frozen_copy, needs_cast
from jaxrlhf.sharding import TRAIN, MeshConfig, make_mesh, reshard, reshard_bytes
from jaxrlhf.sharding.model_sharding import param_shardings
from tests.generation.helpers import prompts, tiny_cfg, tiny_params


def _names(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _convert_ops(sampler: Sampler, params, state, sampling: SamplingParams) -> int:
    program = sampler.decode_program(sampling.static(), "scan", *state.prefix_mask.shape)
    return program.lower(params, state, sampling.arrays()).as_text().count("stablehlo.convert")


def _layouts() -> tuple:
    """``(cfg, sampler, train, train shardings)``: float32 masters of a bfloat16-compute
    tiny Llama in the training layout of a 2 x 2 x 2 mesh, and its sampler."""
    cfg = tiny_cfg("llama").replace(dtype="bfloat16")  # param_dtype float32
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    train_sh = param_shardings(cfg, mesh, TRAIN)
    train, _ = reshard(tiny_params("llama"), train_sh)
    return cfg, Sampler(cfg, mesh), train, train_sh


def test_to_generate_layout_casts_once_and_moves_half_the_bytes():
    """The cast copy has the sampler's shardings, bfloat16 kernels, embedding and head, and
    float32 norm scales; its reshard moves exactly half the bytes of the masters' (the norm
    scales are replicated in both layouts: they do not move), as ``reshard_bytes`` of the
    compute-dtype layout says; nothing crosses the host."""
    cfg, sampler, train, train_sh = _layouts()
    _, master_stats = reshard(train, sampler.param_shardings)
    with jax.transfer_guard("disallow"):
        once, stats = sampler.to_generate_layout(train)
    flat_sh = _names(sampler.param_shardings)
    for name, leaf in _names(once).items():
        want = jnp.float32 if name.endswith("['scale']") else jnp.bfloat16
        assert leaf.dtype == want, name
        assert leaf.sharding.is_equivalent_to(flat_sh[name], leaf.ndim), name
    norms = {k: v for k, v in _names(train).items() if k.endswith("['scale']")}
    norm_moved = reshard_bytes(
        {k: v.sharding for k, v in norms.items()},
        {k: flat_sh[k] for k in norms},
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in norms.items()},
    )
    assert norm_moved == 0 and norms
    assert stats.bytes_moved * 2 == master_stats.bytes_moved > 0
    abstract = compute_dtype_params(model_lib.abstract_params(cfg), cfg)
    assert stats.bytes_moved == reshard_bytes(train_sh, sampler.param_shardings, abstract)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(train))  # not donated


@pytest.mark.slow
def test_cast_once_samples_equal_the_per_matmul_cast():
    """Greedy and sampled (temperature 1, same key) decodes of the cast-once weights and of
    the float32 masters resharded as they are (cast inside every decode matmul): tokens,
    log-probs under the sampling distribution and under the model all equal bitwise (the
    matmuls read the same bfloat16 values; measured equal, so no tolerance). The decode
    program of the cast weights converts fewer arrays. ~30 s of compiles."""
    cfg, sampler, train, _ = _layouts()
    per_matmul, _ = reshard(train, sampler.param_shardings)
    once, _ = sampler.to_generate_layout(train)
    tokens, mask = prompts(cfg.vocab_size, seed=11)  # 4 prompts, n = 2: 8 rows
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=8, n=2)
        want = sampler.generate(per_matmul, tokens, mask, jax.random.key(3), sampling)
        got = sampler.generate(once, tokens, mask, jax.random.key(3), sampling)
        for field in ("tokens", "logprobs", "model_logprobs", "response_mask"):
            a, b = np.asarray(getattr(want, field)), np.asarray(getattr(got, field))
            np.testing.assert_array_equal(b, a, err_msg=f"{field}, temperature {temperature}")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, n=2)
    state = sampler.prefill(once, tokens, mask, jax.random.key(0), greedy)
    assert _convert_ops(sampler, once, state, greedy) < _convert_ops(
        sampler, per_matmul, state, greedy
    )


def test_frozen_bf16_weights_are_resharded_as_they_are():
    """A model stored in its compute dtype (a frozen bfloat16 role) needs no cast: the
    sampler reshards it unchanged, as before."""
    cfg = tiny_cfg("llama").replace(dtype="bfloat16", param_dtype="bfloat16")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    host = frozen_copy(tiny_params("llama"), cfg)
    assert not needs_cast(host, cfg)
    train, _ = reshard(host, param_shardings(cfg, mesh, TRAIN))
    sampler = Sampler(cfg, mesh)
    want, want_stats = reshard(train, sampler.param_shardings)
    got, stats = sampler.to_generate_layout(train)
    assert stats.bytes_moved == want_stats.bytes_moved
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_frozen_copy_keeps_norms_and_casts_the_rest(family):
    """``frozen_copy``: fresh arrays; kernels, embeddings and biases in the compute dtype
    (their exact bfloat16 roundings), norm scales and biases (read in float32) unchanged."""
    cfg = tiny_cfg(family).replace(dtype="bfloat16")
    params = tiny_params(family)
    copy = frozen_copy(params, cfg)
    for (name, x), y in zip(_names(params).items(), jax.tree.leaves(copy), strict=True):
        assert y is not x
        norm = "norm']" in name
        assert y.dtype == (jnp.float32 if norm else jnp.bfloat16), name
        np.testing.assert_array_equal(y, x if norm else x.astype(jnp.bfloat16), err_msg=name)
