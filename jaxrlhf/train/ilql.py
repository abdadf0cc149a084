"""Implicit language Q-learning (``algorithm: ilql``): the objective over offline batches, the
target heads' Polyak averaging, and the evaluation that decodes held-out prompts.

A batch is an offline one (``jaxrlhf.data.dataset``): right-padded ``tokens [B, T]`` of
prompt + response, ``response_mask`` and one ``reward [B]`` per row. The actions are the
response tokens: action ``t`` is ``tokens[:, t + 1]``, taken in state ``t`` (the hidden state
at position ``t``); the row's reward is paid on its last action, and the state after it is
terminal. :func:`ilql_targets` lays this out in the arrays ``jaxrlhf.losses.ilql_loss``
takes (trlX's ``actions_ixs`` / ``states_ixs`` / ``dones``, for every position at once).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf import losses
from jaxrlhf.config import ConfigError
from jaxrlhf.data.dataset import TokenizedDataset
from jaxrlhf.data.examples import record_reward
from jaxrlhf.data.tokenizer import Tokenizer
from jaxrlhf.generation import ilql_sampling
from jaxrlhf.models import ilql as ilql_model
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.safetensors_io import PlannedTensor, SafetensorsReader, write_safetensors
from jaxrlhf.rewards.functions import RewardError, call_reward_fn, resolve_reward_fn
from jaxrlhf.sharding.distributed import put_global, to_host
from jaxrlhf.train.config import ILQLConfig
from jaxrlhf.train.steps import Batch, LossAux, Objective

logger = logging.getLogger(__name__)


class ILQLTargets(NamedTuple):
    """An offline batch as ILQL's loss reads it (``T - 1`` actions per row of ``T`` tokens).

    Attributes:
      actions: ``[B, T-1]`` the token taken at each position (``tokens[:, 1:]``).
      rewards: ``[B, T-1]`` the row's reward on its last action, 0 elsewhere.
      nonterminal: ``[B, T]`` True on states followed by a real action (trlX's ``dones``).
    """

    actions: Int[Array, "B Tm1"]
    rewards: Float[Array, "B Tm1"]
    nonterminal: Bool[Array, "B T"]


def ilql_targets(batch: Batch) -> ILQLTargets:
    """:class:`ILQLTargets` of an offline batch (module docstring)."""
    tokens, response = batch["tokens"], batch["response_mask"].astype(bool)
    taken = response[:, 1:]
    last = model_lib.last_token_index(taken)
    paid = jax.nn.one_hot(last, taken.shape[1], dtype=jnp.float32) * taken.any(-1)[:, None]
    rewards = paid * batch["reward"].astype(jnp.float32)[:, None]
    nonterminal = jnp.concatenate([taken, jnp.zeros_like(taken[:, :1])], axis=1)
    return ILQLTargets(tokens[:, 1:], rewards, nonterminal)


def loss_fn(cfg: ILQLConfig, module: Any, params: Any, batch: Batch) -> tuple[jax.Array, LossAux]:
    """``losses.ilql_loss`` of one forward of the ILQL model over the batch's rows."""
    out = model_lib.forward(module, params, batch["tokens"], batch["mask"])
    targets = ilql_targets(batch)
    loss, metrics = losses.ilql_loss(
        out.logits[:, :-1],
        list(out.q[:, :, :-1]),
        list(out.target_q[:, :, :-1]),
        out.values,
        targets.actions,
        targets.rewards,
        targets.nonterminal,
        gamma=cfg.gamma,
        tau=cfg.tau,
        cql_scale=cfg.cql_scale,
        awac_scale=cfg.awac_scale,
        beta=cfg.awac_beta,
    )
    return loss, LossAux({"loss/ilql": loss, **metrics})


def weight_fn(batch: Batch) -> jax.Array:
    """Actions in the batch (ILQL's terms are means over them)."""
    return batch["response_mask"][:, 1:].sum()


def after_update(cfg: ILQLConfig, params: Any, step: jax.Array) -> Any:
    """The target Q heads' Polyak step after every ``target_sync_every``-th update (``step``:
    updates before this one, so the first sync follows update ``target_sync_every``)."""
    synced = ilql_model.polyak_update(params, cfg.alpha)
    due = (step + 1) % cfg.target_sync_every == 0
    return jax.tree.map(lambda new, old: jnp.where(due, new, old), synced, params)


def objective(cfg: ILQLConfig) -> Objective:
    return Objective(
        name="ilql",
        role="policy",
        head="ilql",
        data_kind="offline",
        loss_fn=functools.partial(loss_fn, cfg),
        weight_fn=weight_fn,
        primary="loss/ilql",
        # reward and behaviour_reward: the evaluation's (SampleEvaluation), shown as eval/...
        summary=("loss/ilql", "loss/q", "loss/v", "values/mean", "reward", "behaviour_reward"),
        trainable=ilql_model.trainable_mask,
        after_update=functools.partial(after_update, cfg),
        export_lm=ilql_model.lm_params,
        export_extras=export_heads_beside,
    )


class SampleEvaluation:
    """Decodes every held-out prompt with ILQL's advantage-weighted sampling and scores the
    completions with ``ilql.eval_reward``: ``eval/reward`` (mean over prompts),
    ``eval/behaviour_reward`` (the held-out records' own mean reward, as recorded) and
    ``eval/completion_length`` (tokens, the stop token included).

    Args:
      cfg: the run's ILQL section; ``data_train``: ``data.train`` (for ``builtin``).
      module: the ILQL model (the programs' sharded module).
      data: the held-out offline dataset; ``tokenizer``: decodes the completions.
      row_sharding: ``[B, P]`` prompt rows over the training mesh's data shards.
      prompt_length: ``data.max_prompt_length`` (prompts are left-padded to it).
      batch_size: prompts per decode call (a multiple of the data shards).
      seed: the sampling key's seed (each evaluation decodes with the same keys).
      reward_key: the records' reward field (``data.reward_key``).
      exclude: record fields the reward function is not given (the prompt, and the
        behaviour's response and reward).
      stop_ids: tokens that end a completion (the tokenizer's EOS and the model's).

    Raises:
      ConfigError: ``eval_reward`` does not name a usable function (one line).
    """

    def __init__(
        self,
        cfg: ILQLConfig,
        data_train: str,
        module: Any,
        data: TokenizedDataset,
        tokenizer: Tokenizer,
        *,
        row_sharding: Any,
        prompt_length: int,
        batch_size: int,
        seed: int,
        reward_key: str,
        exclude: tuple[str, ...] = (),
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        try:
            self.reward_fn = resolve_reward_fn(cfg.eval_reward, data_train)
        except RewardError as e:
            problem = str(e).removeprefix("reward.function: ")
            raise ConfigError(f"ilql.eval_reward: {problem}") from None
        self.data, self.tokenizer, self.exclude = data, tokenizer, exclude
        self.prompts = TokenizedDataset(
            "prompt", data.prompts, [], data.records, data.report, data.pad_id
        )
        self.behaviour = float(np.mean([record_reward(r, reward_key) for r in data.records]))
        self.row_sharding = row_sharding
        self.prompt_length, self.batch_size = prompt_length, batch_size
        self.key = jax.random.key(seed)
        self.generate = jax.jit(
            functools.partial(
                ilql_sampling.generate,
                module,
                max_new_tokens=cfg.max_new_tokens,
                beta=cfg.decode_beta,
                top_k=cfg.top_k,
                temperature=cfg.temperature,
                stop_ids=stop_ids,
                pad_id=data.pad_id,
            )
        )

    def __call__(self, params: Any) -> dict[str, float]:
        n = len(self.data)
        rewards, lengths = [], []
        for start in range(0, n, self.batch_size):
            rows = np.arange(start, start + self.batch_size)
            rows = np.where(rows < n, rows, -1)
            batch = self.prompts.batch(rows, self.prompt_length)
            real = rows >= 0
            # padding rows decode a copy of the first prompt (every row needs a real token)
            batch["tokens"][~real], batch["mask"][~real] = batch["tokens"][0], batch["mask"][0]
            prompts = put_global(
                (batch["tokens"], batch["mask"]), (self.row_sharding, self.row_sharding)
            )
            key = jax.random.fold_in(self.key, start)
            tokens, alive = to_host(self.generate(params, *prompts, key))
            keep = rows[real]
            prompt_ids = [self.data.prompts[i] for i in keep]
            completion_ids = [row[ok] for row, ok in zip(tokens[real], alive[real], strict=True)]
            scores = call_reward_fn(
                self.reward_fn,
                [self.tokenizer.decode(ids) for ids in prompt_ids],
                [self.tokenizer.decode(ids) for ids in completion_ids],
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                columns=self.prompts.columns(keep, exclude=self.exclude),
            )
            rewards.append(scores)
            lengths.append(alive[real].sum(-1))
        return {
            "eval/reward": float(np.concatenate(rewards).mean()),
            "eval/behaviour_reward": self.behaviour,
            "eval/completion_length": float(np.concatenate(lengths).mean()),
        }


def sample_evaluation(
    cfg: Any,
    module: Any,
    data: TokenizedDataset | None,
    tokenizer: Tokenizer,
    row_sharding: Any,
) -> Callable[[Any], dict[str, float]] | None:
    """The run's :class:`SampleEvaluation` (``cfg``: the RunConfig; ``row_sharding``: the
    training batch's ``[B, T]`` sharding), or None without ``ilql.eval_reward``."""
    if cfg.ilql.eval_reward is None:
        return None
    d = cfg.data
    model_eos = module.cfg.eos_token_id
    model_eos = () if model_eos is None else model_eos
    model_eos = (model_eos,) if isinstance(model_eos, int) else tuple(model_eos)
    tokenizer_eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    return SampleEvaluation(
        cfg.ilql,
        cfg.data.train,
        module,
        data,
        tokenizer,
        row_sharding=row_sharding,
        prompt_length=cfg.data.max_prompt_length,
        batch_size=cfg.train.eval_batch_size or cfg.train.batch_size,
        seed=cfg.train.seed,
        reward_key=d.reward_key,
        exclude=(d.prompt_key, d.messages_key, d.response_key, d.reward_key),
        stop_ids=tuple(dict.fromkeys(tokenizer_eos + model_eos)),
    )


def standardize_rewards(
    cfg: ILQLConfig, train: TokenizedDataset, held_out: TokenizedDataset | None
) -> dict[str, float]:
    """With ``cfg.normalize_rewards``, every record's reward (``extras["reward"]``, what the
    batches carry) as ``(r - mean) / std`` over the training set, as trlX's ILQL does; the
    held-out losses use the same transform. Returns the mean and std used (0 and 1 when
    off); a constant reward keeps std 1."""
    if not cfg.normalize_rewards:
        return {"mean": 0.0, "std": 1.0}
    rewards = train.extras["reward"]
    mean, std = float(rewards.mean()), float(rewards.std())
    std = std if std > 1e-8 else 1.0
    for data in (train, held_out):
        if data is not None:
            data.extras["reward"] = ((data.extras["reward"] - mean) / std).astype(np.float32)
    logger.info("ilql: rewards standardised with the training set's mean %.4g, std %.4g", mean, std)
    return {"mean": mean, "std": std}


HEADS_DIR = "ilql_heads"


def export_heads(directory: str, params: Any) -> None:
    """The value, Q and target Q heads as one safetensors file in ``directory`` (keys
    ``v_head.hidden_kernel``, ``q_heads_0.out_bias``, ...; float32), beside the exported
    language model: with :func:`load_heads` they restore ILQL's decoding after export.
    Every process gathers; process 0 writes."""
    heads = to_host(ilql_model.head_params(params))
    flat = {
        f"{name}.{leaf}": np.asarray(value, np.float32)
        for name, head in heads.items()
        for leaf, value in head.items()
    }
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    planned = [PlannedTensor(k, v.shape, np.dtype(np.float32)) for k, v in flat.items()]
    write_safetensors(directory, planned, iter(flat.values()))


def export_heads_beside(hf_dir: str, params: Any) -> None:
    """:func:`export_heads` into ``hf_dir``/:data:`HEADS_DIR`, beside the exported LM."""
    export_heads(os.path.join(hf_dir, HEADS_DIR), params)


def load_heads(directory: str) -> dict[str, Any]:
    """The heads :func:`export_heads` wrote, as the param tree's head entries (numpy); merge
    them into a loaded language model's params for ``models.model.build(cfg, "ilql")``."""
    reader = SafetensorsReader(directory)
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in reader.keys():
        name, leaf = key.split(".", 1)
        out.setdefault(name, {})[leaf] = reader.get(key)
    return out
