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

import dataclasses
import functools
from typing import Any

import jax

from jaxrlhf import losses
from jaxrlhf.models import model as model_lib
from jaxrlhf.train.reward_model import pair_mask
from jaxrlhf.train.steps import Batch, Metrics, Objective, Reference

# TRL loss_type -> loss function with dpo_loss's four log-prob arguments.
_VARIANTS = {
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
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo", *_VARIANTS)
F_DIVERGENCES = losses.F_DIVERGENCES
_REFERENCE_FREE = ("simpo", "orpo")
_SMOOTHED = ("sigmoid", "simpo", "robust", "exo_pair", "aot", "aot_unpaired")
_F_DIVERGENCE = ("sigmoid", "hinge", "robust", "bco_pair", "nca_pair", "exo_pair", "sppo_hard")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """Attributes:
    beta: inverse temperature or reward scale (sigmoid, hinge, simpo and TRL's variants),
      regularisation (ipo) or odds-ratio weight (orpo).
    loss_type: one of ``LOSS_TYPES``.
    label_smoothing: label-flip probability of cDPO (sigmoid), SimPO, robust and AOT; EXO's
      epsilon (exo_pair needs it > 0; the paper uses 1e-3).
    f_divergence: f-DPO's divergence, one of ``F_DIVERGENCES``; other than reverse_kl only
      with loss_type sigmoid, hinge, robust, bco_pair, nca_pair, exo_pair or sppo_hard.
    f_alpha: the alpha of ``alpha_divergence`` (0: reverse KL, 1: forward KL).
    simpo_gamma: SimPO's target margin.
    reference_hf_dir: the reference model's checkpoint; null = frozen copy of the initial
      policy.
    precompute_reference: score all data with the reference before training, then free it.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    f_divergence: str = "reverse_kl"
    f_alpha: float = 0.5
    simpo_gamma: float = 0.5
    reference_hf_dir: str | None = None
    precompute_reference: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type: expected one of {list(LOSS_TYPES)}, got {self.loss_type!r}"
            )
        if not self.beta > 0:
            raise ValueError(f"beta: must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in _SMOOTHED:
            raise ValueError(
                f"label_smoothing: only applies to loss_type {', '.join(_SMOOTHED)}, "
                f"not {self.loss_type!r}"
            )
        if self.loss_type == "exo_pair" and not self.label_smoothing > 0:
            raise ValueError("label_smoothing: exo_pair needs it > 0 (the EXO paper uses 1e-3)")
        if self.f_divergence not in F_DIVERGENCES:
            raise ValueError(
                f"f_divergence: expected one of {list(F_DIVERGENCES)}, got {self.f_divergence!r}"
            )
        if self.f_divergence != "reverse_kl" and self.loss_type not in _F_DIVERGENCE:
            raise ValueError(
                f"f_divergence: only applies to loss_type {', '.join(_F_DIVERGENCE)}, "
                f"not {self.loss_type!r}"
            )

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in _REFERENCE_FREE

    @property
    def average_logps(self) -> bool:
        return self.loss_type in ("ipo", "simpo", "orpo")


def sequence_logps(module: Any, params: Any, batch: Batch, *, average: bool) -> jax.Array:
    """``[B, 2]`` response log-probs (summed, or per-token mean) of chosen and rejected."""
    b, two, t = batch["tokens"].shape
    tokens = batch["tokens"].reshape(b * two, t)
    logits = model_lib.forward(module, params, tokens, batch["mask"].reshape(b * two, t))
    token_lp = losses.token_logprobs(logits[:, :-1], tokens[:, 1:])
    target_mask = batch["response_mask"].reshape(b * two, t)[:, 1:]
    return losses.sequence_logprobs(token_lp, target_mask, average=average).reshape(b, two)


def loss_fn(cfg: DPOConfig, module: Any, params: Any, batch: Batch) -> tuple[jax.Array, Metrics]:
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
        if cfg.loss_type in _SMOOTHED:
            kwargs["label_smoothing"] = cfg.label_smoothing
        if cfg.loss_type in _F_DIVERGENCE:
            kwargs.update(f_divergence=cfg.f_divergence, f_alpha=cfg.f_alpha)
        if cfg.loss_type in _VARIANTS:
            fn = _VARIANTS[cfg.loss_type]
        else:
            fn = functools.partial(losses.dpo_loss, loss_type=cfg.loss_type)
        loss, m = fn(chosen, rejected, ref[:, 0], ref[:, 1], **kwargs)
    return loss, {
        "loss/dpo": loss,
        "dpo/margin": m["rewards/margin"],
        "dpo/accuracy": m["rewards/accuracy"],
        "dpo/chosen": m["rewards/chosen"],
        "dpo/rejected": m["rewards/rejected"],
        "dpo/logps_chosen": losses.masked_mean(chosen, real),
        "dpo/logps_rejected": losses.masked_mean(rejected, real),
    }


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
