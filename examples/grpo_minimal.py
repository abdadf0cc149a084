"""GRPO from jaxrlhf's public pieces, without the trainer (in the spirit of PureJaxRL).

Sampler -> reward function -> reference scoring -> group advantages -> clipped-surrogate update,
on the built-in ``sort`` task with a tiny random Llama on one device (no mesh). Run it:

    python examples/grpo_minimal.py   # ~1 minute on a laptop CPU; prints the task reward rising
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import losses
from jaxrlhf.data import CharTokenizer, builtin_records
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.rewards import builtin_reward_fn, call_reward_fn
from jaxrlhf.train.config import OptimizerConfig
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.rl_config import GRPOLossConfig
from jaxrlhf.train.rl_steps import policy_objective, rl_update
from jaxrlhf.train.rl_types import LearnerBatch
from jaxrlhf.train.state import create_state
from jaxrlhf.train.steps import Learner

PROMPTS, GROUP, NEW_TOKENS, PROMPT_LEN = 8, 4, 8, 16


def prompt_batch(tok, records):
    """Left-padded prompt ids [B, P] and mask, and each record's answer."""
    ids = [[tok.bos_id, *tok.encode(r["prompt"])] for r in records]
    tokens = np.array([[tok.pad_id] * (PROMPT_LEN - len(i)) + i for i in ids], np.int32)
    return tokens, tokens != tok.pad_id, [r["answer"] for r in records]


def train(iterations: int = 60, seed: int = 0) -> list[float]:
    """Runs GRPO; returns the mean task reward of every iteration."""
    tok = CharTokenizer()
    cfg = ModelConfig.tiny(hidden_size=64, intermediate_size=128, pad_token_id=tok.pad_id)
    module = model_lib.build(cfg)
    params = model_lib.init_params(cfg, jax.random.key(seed))
    reference = jax.tree.map(jnp.copy, params)  # frozen: the KL anchors to the start
    sampler = Sampler(cfg)  # no mesh: the default device
    sampling = SamplingParams(
        max_new_tokens=NEW_TOKENS, n=GROUP, stop_token_ids=(tok.eos_id,), pad_token_id=tok.pad_id
    )
    loss_cfg = GRPOLossConfig(clip_high=0.28)  # k3 KL loss term, beta 0.04
    forward = RolloutForward(module, NEW_TOKENS)  # rows [prompt | response], unpacked
    optimizer, lr_fn = make_optimizer(OptimizerConfig(lr=3e-3, schedule="constant"), iterations)
    learner = Learner(policy_objective(loss_cfg), forward, optimizer, lr_fn)
    state = create_state(params, optimizer)
    update = jax.jit(
        lambda s, b, k: rl_update(
            (s,), b, k, learners=(learner,), epochs=1, num_minibatches=1, num_micro=1, mesh=None
        )
    )
    ref_logprobs = jax.jit(lambda p, t, m: forward.logprobs(p, t, m)[0])
    reward_fn = builtin_reward_fn("sort")
    records = builtin_records("sort", "prompt", PROMPTS * iterations, seed=seed)
    key, history = jax.random.key(seed + 1), []
    for i in range(iterations):
        sample_key, update_key = jax.random.split(jax.random.fold_in(key, i))
        tokens, mask, answers = prompt_batch(tok, records[i * PROMPTS : (i + 1) * PROMPTS])
        out = jax.device_get(sampler.generate(state.params, tokens, mask, sample_key, sampling))
        completions = [tok.decode(t[m]) for t, m in zip(out.tokens, out.response_mask, strict=True)]
        prompts = [
            tok.decode(t[m]) for t, m in zip(out.prompt_tokens, out.prompt_mask, strict=True)
        ]
        scores = call_reward_fn(
            reward_fn, prompts, completions, columns={"answer": np.repeat(answers, GROUP)}
        )
        rows = np.concatenate([out.prompt_tokens, out.tokens], 1)
        row_mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
        response_mask = np.concatenate([np.zeros_like(out.prompt_mask), out.response_mask], 1)
        per_seq = losses.grpo_advantages(jnp.asarray(scores), group_size=GROUP)
        batch = LearnerBatch(
            tokens=rows,
            mask=row_mask,
            response_mask=response_mask,
            kl_coef=jnp.full(len(rows), loss_cfg.kl_coef),
            ref_logprobs=ref_logprobs(reference, rows, row_mask),
            # old log-probs from the update's own forward (one update per rollout: ratio 1)
            advantages=losses.broadcast_sequence_advantages(per_seq, response_mask),
        )
        (state,), result = update(state, batch, update_key)
        history.append(float(scores.mean()))
        if i % 10 == 0 or i == iterations - 1:
            kl = float(result.metrics["kl/seq_mean"])
            print(f"iteration {i:3d}: task reward {history[-1]:.3f}, KL/seq {kl:.3f}")
    return history


if __name__ == "__main__":
    rewards = train()
    print(f"task reward {np.mean(rewards[:10]):.3f} (first 10) -> {np.mean(rewards[-10:]):.3f}")
