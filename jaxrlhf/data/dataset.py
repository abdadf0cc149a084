"""Tokenized datasets, fixed-shape numpy batches and a resumable, seeded batch iterator.

Batch layouts (numpy, padded to a fixed length so each jitted step compiles once):

* SFT: ``tokens [B, T]`` int32, right-padded; ``mask [B, T]`` (real tokens);
  ``prompt_mask`` and ``response_mask [B, T]`` (the response mask is the loss mask).
* Preference: the same keys with a pair axis, ``[B, 2, T]``: index 0 is the chosen
  sequence, 1 the rejected one. Stacking (rather than two batches) keeps each pair on the
  same device when the batch axis is sharded, so ``reshape(2B, T)`` in the step is free.
* Offline (ILQL): the SFT keys plus ``reward [B]`` float32, each record's reward (0 on
  padding rows).
* Prompt (generation): ``tokens [B, P]`` left-padded, so every prompt ends at the same
  column and generation appends after it; ``mask [B, P]``; ``index [B]`` int32, each row's
  record in ``TokenizedDataset.records`` (-1 for padding), where a reward function finds the
  record's other columns.

A row index of -1 gives an all-padding row (every mask False); evaluation uses it to fill
its last batch. Per-example arrays added later (e.g. DPO reference log-probs) live in
``extras`` and are gathered into batches under their own key.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from jaxrlhf.data.config import DataConfig, TokenizerConfig
from jaxrlhf.data.errors import DataError
from jaxrlhf.data.examples import DataReport, Encoded, Encoder, encode_records
from jaxrlhf.data.sources import BUILTIN_PREFIX, read_records
from jaxrlhf.data.tasks import builtin_records
from jaxrlhf.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]
KINDS = ("sft", "preference", "prompt", "offline")


@dataclasses.dataclass
class TokenizedDataset:
    """Encoded examples of one kind with their prompt/response boundaries."""

    kind: str
    prompts: list[np.ndarray]
    responses: list[tuple[np.ndarray, ...]]
    records: list[dict[str, Any]]
    report: DataReport
    pad_id: int = 0
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_encoded(cls, encoded: Encoded, pad_id: int) -> TokenizedDataset:
        extras = {}
        if encoded.kind == "offline":
            extras["reward"] = np.asarray(encoded.rewards, np.float32)
        return cls(
            encoded.kind,
            encoded.prompts,
            encoded.responses,
            encoded.records,
            encoded.report,
            pad_id,
            extras,
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def columns(self, indices: np.ndarray, exclude: tuple[str, ...] = ()) -> dict[str, list]:
        """The records ``indices``' fields other than ``exclude``, one list per field name
        (in the order of ``indices``; None where a record lacks the field).

        Raises:
          ValueError: a negative index (a padding row has no record).
        """
        indices = np.asarray(indices)
        if (indices < 0).any():
            raise ValueError("padding rows (index -1) have no record to read columns from")
        records = [self.records[i] for i in indices]
        names = sorted({k for r in records for k in r} - set(exclude))
        return {k: [r.get(k) for r in records] for k in names}

    def batch(self, indices: np.ndarray, length: int) -> Batch:
        """The rows ``indices`` (-1 = padding row) padded to ``length`` tokens."""
        indices = np.asarray(indices)
        if self.kind == "prompt":
            out = self._prompt_batch(indices, length)
        else:
            out = self._train_batch(indices, length)
        for key, values in self.extras.items():
            gathered = values[np.maximum(indices, 0)]
            gathered[indices < 0] = 0
            out[key] = gathered
        return out

    def _train_batch(self, indices: np.ndarray, length: int) -> Batch:
        n_seq = 2 if self.kind == "preference" else 1
        shape = (len(indices), n_seq, length)
        tokens = np.full(shape, self.pad_id, np.int32)
        mask = np.zeros(shape, bool)
        response_mask = np.zeros(shape, bool)
        for row, i in enumerate(indices):
            if i < 0:
                continue
            prompt = self.prompts[i]
            p = len(prompt)
            for j, response in enumerate(self.responses[i]):
                end = p + len(response)
                tokens[row, j, :p] = prompt
                tokens[row, j, p:end] = response
                mask[row, j, :end] = True
                response_mask[row, j, p:end] = True
        out = {
            "tokens": tokens,
            "mask": mask,
            "prompt_mask": mask & ~response_mask,
            "response_mask": response_mask,
        }
        if n_seq == 1:
            out = {k: v[:, 0] for k, v in out.items()}
        if self.kind == "offline":  # the values: extras["reward"], gathered by batch()
            out["reward"] = np.zeros(len(indices), np.float32)
        return out

    def _prompt_batch(self, indices: np.ndarray, length: int) -> Batch:
        tokens = np.full((len(indices), length), self.pad_id, np.int32)
        mask = np.zeros((len(indices), length), bool)
        for row, i in enumerate(indices):
            if i < 0:
                continue
            prompt = self.prompts[i]
            tokens[row, length - len(prompt) :] = prompt
            mask[row, length - len(prompt) :] = True
        return {"tokens": tokens, "mask": mask, "index": indices.astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """Where a :class:`BatchIterator` is: batch ``position`` of ``epoch`` under ``seed``."""

    epoch: int = 0
    position: int = 0
    seed: int = 0


class BatchIterator:
    """Endless batches of ``batch_size`` rows, reshuffled each epoch by ``(seed, epoch)``.

    Each epoch yields ``len(dataset) // batch_size`` full batches (the shuffled remainder
    waits for a later epoch). The order depends only on the seed, the epoch and the dataset
    size, so ``state()`` / ``restore()`` resume exactly. ``batch_from`` names the setting
    the batch size comes from in the error a too-small dataset raises.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        batch_size: int,
        length: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        batch_from: str | None = None,
    ) -> None:
        if len(dataset) < batch_size:
            whence = f" ({batch_from})" if batch_from else ""
            raise DataError(
                f"{dataset.report.source}: {len(dataset)} usable examples, fewer than one "
                f"batch of {batch_size}{whence}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.length = length
        self.shuffle = shuffle
        self._state = IteratorState(seed=seed)
        self._order_epoch = -1
        self._order = np.arange(len(dataset))

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def state(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``: plain ints, JSON-serialisable."""
        return dataclasses.asdict(self._state)

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a saved ``state()`` (its seed replaces this iterator's)."""
        self._state = IteratorState(
            epoch=int(state["epoch"]), position=int(state["position"]), seed=int(state["seed"])
        )
        self._order_epoch = -1

    def _indices(self) -> np.ndarray:
        s = self._state
        if s.position >= self.batches_per_epoch:
            s = self._state = IteratorState(epoch=s.epoch + 1, position=0, seed=s.seed)
        if self._order_epoch != s.epoch:
            n = len(self.dataset)
            self._order = (
                np.random.default_rng([s.seed, s.epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_epoch = s.epoch
        start = s.position * self.batch_size
        self._state = dataclasses.replace(s, position=s.position + 1)
        return self._order[start : start + self.batch_size]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        return self.dataset.batch(self._indices(), self.length)


def eval_batches(dataset: TokenizedDataset, batch_size: int, length: int):
    """Every example once, in order; the last batch is filled with padding rows."""
    n = len(dataset)
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size)
        idx[idx >= n] = -1
        yield dataset.batch(idx, length)


def _records(source: str, split: str) -> list[dict[str, Any]]:
    if source.startswith(BUILTIN_PREFIX):
        raise ValueError("builtin sources are generated, not read")
    return read_records(source, split)


def _tokenize(
    records: list[dict[str, Any]], kind: str, encoder: Encoder, cfg: DataConfig, source: str
) -> TokenizedDataset:
    encoded = encode_records(records, kind, encoder, cfg, source)
    check_dropped(encoded.report, cfg)
    return TokenizedDataset.from_encoded(encoded, encoder.tok.pad_id)


def check_dropped(report: DataReport, cfg: DataConfig) -> None:
    """Logs how many records were kept; warns or fails when too many were dropped.

    Raises:
      DataError: no record kept, or a dropped fraction above ``cfg.drop_error_fraction``.
    """
    if report.kept == 0:
        raise DataError(f"no usable records: {report.summary()}")
    dropped = report.total - report.kept
    fraction = dropped / report.total
    hint = ""
    if any("longer than" in reason for reason in report.bad):
        hint = "; raise data.max_length / data.max_prompt_length or set data.truncation: truncate"
    if fraction > cfg.drop_error_fraction:
        raise DataError(
            f"{report.summary()}: {fraction:.0%} dropped, above "
            f"data.drop_error_fraction={cfg.drop_error_fraction:g}{hint} (or raise "
            "data.drop_error_fraction to train on what is left)"
        )
    if fraction > cfg.drop_warn_fraction:
        logger.warning(
            "WARNING data: %s: %.0f%% of the records dropped, above data.drop_warn_fraction=%g%s",
            report.summary(),
            100 * fraction,
            cfg.drop_warn_fraction,
            hint,
        )
    else:
        (logger.warning if dropped else logger.info)("data: %s", report.summary())


def load_datasets(
    kind: str, cfg: DataConfig, tokenizer: Tokenizer, tokenizer_cfg: TokenizerConfig
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """The training and held-out datasets of ``kind`` described by ``cfg``.

    Args:
      kind: ``"sft"``, ``"preference"``, ``"prompt"`` or ``"offline"``.
      cfg: the data config.
      tokenizer, tokenizer_cfg: the tokenizer and its template settings.

    Returns:
      ``(train, eval)``; ``eval`` is None when ``cfg.eval`` is None and ``eval_size`` is 0.

    Raises:
      DataError: unreadable sources, or no usable records left (one line).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {KINDS}")
    encoder = Encoder(tokenizer, tokenizer_cfg)
    if cfg.train.startswith(BUILTIN_PREFIX):
        task = cfg.train[len(BUILTIN_PREFIX) :]
        try:
            held_out = builtin_records(task, kind, cfg.eval_size, seed=cfg.seed + 1)
            train_records = builtin_records(
                task,
                kind,
                cfg.builtin_size,
                seed=cfg.seed,
                exclude_prompts={r["prompt"] for r in held_out},
            )
        except ValueError as e:
            raise DataError(f"data.train: {e}") from None
    else:
        train_records = _records(cfg.train, cfg.split)
        held_out = []
        if cfg.eval is None and cfg.eval_size:
            if cfg.eval_size >= len(train_records):
                raise DataError(
                    f"{cfg.train}: data.eval_size {cfg.eval_size} leaves no training records "
                    f"out of {len(train_records)}"
                )
            order = np.random.default_rng([cfg.seed, 7]).permutation(len(train_records))
            held_out = [train_records[i] for i in order[: cfg.eval_size]]
            train_records = [train_records[i] for i in np.sort(order[cfg.eval_size :])]
    train = _tokenize(train_records, kind, encoder, cfg, cfg.train)
    if cfg.eval is not None:
        if cfg.eval.startswith(BUILTIN_PREFIX):
            task = cfg.eval[len(BUILTIN_PREFIX) :]
            held_out = builtin_records(task, kind, cfg.eval_size, seed=cfg.seed + 1)
        else:
            held_out = _records(cfg.eval, cfg.eval_split)
        eval_source = cfg.eval
    else:
        eval_source = f"{cfg.train} (held out)"
    evaluation = _tokenize(held_out, kind, encoder, cfg, eval_source) if held_out else None
    return train, evaluation
