"""TRL's conversational records (``messages``; ``chosen`` / ``rejected`` conversations with
an implicit prompt) go through the chat template, split at the last assistant turn.

Expected texts follow ``tests.data.fixtures.CHAT_TEMPLATE``: ``<s>``, then
``<|role|>content<|end|>`` per turn, then ``<|assistant|>`` for the generation prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrlhf.data import (
    CharTokenizer,
    DataConfig,
    DataError,
    Encoder,
    TokenizedDataset,
    TokenizerConfig,
    encode_records,
    load_datasets,
    load_tokenizer,
)
from tests.data.fixtures import make_chat_tokenizer, write_jsonl

CFG = DataConfig(max_length=96, max_prompt_length=64, eval_size=0)
SYSTEM = {"role": "system", "content": "be brief"}


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    tok_cfg = TokenizerConfig(path=make_chat_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    return load_tokenizer(tok_cfg), tok_cfg


def _encode(records, kind, tok, tok_cfg, cfg=CFG):
    encoded = encode_records(records, kind, Encoder(tok, tok_cfg), cfg, "test")
    return TokenizedDataset.from_encoded(encoded, tok.pad_id)


def _parts(ds, tok, row, pair=None):
    """The decoded (prompt, response) of one training row (pair index for preference)."""
    batch = ds.batch(np.array([row]), CFG.max_length)
    t, pm, rm = (batch[k][0] for k in ("tokens", "prompt_mask", "response_mask"))
    if pair is not None:
        t, pm, rm = t[pair], pm[pair], rm[pair]
    return tok.decode(t[pm], False), tok.decode(t[rm], False)


def test_sft_messages_split_at_the_last_assistant_turn(chat):
    tok, tok_cfg = chat
    records = [
        {"messages": [SYSTEM, _user("q"), _assistant("a")]},
        {"messages": [_user("1+1?"), _assistant("2"), _user("and 2+2?"), _assistant("4")]},
    ]
    ds = _encode(records, "sft", tok, tok_cfg)
    assert _parts(ds, tok, 0) == (
        "<s><|system|>be brief<|end|><|user|>q<|end|><|assistant|>",
        "a<|end|>",
    )
    # Earlier assistant turns are part of the prompt; only the last one is trained on.
    assert _parts(ds, tok, 1) == (
        "<s><|user|>1+1?<|end|><|assistant|>2<|end|><|user|>and 2+2?<|end|><|assistant|>",
        "4<|end|>",
    )


def test_preference_conversations_with_an_implicit_prompt(chat):
    tok, tok_cfg = chat
    record = {
        "chosen": [_user("sky?"), _assistant("blue")],
        "rejected": [_user("sky?"), _assistant("green")],
    }
    ds = _encode([record], "preference", tok, tok_cfg)
    prompt = "<s><|user|>sky?<|end|><|assistant|>"
    assert _parts(ds, tok, 0, pair=0) == (prompt, "blue<|end|>")
    assert _parts(ds, tok, 0, pair=1) == (prompt, "green<|end|>")


def test_prompt_messages_leave_out_a_final_assistant_turn(chat):
    tok, tok_cfg = chat
    records = [{"messages": [_user("q"), _assistant("reference")]}, {"messages": [_user("q")]}]
    ds = _encode(records, "prompt", tok, tok_cfg)
    batch = ds.batch(np.array([0, 1]), 32)
    for row in range(2):
        ids = batch["tokens"][row][batch["mask"][row]]
        assert tok.decode(ids, False) == "<s><|user|>q<|end|><|assistant|>"


def test_bad_conversations_are_counted_by_reason(chat):
    tok, tok_cfg = chat
    sft = [
        {"messages": [_user("q")]},  # no assistant turn to train on
        {"messages": [_assistant("a")]},  # nothing before it
        {"messages": "q"},
        {"text": "q"},
    ]
    ds = _encode(sft + [{"messages": [_user("q"), _assistant("a")]}], "sft", tok, tok_cfg)
    assert ds.report.summary() == (
        "test: 1 of 5 records kept; 4 bad (1 field 'messages' does not end with an assistant "
        "turn, 1 field 'messages' has no turn before the assistant's, 1 field 'messages' is "
        "text, not chat messages, 1 missing field 'prompt' (or 'messages'))"
    )
    preference = [
        {"chosen": [_user("a"), _assistant("x")], "rejected": [_user("b"), _assistant("y")]},
        {"chosen": [_user("a"), _assistant("x")], "rejected": [_user("a"), _user("y")]},
        {"chosen": "x", "rejected": "y"},
    ]
    ds = _encode(
        preference + [{"prompt": "p", "chosen": "x", "rejected": "y"}], "preference", tok, tok_cfg
    )
    assert ds.report.summary() == (
        "test: 1 of 4 records kept; 3 bad (1 'chosen' and 'rejected' are not one conversation "
        "differing only in its last turn, 1 'chosen' or 'rejected' ends with no assistant "
        "turn, 1 missing field 'prompt')"
    )


@pytest.mark.parametrize(
    "record",
    [
        {"messages": [_user("q"), _assistant("a")]},
        {"prompt": [_user("q")], "response": "a"},
    ],
)
def test_messages_without_a_template_are_an_error(record):
    with pytest.raises(DataError) as e:
        _encode(
            [{"prompt": "fine", "response": "ok"}, record],
            "sft",
            CharTokenizer(),
            TokenizerConfig(),
        )
    key = "messages" if "messages" in record else "prompt"
    assert str(e.value) == (
        f"test: record 2: {key!r} holds chat messages but the tokenizer (builtin) has no chat "
        "template: set tokenizer.path to a tokenizer with a chat template, or give plain-text "
        "prompt and response fields"
    )


def test_messages_with_template_never_are_an_error(chat):
    tok, tok_cfg = chat
    never = TokenizerConfig(path=tok_cfg.path, chat_template="never")
    with pytest.raises(
        DataError,
        match=r"^test: record 1: 'chosen' holds chat messages but "
        r"tokenizer.chat_template is 'never': ",
    ):
        _encode(
            [{"chosen": [_user("a"), _assistant("x")], "rejected": [_user("a"), _assistant("y")]}],
            "preference",
            tok,
            never,
        )


def test_messages_jsonl_through_load_datasets(chat, tmp_path):
    tok, tok_cfg = chat
    records = [{"conv": [_user(f"q{i}"), _assistant(f"a{i}")]} for i in range(4)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(
        train=path, eval_size=0, max_length=64, max_prompt_length=32, messages_key="conv"
    )
    train, _ = load_datasets("sft", cfg, tok, tok_cfg)
    assert len(train) == 4
    assert [tok.decode(r[0], False) for r in train.responses] == [f"a{i}<|end|>" for i in range(4)]
