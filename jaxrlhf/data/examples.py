"""Records -> token ids with prompt/response boundaries, counting bad records.

A training sequence is ``prompt ids + response ids``; the boundary is fixed here, once, and
every mask derives from it (``jaxrlhf.data.dataset``). The two parts are tokenized
separately, so the boundary is exact whatever the tokenizer merges, and a sampled response
starts exactly where the prompt's ids end, as during generation.

* Plain text: ``[BOS] + encode(prompt)`` and ``encode(response) + [EOS]`` (BOS/EOS when
  the tokenizer has them and ``add_bos`` / ``add_eos`` are set).
* Chat template: the prompt is the template rendered with the generation prompt; the
  response is what the full conversation's rendering adds after it (the assistant turn with
  its end-of-turn marker). A template whose conversation does not start with the rendered
  prompt cannot be split this way; such records are counted as bad. Chat messages are only
  rendered through a template: without one they are an error, not flattened to text.

A record holds text or chat messages in ``prompt`` plus ``response`` / ``chosen`` and
``rejected``, or, in TRL's conversational formats, no prompt field: one conversation in
``messages`` (sft: its last, assistant, turn is the response; prompt: a final assistant
turn is left out), or preference ``chosen`` / ``rejected`` conversations that differ only in
their last, assistant, turn (the shared turns are the prompt). Earlier assistant turns of a
multi-turn conversation belong to the prompt: only the last one is trained on.

Bad records (a missing field, empty text, a value that is not text or messages, too long
after the truncation policy, a preference pair whose two responses are the same tokens) are
counted by reason in a :class:`DataReport`; the caller warns or fails when too many are
(``DataConfig.drop_warn_fraction`` / ``drop_error_fraction``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxrlhf.data.config import DataConfig, TokenizerConfig
from jaxrlhf.data.errors import DataError
from jaxrlhf.data.tokenizer import Messages, Tokenizer, uses_chat_template

Ids = np.ndarray  # [n] int32


class BadRecord(Exception):
    """Raised while encoding one record; the message is the reason it is skipped."""


@dataclasses.dataclass
class DataReport:
    """How many records a source had and why some were dropped."""

    source: str
    total: int = 0
    bad: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def kept(self) -> int:
        return self.total - sum(self.bad.values())

    def summary(self) -> str:
        """One line, e.g. ``data.jsonl: 98 of 100 records kept; 2 bad (2 missing field 'x')``."""
        line = f"{self.source}: {self.kept} of {self.total} records kept"
        if self.bad:
            reasons = ", ".join(f"{n} {reason}" for reason, n in self.bad.most_common())
            line += f"; {sum(self.bad.values())} bad ({reasons})"
        return line


def _field(record: dict[str, Any], key: str) -> str | Messages:
    """The text or chat messages of ``record[key]``."""
    if key not in record or record[key] is None:
        raise BadRecord(f"missing field {key!r}")
    value = record[key]
    if isinstance(value, str):
        if not value.strip():
            raise BadRecord(f"empty text in {key!r}")
        return value
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value:
        if all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
            if not any(m["content"].strip() for m in value):
                raise BadRecord(f"empty text in {key!r}")
            return [{"role": str(m.get("role", "user")), "content": m["content"]} for m in value]
    if isinstance(value, list) and not value:
        raise BadRecord(f"empty text in {key!r}")
    raise BadRecord(f"field {key!r} is neither text nor chat messages")


def record_reward(record: dict[str, Any], key: str) -> float:
    """The finite number in an offline ``record[key]``.

    Raises:
      BadRecord: missing, not a number, or not finite.
    """
    value = record.get(key)
    if value is None:
        raise BadRecord(f"missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise BadRecord(f"field {key!r} is not a number")
    if not np.isfinite(value):
        raise BadRecord(f"field {key!r} is not finite")
    return float(value)


def _ends_with_assistant(messages: Messages) -> bool:
    return messages[-1]["role"] == "assistant"


def _conversation(record: dict[str, Any], kind: str, cfg: DataConfig) -> tuple[Any, list[Any]]:
    """The prompt and responses of a record without ``prompt_key``, in TRL's conversational
    formats: ``messages_key`` holds one conversation whose last assistant turn is the
    response (sft) or is left out (prompt); preference ``chosen`` / ``rejected`` hold whole
    conversations that differ only in their last, assistant, turn."""
    if kind == "preference":
        chosen, rejected = _field(record, cfg.chosen_key), _field(record, cfg.rejected_key)
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise BadRecord(f"missing field {cfg.prompt_key!r}")
        if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
            raise BadRecord(
                f"{cfg.chosen_key!r} and {cfg.rejected_key!r} are not one conversation "
                "differing only in its last turn"
            )
        if not (_ends_with_assistant(chosen) and _ends_with_assistant(rejected)):
            raise BadRecord(
                f"{cfg.chosen_key!r} or {cfg.rejected_key!r} ends with no assistant turn"
            )
        return chosen[:-1], [chosen[-1:], rejected[-1:]]
    if cfg.messages_key not in record:
        raise BadRecord(f"missing field {cfg.prompt_key!r} (or {cfg.messages_key!r})")
    messages = _field(record, cfg.messages_key)
    if isinstance(messages, str):
        raise BadRecord(f"field {cfg.messages_key!r} is text, not chat messages")
    ends = _ends_with_assistant(messages)
    if kind in ("sft", "offline") and not ends:
        raise BadRecord(f"field {cfg.messages_key!r} does not end with an assistant turn")
    prompt = messages[:-1] if ends else messages
    if not prompt:
        raise BadRecord(f"field {cfg.messages_key!r} has no turn before the assistant's")
    return prompt, [messages[-1:]] if kind in ("sft", "offline") else []


def _messages(value: str | Messages, role: str) -> Messages:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


class Encoder:
    """Encodes prompts and responses with one tokenizer and one template choice."""

    def __init__(self, tokenizer: Tokenizer, cfg: TokenizerConfig) -> None:
        self.tok = tokenizer
        self.templated = uses_chat_template(cfg, tokenizer)
        # Why chat messages cannot be rendered (flattening them would lose the roles).
        self.no_template = (
            "tokenizer.chat_template is 'never'"
            if cfg.chat_template == "never"
            else f"the tokenizer ({cfg.path}) has no chat template"
        )
        self.bos = [tokenizer.bos_id] if cfg.add_bos and tokenizer.bos_id is not None else []
        self.eos = [tokenizer.eos_id] if cfg.add_eos and tokenizer.eos_id is not None else []

    def prompt(self, prompt: str | Messages) -> list[int]:
        if self.templated:
            return self.tok.encode(self.tok.render_chat(_messages(prompt, "user"), True))
        return self.bos + self.tok.encode(prompt)  # text: messages need the template

    def response(self, prompt: str | Messages, response: str | Messages) -> list[int]:
        if self.templated:
            head = _messages(prompt, "user")
            prompt_text = self.tok.render_chat(head, True)
            full = self.tok.render_chat(head + _messages(response, "assistant"), False)
            if not full.startswith(prompt_text):
                raise BadRecord("chat template does not start the conversation with the prompt")
            return self.tok.encode(full[len(prompt_text) :])
        return self.tok.encode(response) + self.eos


PROMPT_TOO_LONG = "prompt longer than max_prompt_length"
SEQUENCE_TOO_LONG = "prompt + response longer than max_length"


def _fit_prompt(ids: list[int], cfg: DataConfig) -> list[int]:
    if len(ids) <= cfg.max_prompt_length:
        return ids
    if cfg.truncation == "drop":
        raise BadRecord(PROMPT_TOO_LONG)
    return ids[-cfg.max_prompt_length :]  # from the left: keep the end, next to the response


def _fit_response(ids: list[int], room: int, cfg: DataConfig) -> list[int]:
    if len(ids) <= room:
        return ids
    if cfg.truncation == "drop" or room < 1:
        raise BadRecord(SEQUENCE_TOO_LONG)
    return ids[:room]  # from the right: keep the start


def _check_plain(
    source: str, index: int, record: dict[str, Any], keys: Iterable[str], encoder: Encoder
) -> None:
    """Raises a DataError when a field that is used holds chat messages and the encoder
    cannot render them (a data/tokenizer mismatch: every record would fail)."""
    for key in keys:
        if isinstance(record.get(key), list | dict):
            raise DataError(
                f"{source}: record {index + 1}: {key!r} holds chat messages but "
                f"{encoder.no_template}: set tokenizer.path to a tokenizer with a chat "
                "template, or give plain-text prompt and response fields"
            )


@dataclasses.dataclass
class Encoded:
    """Token ids of one source. ``responses[i]`` has 1 (SFT, offline), 2 (chosen, rejected)
    or 0 (prompt-only) entries; ``rewards`` one per kept offline record (empty otherwise)."""

    kind: str
    prompts: list[Ids]
    responses: list[tuple[Ids, ...]]
    records: list[dict[str, Any]]
    report: DataReport
    rewards: list[float] = dataclasses.field(default_factory=list)


def encode_records(
    records: Iterable[dict[str, Any]],
    kind: str,
    encoder: Encoder,
    cfg: DataConfig,
    source: str,
) -> Encoded:
    """Encodes records of ``kind`` (``"sft"``, ``"preference"``, ``"prompt"`` or
    ``"offline"``: an SFT record with a finite ``reward_key`` number).

    Each kept record's prompt fits ``max_prompt_length`` and each prompt + response fits
    ``max_length`` (after truncation when ``cfg.truncation == "truncate"``).
    """
    keys = {
        "sft": (cfg.response_key,),
        "offline": (cfg.response_key,),
        "preference": (cfg.chosen_key, cfg.rejected_key),
        "prompt": (),
    }[kind]
    report = DataReport(source)
    out = Encoded(kind, [], [], [], report)
    for index, record in enumerate(records):
        report.total += 1
        try:
            if cfg.prompt_key in record:
                prompt = _field(record, cfg.prompt_key)
                responses = [_field(record, key) for key in keys]
            else:
                prompt, responses = _conversation(record, kind, cfg)
            if not encoder.templated:
                used = cfg.prompt_key if cfg.prompt_key in record else cfg.messages_key
                _check_plain(source, index, record, (used, *keys), encoder)
            prompt_ids = _fit_prompt(encoder.prompt(prompt), cfg)
            room = cfg.max_length - len(prompt_ids)
            response_ids = [
                _fit_response(encoder.response(prompt, r), room, cfg) for r in responses
            ]
            if any(not r for r in response_ids):
                raise BadRecord("empty response after tokenization")
            reward = record_reward(record, cfg.reward_key) if kind == "offline" else None
            if kind == "preference" and response_ids[0] == response_ids[1]:
                raise BadRecord("chosen and rejected are the same tokens")
        except BadRecord as e:
            report.bad[str(e)] += 1
            continue
        out.prompts.append(np.asarray(prompt_ids, np.int32))
        out.responses.append(tuple(np.asarray(r, np.int32) for r in response_ids))
        out.records.append(record)
        if reward is not None:
            out.rewards.append(reward)
    return out
