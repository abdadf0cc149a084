"""The same train steps on an 8-device CPU mesh equal those on 1 device, for each trainer.

Both runs see the same batches from the same initial params. The 8-device runs shard the
params (FSDP, and tensor parallelism for the RM and DPO cases) and the batch, and for SFT
also accumulate over a different number of micro-batches (2 on 8 devices, 4 on 1), which
the weighted accumulation makes mathematically identical.

Tolerances (float32): sharded matmuls and reductions sum in a different order, which moves
the metrics by <= 2e-6 (DPO's summed log-probs are ~50 in size, so that is ~4e-8 relative);
we allow 1e-5 absolute. Params after two AdamW updates at lr 1e-3 differ by a few 1e-6:
Adam's update lr * g / (|g| + eps) moves by up to lr / eps per unit of gradient rounding
where g is near 0, so the runs use eps = 1e-6 instead of the default 1e-8 (max difference
measured on an AMD EPYC Zen 4 VM: 3.1e-6 with eps 1e-6, 6.7e-6 with 1e-8; earlier VMs 4.7e-6
with 1e-8). We allow 2e-5, still 50x below one update (~1e-3), so a wrong gradient, a
dropped micro-batch or a wrong weighting fails.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.train import loop
from tests.train.helpers import config, mesh

pytestmark = pytest.mark.slow

COMMON = (
    "train.batch_size=16",
    "train.steps=10",
    "optimizer.warmup_steps=0",
    "optimizer.lr=1e-3",
    "optimizer.eps=1e-6",
    "data.builtin_size=256",
    "data.eval_size=16",
)
CASES = {
    # name: (8-device mesh, overrides on 8 devices, overrides on 1 device)
    "tiny_sft": ((2, 4, 1), ["train.micro_batch_size=1"], ["train.micro_batch_size=4"]),
    "tiny_rm": ((2, 2, 2), [], []),
    "tiny_dpo": ((1, 4, 2), [], []),
}


def _mesh_overrides(shape):
    return [f"mesh.data={shape[0]}", f"mesh.fsdp={shape[1]}", f"mesh.tensor={shape[2]}"]


def _two_steps(trainer):
    metrics = []
    for _ in range(2):
        old = jax.tree.leaves(trainer.state.params)[0]
        metrics.append(jax.device_get(trainer.step().metrics))
        assert old.is_deleted()  # the state was donated to the step
    return metrics


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_step_equals_single_device(name, tmp_path):
    shape, many_overrides, one_overrides = CASES[name]
    many_cfg = config(name, tmp_path, *COMMON, *_mesh_overrides(shape), *many_overrides)
    one_cfg = config(
        name, tmp_path, *COMMON, *_mesh_overrides((1, 1, 1)), *one_overrides, device_count=1
    )
    many = loop.build_trainer(many_cfg, mesh=mesh(*shape))
    one = loop.build_trainer(one_cfg, mesh=mesh(1, 1, 1))
    if name == "tiny_sft":
        assert (many.num_micro, one.num_micro) == (2, 4)
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(many.state.params),
        jax.device_get(one.state.params),
    )

    many_metrics, one_metrics = _two_steps(many), _two_steps(one)
    for got, want in zip(many_metrics, one_metrics, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=0),
        jax.device_get(many.state.params),
        jax.device_get(one.state.params),
    )
    # The new state stays in the training layout: params and Adam moments sharded alike.
    for leaf, sharding in zip(
        jax.tree.leaves(many.state), jax.tree.leaves(many.programs.state_shardings), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    q = many.state.params["decoder"]["layers"]["attn"]["q_kernel"]
    assert "fsdp" in str(q.sharding.spec)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.size < q.size


def test_a_mesh_passed_in_decides_the_micro_batches(tmp_path):
    """``build_trainer(cfg, mesh=...)``: the sizes come from the mesh passed in, not from
    ``cfg.mesh`` over as many devices. 16 rows, micro_batch_size 2: a (2, 2, 2) mesh has 4
    data shards, so 16 / (2 x 4) = 2 micro-batches (cfg.mesh fsdp=-1 over 8 would give 1)."""
    cfg = config("tiny_sft", tmp_path, *COMMON, "train.micro_batch_size=2")
    trainer = loop.build_trainer(cfg, mesh=mesh(2, 2, 2))
    assert trainer.num_micro == 2 and trainer.layout.mesh_shape == (2, 2, 2)
