"""The sampler on 8-device CPU meshes equals the sampler on one device.

Parameters start in the training layout and are resharded to the generation layout with
``jax.device_put`` (``Sampler.to_generate_layout``). Greedy tokens must be identical: sharded
matmuls sum in a different order (~1e-6 on these logits), far below the top-token gaps.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.cache import abstract_cache, cache_nbytes
from jaxrlhf.kernels import block_matmul as kernel_lib
from jaxrlhf.sharding import GENERATE, TRAIN, MeshConfig, make_mesh, reshard
from jaxrlhf.sharding.model_sharding import param_shardings
from tests.generation.helpers import prompts, sampler, tiny_cfg, tiny_params
from tests.tiers import tiered

BATCH = ("data", "fsdp")
# n = 2: the shared-prefix cache, split over the batch axes and (kv heads) over "tensor".
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, n=2)


@pytest.mark.parametrize(
    "shape,kernel",
    tiered([((2, 2, 2), True), ((1, 2, 4), True), ((2, 2, 2), False)], [((2, 2, 2), False)]),
    ids=["2x2x2", "1x2x4", "2x2x2-xla-blocks"],
)
def test_sharded_greedy_equals_single_device(shape, kernel, monkeypatch):
    """Greedy tokens of a sampler on a mesh equal one device's, log-probs within 1e-5 (the
    sharded matmuls sum in another order), with the weight blocks multiplied by the CPU
    block-matmul kernel (partitioned per device) and, with it off, by XLA's batched
    matmul."""
    if not kernel:
        monkeypatch.setattr(kernel_lib, "available", lambda: False)
    cfg, host_params = tiny_cfg("llama"), tiny_params("llama")  # 2 kv heads
    tokens, mask = prompts(cfg.vocab_size, seed=11)  # 4 prompts -> 8 rows
    ref = sampler("llama").generate(host_params, tokens, mask, jax.random.key(0), GREEDY)

    mesh = make_mesh(MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]))
    train_params, _ = reshard(host_params, param_shardings(cfg, mesh, TRAIN))
    s = Sampler(cfg, mesh, matmul_block=64)  # weight blocks, whatever this host's cores
    assert s.rules == GENERATE
    # q/k/v and gate/up are fused per tensor shard where their axes split alike (4 heads,
    # 2 kv heads and 64 MLP units two ways); 2 kv heads cannot split four ways, so on the
    # 4-way mesh only gate/up are fused. The LM head's vocab is split over "tensor" too;
    # o and down produce the unsplit hidden axis.
    attn = shape[2] if shape[2] == 2 else None
    expected = {"attn": attn, "mlp": shape[2], "o": 1, "down": 1, "head": shape[2]}
    assert decode_lib.fused_shards(cfg, s.param_shardings) == expected
    with jax.transfer_guard("disallow"):
        params, stats = s.to_generate_layout(train_params)
    assert stats.bytes_moved > 0  # the fsdp-split weights are gathered for generation
    state = s.prefill(params, tokens, mask, jax.random.key(0), GREEDY)

    # The cache: batch over data x fsdp, kv heads over tensor where they divide (2 kv heads
    # cannot be split 4 ways: replicated, with a logged warning).
    heads = "tensor" if shape[2] == 2 else None
    for k in (state.cache.k[0], state.cache.prefix_v[0]):
        assert k.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH, heads, None, None)), 4)
    per_device = s.cache_bytes_per_device(4, 7, GREEDY)
    total = cache_nbytes(abstract_cache(cfg, 4, 7, GREEDY.max_new_tokens, GREEDY.n))
    shards = shape[0] * shape[1] * (shape[2] if heads else 1)
    assert set(per_device.values()) == {total // shards}
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.cache))
    assert held == total // shards

    hlo = s.decode_program(GREEDY.static(), "scan", *tokens.shape)
    hlo = hlo.lower(params, state, GREEDY.arrays()).compile().as_text()
    assert (f'custom_call_target="{kernel_lib.TARGET}"' in hlo) == kernel_lib.available()
    _, out = s.decode(params, state, GREEDY)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(
        np.asarray(out.model_logprobs), np.asarray(ref.model_logprobs), atol=1e-5, rtol=0
    )
    assert out.tokens.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH, None)), 2)


@pytest.mark.parametrize(
    "shape", tiered([(2, 2, 2), (1, 2, 4)], [(2, 2, 2)], single=True), ids=["2x2x2", "1x2x4"]
)
def test_fused_decode_weights_add_no_communication(shape, monkeypatch):
    """Fusing q/k/v and gate/up per tensor shard and cutting the kernels into weight blocks
    within each device's columns (decode.decode_weights) keep each device's slice its own
    heads' rows: the compiled decode program has exactly the collectives of the unfused,
    unblocked one (on 1x2x4 only gate/up are fused; the vocab-split LM head is blocked on
    both meshes)."""
    cfg, host_params = tiny_cfg("llama"), tiny_params("llama")
    tokens, mask = prompts(cfg.vocab_size, seed=11)
    mesh = make_mesh(MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]))

    def collectives(shards_fn):
        monkeypatch.setattr(decode_lib, "fused_shards", shards_fn)
        s = Sampler(cfg, mesh, matmul_block=64)
        params, _ = s.to_generate_layout(host_params)
        state = s.prefill(params, tokens, mask, jax.random.key(0), GREEDY)
        fn = s.decode_program(GREEDY.static(), "scan", tokens.shape[0], tokens.shape[1])
        hlo = fn.lower(params, state, GREEDY.arrays()).compile().as_text()
        ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute")
        return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in ops}

    fused = collectives(decode_lib.fused_shards)
    apart = collectives(lambda cfg, shardings: None)  # None: nothing fused or blocked
    assert fused == apart
    assert fused["all-reduce"] > 0  # the count does see the tensor-parallel reductions


def test_engine_decode_weights_stay_on_their_devices():
    """The rollout engine makes its decode-layout weights once per call in a program of
    their own (Engine.decode_weights_program) and its chunks take them as they come: on a
    2x2x2 mesh that program moves no data between devices, and each device holds no more
    of the weights than of the params (no fused kernel comes out replicated)."""
    from jaxrlhf.generation.engine import Engine
    from jaxrlhf.sharding.model_sharding import bytes_per_device

    cfg, host_params = tiny_cfg("llama"), tiny_params("llama")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    s = Sampler(cfg, mesh, matmul_block=64)
    params, _ = s.to_generate_layout(host_params)
    program = Engine(s, slots=4).decode_weights_program()
    hlo = program.lower(params).compile().as_text()
    ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute")
    assert not [op for op in ops if re.search(rf"= \S+ {op}(?:-start)?\(", hlo)]
    weights = program(params)

    def per_device(tree):
        return bytes_per_device(jax.tree.map(lambda x: x.sharding, tree), tree)

    params_bytes = per_device({"decoder": {"layers": params["decoder"]["layers"]}})
    for device, n in per_device(weights[0]).items():
        assert n <= params_bytes[device]


@pytest.mark.parametrize("family", tiered(["mixtral", "gemma2"], ["mixtral"]))
def test_sharded_greedy_equals_single_device_new_families(family):
    """An MoE with its 4 experts split over fsdp 4 in the generation layout (expert
    parallelism; each device holds one expert's F/2 columns), and Gemma 2's per-layer
    windows and soft-caps, on a 1x4x2 mesh: the same greedy tokens as one device, log-probs
    within 1e-5 (tolerance as above)."""
    cfg, host_params = tiny_cfg(family), tiny_params(family)
    tokens, mask = prompts(cfg.vocab_size, seed=11)
    ref = sampler(family).generate(host_params, tokens, mask, jax.random.key(0), GREEDY)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    s = Sampler(cfg, mesh, matmul_block=64)
    params, _ = s.to_generate_layout(host_params)
    if cfg.num_experts:
        gate = params["decoder"]["layers"]["moe"]["gate_kernel"]  # [L, E, D, F]
        assert gate.sharding.spec == P(None, "fsdp", None, "tensor")
        assert gate.addressable_shards[0].data.shape == (2, 1, 32, 32)
    out = s.generate(params, tokens, mask, jax.random.key(0), GREEDY)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(
        np.asarray(out.model_logprobs), np.asarray(ref.model_logprobs), atol=1e-5, rtol=0
    )
