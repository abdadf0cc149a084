"""The initial state of an RL run: the learners' states, the frozen reference, the reward
model and the KL controller, in the shardings of the run's programs (``rl_programs``).

With LoRA (``lora:``) the learners' states hold only their trainable parts; the frozen bases
are returned beside them (:class:`InitialStates`): the policy's base is also the reference,
and a critic initialised from the policy shares the policy's base decoder (the same arrays),
so the pretrained weights are held once whatever the number of roles. A Hydra critic
(``ppo.value.branch_layer``) likewise shares the frozen trunk with the policy and the
reference.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf import losses
from jaxrlhf.config import ConfigError, RunConfig, rl_section
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import load_params
from jaxrlhf.models.hf_config import checkpoint_head, load_hf_config
from jaxrlhf.models.precision import frozen_copy
from jaxrlhf.models.safetensors_io import CheckpointError
from jaxrlhf.sharding.model_sharding import param_shardings
from jaxrlhf.sharding.reshard import reshard
from jaxrlhf.sharding.rules import TRAIN
from jaxrlhf.train.adapters import initial_lora_params
from jaxrlhf.train.hydra_setup import initial_parts
from jaxrlhf.train.model_setup import init_params
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_programs import RLPrograms
from jaxrlhf.train.state import TrainState, init_state

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class InitialStates:
    """What an RL run starts from.

    Attributes:
      policy, value: the learners' TrainStates (value None for GRPO).
      reference: the frozen reference's params (with LoRA: ``policy_frozen`` itself; Hydra:
        the trunk and a copy of the initial policy branch).
      policy_frozen, value_frozen: the learners' frozen parts (LoRA bases, the Hydra trunk),
        else None.
    """

    policy: TrainState
    value: TrainState | None
    reference: Any
    policy_frozen: Any = None
    value_frozen: Any = None


def _value_params(programs: RLPrograms, policy_params: Any) -> Any:
    """The critic's initial parameters: the policy's (or the reward model's) decoder with a
    zero value head."""
    algo, model = programs.algo, programs.model
    value_sh = programs.value_shardings.params
    if algo.critic_init == "reward_model":
        params = load_params(algo.reward.model_dir, model, head="scalar", shardings=value_sh)
        params["score"] = jnp.zeros_like(params["score"])
        return params
    params = {
        "decoder": jax.tree.map(jnp.copy, policy_params["decoder"]),
        "score": jnp.zeros((model.hidden_size, 1), jnp.float32),  # ScalarModel's head dtype
    }
    return jax.device_put(params, value_sh)


def _lora_value(programs: RLPrograms, policy_frozen: Any, key: jax.Array) -> tuple[Any, Any]:
    """``(frozen, trainable)`` of a LoRA critic: the policy's base decoder (shared, not
    copied) or the reward model's, fresh adapters and a zero value head."""
    algo, model, lora = programs.algo, programs.model, programs.value_lora
    if algo.critic_init == "reward_model":
        params = load_params(
            algo.reward.model_dir, model, head="scalar", shardings=lora.plain_shardings
        )
        frozen, _ = lora_lib.split_params(params)
    else:
        frozen = {"decoder": policy_frozen["decoder"]}
        if programs.critic_mesh is not None:  # interleaved: a copy on the critic's devices
            frozen = jax.device_put(frozen, {"decoder": lora.frozen_shardings["decoder"]})
    adapters = model_lib.init_adapters(
        model, lora.spec, key, lora_lib.adapters_only(lora.trainable_shardings)
    )
    score = jax.device_put(
        jnp.zeros((model.hidden_size, 1), jnp.float32), lora.trainable_shardings["score"]
    )
    return frozen, dict(adapters, score=score)


