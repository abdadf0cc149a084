"""Logical axis vocabulary shared by models, sharding rules and the sampler.

Every parameter and every large activation in jaxrlhf is annotated with these names; a
rule set in ``jaxrlhf.sharding.rules`` maps them to mesh axes. Nothing in ``models/``
mentions a mesh axis.

Parameter axes:
  VOCAB     token vocabulary (embedding rows, LM-head columns)            V
  EMBED     model width / residual stream of a parameter                  D
  HEADS     query heads                                                   N
  KV_HEADS  key/value heads (grouped-query attention)                     K
  HEAD_DIM  per-head width                                                H
  MLP       feed-forward hidden width (of each expert in an MoE layer)     F
  EXPERT    the experts of a mixture-of-experts layer (expert parallelism) E
  LAYERS    stacked decoder layers (scan axis)                            L
  NORM      scale/bias vectors of normalisation layers (tiny; replicated)
  POSITIONS learned absolute position rows (GPT-2)
  SCALAR    the size-1 output of a value/reward head
  LORA_RANK the rank r of a LoRA adapter (models/lora.py; small, replicated)   r

Activation axes (distinct names so activation and parameter layouts can differ):
  BATCH       batch rows                                                  B
  LENGTH      sequence positions                                          T
  ACT_EMBED   residual stream width                                       D
  ACT_HEADS   attention heads of q/k/v activations                        N/K
  ACT_MLP     feed-forward activations                                    F
  ACT_VOCAB   logits over the vocabulary                                  V
  CACHE_BATCH, CACHE_LENGTH, CACHE_HEADS  KV-cache axes (the sampler's own rules)
"""

VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
EXPERT = "expert"
LAYERS = "layers"
NORM = "norm"
POSITIONS = "positions"
SCALAR = "scalar"
LORA_RANK = "lora_rank"

BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"
CACHE_BATCH = "cache_batch"
CACHE_LENGTH = "cache_length"
CACHE_HEADS = "cache_heads"

PARAM_AXES = (
    VOCAB,
    EMBED,
    HEADS,
    KV_HEADS,
    HEAD_DIM,
    MLP,
    EXPERT,
    LAYERS,
    NORM,
    POSITIONS,
    SCALAR,
    LORA_RANK,
)
ACTIVATION_AXES = (
    BATCH,
    LENGTH,
    ACT_EMBED,
    ACT_HEADS,
    ACT_MLP,
    ACT_VOCAB,
    CACHE_BATCH,
    CACHE_LENGTH,
    CACHE_HEADS,
)
ALL_AXES = PARAM_AXES + ACTIVATION_AXES
