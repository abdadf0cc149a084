"""A small Hugging Face tokenizer with a chat template, built locally (nothing downloaded)."""

from __future__ import annotations

import json

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def make_chat_tokenizer(directory: str, chat_template: str | None = CHAT_TEMPLATE) -> str:
    """A character-level PreTrainedTokenizerFast with role markers as special tokens."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({c: i + len(SPECIALS) for i, c in enumerate(chars)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:],
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(directory)
    return directory


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)