def initial_states(cfg: RunConfig, programs: RLPrograms, key: jax.Array) -> InitialStates:
    """The learners' states and the reference in the programs' shardings; the reference is
    a frozen copy of the initial policy in the compute dtype (``models.precision
    .frozen_copy``: the values its forward reads, in half the bytes of float32 masters for
    bfloat16 compute; with LoRA, the policy's base itself), on the sampler's devices with
    ``placement.reference: sampler`` and on its own group's with ``own`` (moved there from
    a copy in the policy's layout: the learner's devices do not keep it)."""
    if programs.policy_lora is not None:
        return _initial_lora_states(cfg, programs, key)
    if programs.hydra is not None:
        return _initial_hydra_states(cfg, programs, key)
    model = programs.model
    policy_params = init_params(cfg, model, "lm", programs.policy_shardings.params, key)
    if programs.reference_apart is not None:
        ref_params, stats = reshard(
            frozen_copy(policy_params, model), programs.reference_apart_shardings, donate=True
        )
        logger.info(
            "placement.reference: %s: the reference's copy on devices %s (%.1f MiB moved once)",
            cfg.placement.reference,
            [int(d.id) for d in programs.reference_mesh.devices.flat],
            stats.bytes_moved / 2**20,
        )
    else:
        ref_params = jax.jit(lambda p: p, out_shardings=programs.reference_shardings)(
            frozen_copy(policy_params, model)
        )
    value_state = None
    if programs.value is not None:
        value_params = _value_params(programs, policy_params)
        value_state = init_state(value_params, programs.value.optimizer, programs.value_shardings)
    policy_state = init_state(policy_params, programs.policy.optimizer, programs.policy_shardings)
    return InitialStates(policy_state, value_state, ref_params)


def _initial_lora_states(cfg: RunConfig, programs: RLPrograms, key: jax.Array) -> InitialStates:
    frozen, trainable = initial_lora_params(cfg, programs.model, programs.policy_lora, key)
    value_state = value_frozen = None
    if programs.value is not None:
        value_frozen, value_trainable = _lora_value(programs, frozen, jax.random.fold_in(key, 2))
        value_state = init_state(
            value_trainable, programs.value.optimizer, programs.value_shardings
        )
    policy_state = init_state(trainable, programs.policy.optimizer, programs.policy_shardings)
    return InitialStates(policy_state, value_state, frozen, frozen, value_frozen)


def _initial_hydra_states(cfg: RunConfig, programs: RLPrograms, key: jax.Array) -> InitialStates:
    """The trunk (frozen, shared by both learners and the reference), the policy's branch,
    the critic's copy of it with a zero value head, and the reference's frozen copy."""
    hydra, model = programs.hydra, programs.model
    plain_sh = param_shardings(model, programs.mesh, TRAIN)
    params = init_params(cfg, model, "lm", plain_sh, key)
    trunk, policy, value, ref_branch = initial_parts(params, hydra, model.weight_dtype)
    del params
    policy_state = init_state(policy, programs.policy.optimizer, programs.policy_shardings)
    value_state = init_state(value, programs.value.optimizer, programs.value_shardings)
    reference = lora_lib.combine(trunk, ref_branch)
    return InitialStates(policy_state, value_state, reference, trunk, trunk)


def kl_controller(algo: PPOConfig | GRPOConfig) -> losses.AdaptiveKLState | losses.FixedKL:
    """The KL coefficient's controller: adaptive toward ``loss.kl_target``, else fixed."""
    loss = algo.loss
    if loss.kl_target is not None:
        return losses.AdaptiveKLState(loss.kl_coef, loss.kl_target, loss.kl_horizon)
    return losses.FixedKL(loss.kl_coef)


def reward_model_config(cfg: RunConfig, source: str, dtype: str = "float32") -> ModelConfig:
    """The reward model's config, checked to be a reward model (a scalar head); ``source``:
    where ``reward.model_dir`` was set (``config.source_of``), for messages. ``dtype``: the
    run's compute dtype (``model.dtype``); the frozen reward model computes in it and is
    held in it (``param_dtype``: it is never trained, so it needs no float32 masters).

    Raises:
      ConfigError: no readable config.json, or a causal LM given as the reward model.
    """
    field = f"{source}: {cfg.algorithm}.reward.model_dir"
    path = rl_section(cfg).reward.model_dir
    try:
        model = load_hf_config(path, dtype=dtype, param_dtype=dtype)
    except CheckpointError as e:
        raise ConfigError(f"{field}: {e}") from None
    if checkpoint_head(path) == "lm":
        raise ConfigError(
            f"{field}: {path} is a causal LM checkpoint, not a reward model (it has no score "
            "head); train one with algorithm: reward_model (its hf/ export is a "
            "*ForSequenceClassification), or score with reward.function instead"
        )
    return model


def reward_model_params(cfg: RunConfig, model: ModelConfig, shardings: Any, source: str) -> Any:
    """The reward model's params in ``shardings`` (``source`` as in
    :func:`reward_model_config`).

    Raises:
      ConfigError: the checkpoint does not load (one line naming ``reward.model_dir``).
    """
    path = rl_section(cfg).reward.model_dir
    try:
        return load_params(path, model, head="scalar", shardings=shardings)
    except CheckpointError as e:
        raise ConfigError(f"{source}: {cfg.algorithm}.reward.model_dir: {e}") from None
