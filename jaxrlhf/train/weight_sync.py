"""Getting the policy's weights to the sampler each RL iteration, and what that moves.

Full-weight training reshards the whole policy from its training layout to the sampler's
(``Sampler.to_generate_layout``). A LoRA policy (``lora.sync: adapters``) does less: the
sampler keeps the frozen base weights resident in its own layout (resharded once, when the
run starts) and receives only the adapters each iteration, then merges them on its side
(``W + alpha / r * A B``, one jitted program whose output is in the sampler's layout: every
device folds its own shard, no communication beyond the adapters'). ``lora.sync: full``
merges in the training layout and reshards the merged weights, as without LoRA; both give
the sampler the same merged weights.

The sampler's weights are in the model's compute dtype either way: the merges compute in
float32 and cast once to it (``models.precision.compute_dtype_params``), so a bfloat16
sampler of float32 masters holds, and a full sync moves, half the bytes; the resident base
stays in its stored dtype (merging into a pre-cast base would round twice).

Bytes are counted as in :mod:`jaxrlhf.sharding.reshard`: what arrives on a device that did
not hold it. The price of adapter sync is memory: the resident base copy in the sampler's
layout, beside the training layout's (the two coincide, and share buffers, where the layouts
are equal), and the merged weights while sampling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jaxrlhf.generation import Sampler
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.precision import compute_dtype_params
from jaxrlhf.sharding import ReshardStats, reshard, reshard_bytes
from jaxrlhf.sharding.model_sharding import param_shardings
from jaxrlhf.sharding.rules import GENERATE
from jaxrlhf.train.adapters import LoraLayout


def _merge(frozen: Any, trainable: Any, *, spec: lora_lib.LoraSpec, model: ModelConfig) -> Any:
    return compute_dtype_params(lora_lib.merge(frozen, trainable, spec), model)


@dataclasses.dataclass(frozen=True)
class AdapterSync:
    """A LoRA policy's weights for the sampler (static: shardings and jitted merges).

    Attributes:
      lora: the policy's frozen/trainable layout (training rules).
      sampler: the sampler (its mesh and generate rules).
      mode: ``adapters`` or ``full`` (``lora.sync``).
      adapter_shardings: the adapters in the sampler's layout.
      merge_generate: ``(base, adapters) -> params``, both and the result in the sampler's
        layout.
      merge_train: ``(frozen, trainable) -> params`` in the training layout (``full``).
    """

    lora: LoraLayout
    sampler: Sampler
    mode: str
    adapter_shardings: Any
    merge_generate: Any
    merge_train: Any

    @classmethod
    def build(cls, lora: LoraLayout, sampler: Sampler, mode: str) -> AdapterSync:
        """The sync of ``lora``'s policy to ``sampler`` (which has a mesh)."""
        spec = lora.spec
        _, adapter_sh = lora_lib.split_params(
            param_shardings(sampler.cfg, sampler.mesh, GENERATE, "lm", spec)
        )
        merge = functools.partial(_merge, spec=spec, model=sampler.cfg)
        merge_generate = jax.jit(
            merge,
            in_shardings=(sampler.param_shardings, adapter_sh),
            out_shardings=sampler.param_shardings,
        )
        merge_train = jax.jit(
            merge,
            in_shardings=(lora.frozen_shardings, lora.trainable_shardings),
            out_shardings=lora.frozen_shardings,
        )
        return cls(lora, sampler, mode, adapter_sh, merge_generate, merge_train)

    def resident_base(self, frozen: Any) -> tuple[Any, ReshardStats]:
        """The base in the sampler's layout, kept for the whole run (``adapters`` mode; the
        same buffers where the layouts agree)."""
        return reshard(frozen, self.sampler.param_shardings)

    def generate_params(
        self, frozen: Any, resident: Any, trainable: Any
    ) -> tuple[Any, ReshardStats]:
        """The merged policy in the sampler's layout, and what moved to get it there.

        Args:
          frozen: the base in the training layout.
          resident: the base in the sampler's layout (:meth:`resident_base`; unused in
            ``full`` mode).
          trainable: the adapters in the training layout.
        """
        if self.mode == "adapters":
            adapters, stats = reshard(trainable, self.adapter_shardings)
            return self.merge_generate(resident, adapters), stats
        merged = self.merge_train(frozen, trainable)
        return reshard(merged, self.sampler.param_shardings, donate=True)

    def bytes_per_iteration(self) -> tuple[int, int]:
        """``(adapter sync, full sync)`` bytes moved per iteration, from shapes and
        shardings alone."""
        adapters = reshard_bytes(
            self.lora.trainable_shardings, self.adapter_shardings, self.lora.trainable
        )
        model = self.sampler.cfg
        full = reshard_bytes(
            self.lora.frozen_shardings,
            self.sampler.param_shardings,
            compute_dtype_params(self.lora.frozen, model),
        )
        return adapters, full
