"""Direct preference optimisation and its reference-free relatives.

``loss_type`` picks the loss from ``jaxrlhf.losses``:

* ``sigmoid`` (DPO; cDPO with ``label_smoothing``), ``hinge`` (SLiC): summed response
  log-probs against a frozen reference;
* ``ipo``: length-averaged log-probs against the reference (as TRL);
* ``simpo``: length-averaged log-probs, no reference;
* ``orpo``: NLL of the chosen response (mean token log-prob per pair) plus ``beta`` times
  the odds-ratio term, no reference;
* TRL's other paired loss types, on summed log-probs against the reference: ``robust``,
  ``bco_pair`` (baseline: the batch mean of the implicit rewards), ``nca_pair``,
  ``apo_zero``, ``apo_down``, ``exo_pair``, ``sppo_hard``, ``aot``, ``aot_unpaired`` (see
  ``jaxrlhf.losses.preference_variants``). ``f_divergence`` selects f-DPO's divergence.

The reference log-probs are computed once per batch by a separate jitted scoring function
under the reference role's score rules (or once for the whole dataset with
``precompute_reference``) and reach the step as ``batch["reference_logps"] [B, 2]``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxrlhf import losses
from jaxrlhf.models import model as model_lib
from jaxrlhf.train.config import (
    DPO_F_DIVERGENCE_LOSSES,
    DPO_SMOOTHED_LOSSES,
    DPOConfig,
)
from jaxrlhf.train.reward_model import pair_mask
from jaxrlhf.train.steps import Batch, LossAux, Objective, Reference

# TRL loss_type -> loss function with dpo_loss's four log-prob arguments (the names are
# DPO_VARIANT_LOSSES in train/config.py, where the config checks them).
VARIANT_LOSS_FNS = {
    "robust": losses.robust_dpo_loss,
    "bco_pair": losses.bco_pair_loss,
    "nca_pair": losses.nca_pair_loss,
    "apo_zero": losses.apo_zero_loss,
    "apo_down": losses.apo_down_loss,
    "exo_pair": losses.exo_pair_loss,
    "sppo_hard": losses.sppo_hard_loss,
    "aot": losses.aot_loss,
    "aot_unpaired": losses.aot_unpaired_loss,
}


def sequence_logps(module: Any, params: Any, batch: Batch, *, average: bool) -> jax.Array:
    """``[B, 2]`` response log-probs (summed, or per-token mean) of chosen and rejected."""
    b, two, t = batch["tokens"].shape
    tokens = batch["tokens"].reshape(b * two, t)
    logits = model_lib.forward(module, params, tokens, batch["mask"].reshape(b * two, t))
    token_lp = losses.token_logprobs(logits[:, :-1], tokens[:, 1:])
    target_mask = batch["response_mask"].reshape(b * two, t)[:, 1:]
    return losses.sequence_logprobs(token_lp, target_mask, average=average).reshape(b, two)


def loss_fn(cfg: DPOConfig, module: Any, params: Any, batch: Batch) -> tuple[jax.Array, LossAux]:
    logps = sequence_logps(module, params, batch, average=cfg.average_logps)
    real = pair_mask(batch)
    chosen, rejected = logps[:, 0], logps[:, 1]
    if cfg.loss_type == "simpo":
        loss, m = losses.simpo_loss(
            chosen,
            rejected,
            beta=cfg.beta,
            gamma=cfg.simpo_gamma,
            label_smoothing=cfg.label_smoothing,
            pair_mask=real,
        )
    elif cfg.loss_type == "orpo":
        odds_loss, m = losses.orpo_odds_ratio_loss(chosen, rejected, beta=cfg.beta, pair_mask=real)
        loss = -losses.masked_mean(chosen, real) + odds_loss
    else:
        ref = batch["reference_logps"]
        kwargs = {"beta": cfg.beta, "pair_mask": real}
        if cfg.loss_type in DPO_SMOOTHED_LOSSES:
            kwargs["label_smoothing"] = cfg.label_smoothing
        if cfg.loss_type in DPO_F_DIVERGENCE_LOSSES:
            kwargs.update(f_divergence=cfg.f_divergence, f_alpha=cfg.f_alpha)
        if cfg.loss_type in VARIANT_LOSS_FNS:
            fn = VARIANT_LOSS_FNS[cfg.loss_type]
        else:
            fn = functools.partial(losses.dpo_loss, loss_type=cfg.loss_type)
        loss, m = fn(chosen, rejected, ref[:, 0], ref[:, 1], **kwargs)
    return loss, LossAux(
        {
            "loss/dpo": loss,
            "dpo/margin": m["rewards/margin"],
            "dpo/accuracy": m["rewards/accuracy"],
            "dpo/chosen": m["rewards/chosen"],
            "dpo/rejected": m["rewards/rejected"],
            "dpo/logps_chosen": losses.masked_mean(chosen, real),
            "dpo/logps_rejected": losses.masked_mean(rejected, real),
        }
    )


def weight_fn(batch: Batch) -> jax.Array:
    return pair_mask(batch).sum()


def objective(cfg: DPOConfig) -> Objective:
    reference = None
    if cfg.needs_reference:
        reference = Reference(
            logps_fn=functools.partial(sequence_logps, average=cfg.average_logps),
            hf_dir=cfg.reference_hf_dir,
            precompute=cfg.precompute_reference,
        )
    return Objective(
        name="dpo",
        role="policy",
        head="lm",
        data_kind="preference",
        loss_fn=functools.partial(loss_fn, cfg),
        weight_fn=weight_fn,
        primary="loss/dpo",
        summary=("loss/dpo", "dpo/margin", "dpo/accuracy"),
        reference=reference,
    )
