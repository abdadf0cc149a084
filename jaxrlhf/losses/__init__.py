"""Pure loss and advantage functions over arrays and masks.

Import what you need: ``from jaxrlhf import losses``. This package imports only jax, numpy,
jaxtyping and the standard library (no flax, optax, torch or other jaxrlhf subpackages), so
research code can use it on its own. Conventions (shapes, masks, float32, empty rows) are in
``jaxrlhf.losses.common``; the equations are in ``docs/losses.md``.
"""

from jaxrlhf.losses.advantages import (
    broadcast_sequence_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_rewards,
    whiten_rewards,
)
from jaxrlhf.losses.common import (
    AGGREGATIONS,
    aggregate_loss,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    sequence_logprobs,
    token_logprobs,
)
from jaxrlhf.losses.ilql import (
    ilql_awac_loss,
    ilql_cql_loss,
    ilql_loss,
    ilql_q_loss,
    ilql_value_loss,
)
from jaxrlhf.losses.kl import (
    KL_ESTIMATORS,
    AdaptiveKLState,
    FixedKL,
    kl_controller_update,
    kl_estimate,
    kl_loss,
    kl_penalty,
)
from jaxrlhf.losses.ppo import ppo_policy_loss, ppo_value_loss
from jaxrlhf.losses.preference import (
    DPO_LOSS_TYPES,
    bradley_terry_loss,
    dpo_loss,
    orpo_odds_ratio_loss,
    sft_loss,
    simpo_loss,
)

__all__ = [
    "AGGREGATIONS",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "AdaptiveKLState",
    "FixedKL",
    "aggregate_loss",
    "bradley_terry_loss",
    "broadcast_sequence_advantages",
    "discounted_returns",
    "dpo_loss",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "ilql_awac_loss",
    "ilql_cql_loss",
    "ilql_loss",
    "ilql_q_loss",
    "ilql_value_loss",
    "kl_controller_update",
    "kl_estimate",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "orpo_odds_ratio_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_logprobs",
    "sft_loss",
    "simpo_loss",
    "token_logprobs",
    "token_rewards",
    "whiten_rewards",
]
