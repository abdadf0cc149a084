"""Typed configs of the data pipeline: where records come from, how they are tokenized."""

from __future__ import annotations

import dataclasses

CHAT_TEMPLATE_MODES = ("auto", "always", "never")
TRUNCATION_POLICIES = ("drop", "truncate")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Which tokenizer, and how conversations become text.

    Attributes:
      path: ``"builtin"`` (the character-level tokenizer of the built-in tasks) or a local
        directory that ``transformers.AutoTokenizer.from_pretrained`` loads (never the Hub).
      chat_template: ``"auto"`` renders prompts with the tokenizer's chat template when it has
        one and as plain text otherwise; ``"always"`` requires a template; ``"never"`` uses
        plain text.
      add_bos: plain text only: start each sequence with the BOS token, if there is one.
      add_eos: plain text only: end each response with the EOS token (templates end turns
        with their own marker).
    """

    path: str = "builtin"
    chat_template: str = "auto"
    add_bos: bool = True
    add_eos: bool = True

    def __post_init__(self) -> None:
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(
                f"chat_template: expected one of {list(CHAT_TEMPLATE_MODES)}, "
                f"got {self.chat_template!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training and held-out data.

    Sources are ``builtin:NAME`` (a generated task, see ``jaxrlhf.data.tasks``), a JSONL file,
    a Parquet file (needs pyarrow) or a directory written by ``datasets``'
    ``save_to_disk`` (needs datasets).

    Attributes:
      train: the training source.
      eval: the held-out source; None holds out ``eval_size`` records of ``train`` (chosen
        by ``seed``, so file order does not matter).
      eval_size: records held out of ``train`` when ``eval`` is None (0: no evaluation).
      builtin_size: how many training records a ``builtin:`` source generates.
      split: split of a saved ``DatasetDict`` to read (``eval_split`` for ``eval``).
      eval_split: see ``split``.
      prompt_key, response_key, chosen_key, rejected_key: record fields. Each holds text or
        chat messages (``[{"role": ..., "content": ...}]``, rendered by the tokenizer's chat
        template). Without ``prompt_key``, ``chosen`` / ``rejected`` may be whole
        conversations differing only in their last, assistant, turn (TRL's conversational
        preference format).
      messages_key: the field of a record without ``prompt_key`` that holds a whole
        conversation (TRL's ``messages`` format): for sft its last turn, an assistant's, is
        the response and the turns before it the prompt; for prompt data a final assistant
        turn is left out.
      reward_key: the field holding an offline record's reward (``algorithm: ilql``): a
        finite number scoring its response.
      max_length: tokens per training sequence (prompt + response); batches are padded to it.
      max_prompt_length: tokens per prompt.
      truncation: what happens to a record longer than ``max_prompt_length`` /
        ``max_length``. ``"drop"`` (the default) leaves it out, so every trained sequence is
        the text as written: cutting the start of a prompt can remove its instruction, and
        cutting two preference responses can leave them equal or without the part that
        made one better. ``"truncate"`` does what TRL does (``truncation_mode="keep_end"``):
        the prompt loses tokens from the left (its end, next to the response, is kept), the
        response from the right (it keeps its start; a cut response has no EOS). A record
        whose response is then empty, or whose chosen and rejected responses become equal,
        is still dropped.
      drop_warn_fraction: warn, naming the reasons, when more than this fraction of a
        source's records is dropped (too long, missing or empty fields, ...).
      drop_error_fraction: fail when more than this fraction is dropped: at 50% the run
        would train on a different, shorter-biased dataset than the one given. Raise it (up
        to 1.0) to accept that.
      shuffle: reshuffle the training set every epoch.
      seed: shuffling and hold-out seed.
    """

    train: str = "builtin:sort"
    eval: str | None = None
    eval_size: int = 256
    builtin_size: int = 4096
    split: str = "train"
    eval_split: str = "test"
    prompt_key: str = "prompt"
    response_key: str = "response"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    messages_key: str = "messages"
    reward_key: str = "reward"
    max_length: int = 512
    max_prompt_length: int = 256
    truncation: str = "drop"
    drop_warn_fraction: float = 0.05
    drop_error_fraction: float = 0.5
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("max_length", self.max_length)
        _positive("max_prompt_length", self.max_prompt_length)
        _positive("builtin_size", self.builtin_size)
        if self.eval_size < 0:
            raise ValueError(f"eval_size: must be >= 0, got {self.eval_size}")
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"max_prompt_length: {self.max_prompt_length} leaves no room for a response "
                f"in max_length {self.max_length}"
            )
        if self.truncation not in TRUNCATION_POLICIES:
            raise ValueError(
                f"truncation: expected one of {list(TRUNCATION_POLICIES)}, got {self.truncation!r}"
            )
        for name in ("drop_warn_fraction", "drop_error_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value}")
        if self.drop_warn_fraction > self.drop_error_fraction:
            raise ValueError(
                f"drop_warn_fraction: {self.drop_warn_fraction} is above drop_error_fraction "
                f"{self.drop_error_fraction}"
            )
