"""Tokenizers: a built-in character-level one, and Hugging Face tokenizers from local files.

Both expose the small interface the data pipeline needs (:class:`Tokenizer`): ``encode``
(text -> ids, no special tokens added), ``decode``, the special ids and, for chat data,
``render_chat`` (messages -> text through the tokenizer's chat template).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from jaxrlhf.data.config import TokenizerConfig
from jaxrlhf.data.errors import DataError

Messages = list[dict[str, str]]

# Files from which transformers can build a tokenizer (fast, SentencePiece, BPE, WordPiece,
# tiktoken); a directory with none of them cannot hold one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")  # SentencePiece and tiktoken names vary


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int | None
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(self, messages: Messages, add_generation_prompt: bool) -> str: ...

    def save_pretrained(self, directory: str) -> None: ...


class CharTokenizer:
    """Character-level tokenizer of the built-in tasks: 100 ids, fits ``ModelConfig.tiny``.

    Ids: 0 ``<pad>``, 1 ``<s>`` (BOS), 2 ``</s>`` (EOS), 3 ``<unk>``, then newline and the 95
    printable ASCII characters. Any other character encodes as ``<unk>``.
    """

    SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self) -> None:
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self._chars = {i: c for c, i in self._ids.items()}
        self.vocab_size = len(self.SPECIALS) + len(self.CHARS)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self.unk_id) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in self._chars:
                out.append(self._chars[i])
            elif not skip_special_tokens and 0 <= i < len(self.SPECIALS):
                out.append(self.SPECIALS[i])
        return "".join(out)

    def render_chat(self, messages: Messages, add_generation_prompt: bool) -> str:
        raise DataError("the built-in character tokenizer has no chat template")

    def save_pretrained(self, directory: str) -> None:
        """Write an equivalent ``tokenizer.json`` that ``AutoTokenizer`` loads."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as RawTokenizer
        from transformers import PreTrainedTokenizerFast

        vocab = {tok: i for i, tok in enumerate(self.SPECIALS)} | self._ids
        raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        raw.decoder = decoders.Fuse()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=raw,
            pad_token="<pad>",
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
        )
        fast.save_pretrained(directory)


class HFTokenizer:
    """A ``transformers`` tokenizer behind the :class:`Tokenizer` interface."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self.vocab_size = len(tokenizer)
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def save_pretrained(self, directory: str) -> None:
        self.hf.save_pretrained(directory)


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer of ``cfg``: built-in, or ``AutoTokenizer`` from a local directory.

    Raises:
      DataError: the path is not a directory, holds no tokenizer files, transformers cannot
        load it, or ``chat_template="always"`` and it has no template.
    """
    if cfg.path == "builtin":
        tok: Tokenizer = CharTokenizer()
    else:
        tok = HFTokenizer(_load_hf_tokenizer(cfg.path))
    if cfg.chat_template == "always" and not tok.has_chat_template:
        raise DataError(
            f"tokenizer.chat_template: 'always' but the tokenizer at {cfg.path} has no "
            "chat template"
        )
    return tok


def _load_hf_tokenizer(path: str) -> Any:
    if not os.path.isdir(path):
        raise DataError(
            f"tokenizer.path: {path} is not a directory (tokenizers load from local files only)"
        )
    found = sorted(os.listdir(path))
    if not any(name in TOKENIZER_FILES or name.endswith(TOKENIZER_SUFFIXES) for name in found):
        shown = found[:8] + (["..."] if len(found) > 8 else [])
        raise DataError(
            f"tokenizer.path: {path} holds no tokenizer files (expected "
            f"{', '.join(TOKENIZER_FILES)}, *.model or *.tiktoken; found {shown or 'nothing'}); "
            "save one there with AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types, often multi-line: report one line
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"tokenizer.path: cannot load a tokenizer from {path}: {reason}") from None


def uses_chat_template(cfg: TokenizerConfig, tok: Tokenizer) -> bool:
    """Whether records are rendered through the chat template."""
    return cfg.chat_template != "never" and tok.has_chat_template
