"""Workloads R1 and R2 in plain PyTorch + transformers: the baseline of benchmarks/rl_step.py.

What TRL's ``GRPOTrainer`` and OpenRLHF's PPO run per step on one process, written out
directly so the comparison with jaxrlhf is made on the same machine in the same run:
``generate`` with the KV cache (prompts repeated per sample), a no-grad reference forward
(and, for R2, the reward model's), then one AdamW update of the policy (and the critic) over
the 32 sequences in one micro-batch. float32, eager mode, ``torch.set_num_threads`` threads.

It leaves out everything the frameworks add around that (datasets, accelerate, logging,
metric passes such as entropy) and takes the shortcuts that are exact for one epoch of one
micro-batch: the old policy's log-probs and the critic's old values are the update forward's
own values, detached (so no separate scoring forward of the policy or critic, which
OpenRLHF's experience maker runs; jaxrlhf reuses its update forwards the same way). Every
shortcut makes this baseline faster than the stacks it stands for, so a ratio measured
against it understates jaxrlhf's lead over them.
"""

from __future__ import annotations

import copy
import tempfile
import time

import numpy as np
import torch
import transformers

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf

# The same GRPO/PPO settings as benchmarks/rl_step.py's configs (and jaxrlhf's defaults).
CLIP_EPS, VALUE_CLIP, KL_BETA, LR = 0.2, 0.2, 0.04, 1e-6
GAMMA, LAM = 1.0, 0.95


def hf_causal_lm(cfg: ModelConfig, params) -> transformers.PreTrainedModel:
    """transformers' CausalLM holding jaxrlhf ``params`` (through a temporary Hugging Face
    export), float32, eval mode, with no EOS (the workloads generate fixed lengths)."""
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, cfg, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits, [B, T] tokens -> [B, T] log-probs of the tokens (float32)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


def grpo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] scores in contiguous groups -> [B] group-normalised advantages (unbiased std, as
    TRL; the same as ``jaxrlhf.losses.grpo_advantages``)."""
    grouped = scores.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-6)).reshape(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns of [B, T] rewards and values (no masking: fixed
    length), the reverse loop TRL and OpenRLHF write (``jaxrlhf.losses.gae_advantages``
    with an all-True mask)."""
    last, advantages = torch.zeros_like(rewards[:, 0]), []
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + GAMMA * next_value - values[:, t]
        last = delta + GAMMA * LAM * last
        advantages.append(last)
    advantages = torch.stack(advantages[::-1], dim=1)
    return advantages, advantages + values


class TorchRLStep:
    """One R1 (``workload="R1"``: GRPO) or R2 (``"R2"``: PPO) step in PyTorch.

    Args:
      cfg: the bench model (Llama architecture).
      params: jaxrlhf LM params; the policy and reference start from them (via an HF export).
      workload: "R1" or "R2".
      samples: samples per prompt.
      new_tokens: generated tokens per sample (no early stop).
      threads: torch intra-op threads.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        workload: str,
        samples: int,
        new_tokens: int,
        threads: int,
    ):
        torch.set_num_threads(threads)
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(0)
        self.workload, self.samples, self.new_tokens = workload, samples, new_tokens
        self.policy = hf_causal_lm(cfg, params)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        hf_config = copy.deepcopy(self.policy.config)
        # The reward model scores each row's last token that is not padding; sequences are
        # fixed-length, so which id stands for padding only matters where a row happens to
        # end with it (the score is then read one token earlier: the same cost).
        hf_config.pad_token_id = 0
        hf_config.num_labels = 1
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=LR)
        if workload == "R2":
            self.critic = transformers.LlamaForTokenClassification(hf_config)
            self.reward_model = transformers.LlamaForSequenceClassification(hf_config)
            self.reward_model.eval().requires_grad_(False)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=LR)

    def step(self, prompts: np.ndarray, seed: int) -> dict[str, float]:
        """One full iteration on [P, L] prompt ids; returns wall seconds per phase
        (``generate``, ``score``, ``train``) and ``total``."""
        torch.manual_seed(seed)
        prompt = torch.from_numpy(prompts).long().repeat_interleave(self.samples, dim=0)
        length = prompt.shape[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            sequences = self.policy.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                use_cache=True,
            )
        response = sequences[:, length:]
        t1 = time.perf_counter()

        # The logits at positions length-1 .. end-1 predict the response tokens.
        def response_logprobs(model: torch.nn.Module) -> torch.Tensor:
            logits = model(input_ids=sequences).logits[:, length - 1 : -1]
            return _token_logprobs(logits, response)

        with torch.no_grad():
            reference = response_logprobs(self.reference)
            if self.workload == "R2":
                scores = self.reward_model(input_ids=sequences).logits[:, 0]
            else:  # a cheap programmatic reward: the share of even token ids
                scores = (response % 2 == 0).float().mean(dim=1)
        t2 = time.perf_counter()

        logprobs = response_logprobs(self.policy)
        old = logprobs.detach()  # one epoch, one micro-batch: ratio exactly 1
        if self.workload == "R1":
            advantages = grpo_advantages(scores, self.samples)[:, None].expand_as(logprobs)
        else:
            values = self.critic(input_ids=sequences).logits[:, length - 1 : -1, 0]
            old_values = values.detach()
            rewards = torch.zeros_like(old_values)
            rewards[:, -1] = scores
            advantages, returns = gae(rewards, old_values)
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        ratio = torch.exp(logprobs - old)
        policy_loss = torch.maximum(
            -advantages * ratio, -advantages * ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
        )
        log_ratio = reference - logprobs  # k3 estimator of KL(policy || reference)
        kl = torch.exp(log_ratio) - log_ratio - 1
        loss = (policy_loss + KL_BETA * kl).mean()
        if self.workload == "R2":
            clipped = old_values + (values - old_values).clamp(-VALUE_CLIP, VALUE_CLIP)
            value_loss = (
                0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()
            )
            loss = loss + value_loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.workload == "R2":
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {"generate": t1 - t0, "score": t2 - t1, "train": t3 - t2, "total": t3 - t0}
