"""Tokenization and masks: the prompt/response boundary is exact for plain and templated
text, padding is right for training and left for generation, bad records are counted."""

from __future__ import annotations

import dataclasses

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

CFG = DataConfig(max_length=24, max_prompt_length=12, eval_size=0)


def _dataset(records, kind, tok=None, tok_cfg=None, cfg=CFG):
    tok = tok or CharTokenizer()
    tok_cfg = tok_cfg or TokenizerConfig()
    encoded = encode_records(records, kind, Encoder(tok, tok_cfg), cfg, "test")
    return TokenizedDataset.from_encoded(encoded, tok.pad_id), tok


def test_plain_text_sft_masks():
    ds, tok = _dataset([{"prompt": "sort 31:", "response": "13"}], "sft")
    batch = ds.batch(np.array([0]), 24)
    tokens, mask, prompt_mask, response_mask = (
        batch[k][0] for k in ("tokens", "mask", "prompt_mask", "response_mask")
    )
    # [BOS] s o r t ' ' 3 1 : | 1 3 [EOS] | padding
    assert tokens[0] == tok.bos_id and tokens[11] == tok.eos_id
    assert tok.decode(tokens[prompt_mask]) == "sort 31:"
    assert tok.decode(tokens[response_mask]) == "13"
    assert tokens[response_mask][-1] == tok.eos_id  # EOS is trained on
    np.testing.assert_array_equal(mask, np.arange(24) < 12)
    np.testing.assert_array_equal(prompt_mask, np.arange(24) < 9)
    np.testing.assert_array_equal(response_mask, (np.arange(24) >= 9) & (np.arange(24) < 12))
    assert (tokens[~mask] == tok.pad_id).all()
    assert batch["tokens"].dtype == np.int32 and batch["mask"].dtype == bool


def test_preference_pairs_share_the_prompt():
    ds, tok = _dataset([{"prompt": "sort 21:", "chosen": "12", "rejected": "211"}], "preference")
    batch = ds.batch(np.array([0, -1]), 24)
    assert batch["tokens"].shape == (2, 2, 24)
    chosen, rejected = batch["tokens"][0]
    np.testing.assert_array_equal(batch["prompt_mask"][0, 0], batch["prompt_mask"][0, 1])
    assert tok.decode(chosen[batch["response_mask"][0, 0]]) == "12"
    assert tok.decode(rejected[batch["response_mask"][0, 1]]) == "211"
    assert not batch["mask"][1].any()  # row -1 is padding


def test_prompt_batches_are_left_padded():
    ds, tok = _dataset([{"prompt": "ab"}, {"prompt": "abcd"}], "prompt")
    batch = ds.batch(np.array([0, 1]), 8)
    np.testing.assert_array_equal(batch["mask"][0], np.arange(8) >= 5)  # BOS a b
    np.testing.assert_array_equal(batch["mask"][1], np.arange(8) >= 3)
    assert tok.decode(batch["tokens"][1]) == "abcd"
    assert batch["mask"][:, -1].all()  # every prompt ends at the last column


def test_chat_template_masks(tmp_path):
    tok_cfg = TokenizerConfig(path=make_chat_tokenizer(str(tmp_path)))
    tok = load_tokenizer(tok_cfg)
    records = [
        {"prompt": "hi", "response": "yo"},
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}],
            "response": [{"role": "assistant", "content": "a"}],
        },
    ]
    ds, _ = _dataset(records, "sft", tok, tok_cfg, DataConfig(max_length=64, max_prompt_length=40))
    batch = ds.batch(np.array([0, 1]), 64)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    t, pm, rm = batch["tokens"], batch["prompt_mask"], batch["response_mask"]
    assert decode(t[0][pm[0]]) == "<s><|user|>hi<|end|><|assistant|>"
    assert decode(t[0][rm[0]]) == "yo<|end|>"  # the turn's end marker is trained on, no EOS
    assert decode(t[1][pm[1]]) == "<s><|system|>be brief<|end|><|user|>q<|end|><|assistant|>"
    assert decode(t[1][rm[1]]) == "a<|end|>"
    # The prompt part is exactly what the template renders for generation.
    rendered = tok.render_chat([{"role": "user", "content": "hi"}], True)
    assert list(t[0][pm[0]]) == tok.encode(rendered)


def test_never_template_uses_plain_text(tmp_path):
    tok_cfg = TokenizerConfig(path=make_chat_tokenizer(str(tmp_path)), chat_template="never")
    tok = load_tokenizer(tok_cfg)
    ds, _ = _dataset([{"prompt": "hi", "response": "yo"}], "sft", tok, tok_cfg)
    batch = ds.batch(np.array([0]), 24)
    assert tok.decode(batch["tokens"][0][batch["response_mask"][0]], False) == "yo</s>"


def test_template_required_but_absent(tmp_path):
    path = make_chat_tokenizer(str(tmp_path), chat_template=None)
    with pytest.raises(DataError, match=r"'always' but the tokenizer at .* has no chat template"):
        load_tokenizer(TokenizerConfig(path=path, chat_template="always"))


def test_bad_records_are_counted_by_reason():
    records = [
        {"prompt": "sort 1:", "response": "1"},
        {"prompt": "sort 1:"},
        {"prompt": "", "response": "1"},
        {"prompt": "sort 1:", "response": 3},
        {"prompt": "x" * 20, "response": "1"},  # prompt over max_prompt_length
        {"prompt": "sort 1:", "response": "1" * 20},  # prompt + response over max_length
    ]
    ds, _ = _dataset(records, "sft")
    assert len(ds) == 1
    assert ds.report.summary() == (
        "test: 1 of 6 records kept; 5 bad (1 missing field 'response', 1 empty text in "
        "'prompt', 1 field 'response' is neither text nor chat messages, 1 prompt longer than "
        "max_prompt_length, 1 prompt + response longer than max_length)"
    )


def test_truncate_policy_keeps_prompt_end_and_response_start():
    cfg = DataConfig(max_length=12, max_prompt_length=6, truncation="truncate", eval_size=0)
    ds, tok = _dataset([{"prompt": "abcdefghij", "response": "0123456789"}], "sft", cfg=cfg)
    batch = ds.batch(np.array([0]), 12)
    assert tok.decode(batch["tokens"][0][batch["prompt_mask"][0]]) == "efghij"
    assert tok.decode(batch["tokens"][0][batch["response_mask"][0]]) == "012345"  # EOS cut off
    assert batch["mask"][0].all()


def test_truncate_policy_drops_pairs_made_equal():
    """Cut to their first 2 tokens, "12345" and "12399" are the same: no preference left."""
    cfg = DataConfig(max_length=8, max_prompt_length=6, truncation="truncate", eval_size=0)
    records = [
        {"prompt": "sort 1:", "chosen": "12345", "rejected": "12399"},  # BOS + 7 > 6: cut
        {"prompt": "p:", "chosen": "12345", "rejected": "12399"},  # BOS + 2 = 3, room 5
    ]
    ds, tok = _dataset(records, "preference", cfg=cfg)
    assert ds.report.summary() == (
        "test: 1 of 2 records kept; 1 bad (1 chosen and rejected are the same tokens)"
    )
    batch = ds.batch(np.array([0]), 8)
    chosen, rejected = (batch["tokens"][0, j][batch["response_mask"][0, j]] for j in (0, 1))
    assert (tok.decode(chosen), tok.decode(rejected)) == ("12345", "12399")


def _mostly_too_long(tmp_path, n_long: int, n: int = 1000) -> str:
    records = [{"prompt": "p", "response": "x" * (30 if i < n_long else 3)} for i in range(n)]
    return write_jsonl(tmp_path / "d.jsonl", records)


def test_mostly_dropped_data_fails(tmp_path):
    path = _mostly_too_long(tmp_path, 990)
    tok_cfg = TokenizerConfig()
    cfg = DataConfig(train=path, eval_size=0, max_length=16, max_prompt_length=8)
    with pytest.raises(DataError) as e:
        load_datasets("sft", cfg, load_tokenizer(tok_cfg), tok_cfg)
    assert str(e.value) == (
        f"{path}: 10 of 1000 records kept; 990 bad (990 prompt + response longer than "
        "max_length): 99% dropped, above data.drop_error_fraction=0.5; raise data.max_length / "
        "data.max_prompt_length or set data.truncation: truncate (or raise "
        "data.drop_error_fraction to train on what is left)"
    )
    accepted = dataclasses.replace(cfg, drop_error_fraction=1.0)
    train, _ = load_datasets("sft", accepted, load_tokenizer(tok_cfg), tok_cfg)
    assert len(train) == 10


@pytest.mark.parametrize("n_long, level", [(100, "WARNING"), (50, "WARNING"), (0, "INFO")])
def test_dropped_fraction_sets_the_log_level(tmp_path, caplog, n_long, level):
    """10% dropped is above the 5% warning threshold; 5% is not (the bound is strict)."""
    path = _mostly_too_long(tmp_path, n_long)
    tok_cfg = TokenizerConfig()
    cfg = DataConfig(train=path, eval_size=0, max_length=16, max_prompt_length=8)
    with caplog.at_level("INFO", logger="jaxrlhf.data"):
        load_datasets("sft", cfg, load_tokenizer(tok_cfg), tok_cfg)
    (record,) = [r for r in caplog.records if r.name == "jaxrlhf.data.dataset"]
    loud = record.getMessage().startswith("WARNING data: ")
    assert loud == (n_long == 100)
    assert record.levelname == level
    if loud:
        assert "10% of the records dropped, above data.drop_warn_fraction=0.05" in (
            record.getMessage()
        )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"drop_warn_fraction": -0.1}, "drop_warn_fraction: must be in [0, 1], got -0.1"),
        ({"drop_error_fraction": 1.5}, "drop_error_fraction: must be in [0, 1], got 1.5"),
        (
            {"drop_warn_fraction": 0.6},
            "drop_warn_fraction: 0.6 is above drop_error_fraction 0.5",
        ),
    ],
)
def test_drop_thresholds_are_validated(fields, message):
    with pytest.raises(ValueError) as e:
        DataConfig(**fields)
    assert str(e.value) == message


def test_load_datasets_holds_out_a_seeded_split(tmp_path):
    records = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    tok_cfg = TokenizerConfig()
    tok = load_tokenizer(tok_cfg)
    cfg = DataConfig(train=path, eval_size=5, max_length=16, max_prompt_length=8)
    train, held_out = load_datasets("sft", cfg, tok, tok_cfg)
    assert (len(train), len(held_out)) == (15, 5)
    seen = {r["prompt"] for r in train.records} | {r["prompt"] for r in held_out.records}
    assert len(seen) == 20
    again, _ = load_datasets("sft", cfg, tok, tok_cfg)
    assert again.records == train.records
    other, _ = load_datasets(
        "sft",
        DataConfig(train=path, eval_size=5, max_length=16, max_prompt_length=8, seed=1),
        tok,
        tok_cfg,
    )
    assert other.records != train.records


def test_explicit_eval_file(tmp_path):
    tok_cfg = TokenizerConfig()
    train_path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "response": "b"}] * 4)
    eval_path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "c", "response": "d"}] * 2)
    cfg = DataConfig(train=train_path, eval=eval_path, max_length=16, max_prompt_length=8)
    train, held_out = load_datasets("sft", cfg, load_tokenizer(tok_cfg), tok_cfg)
    assert (len(train), len(held_out)) == (4, 2)


def test_hf_chat_template_renders(tmp_path):
    """The template of a local tokenizer renders through transformers (which needs jinja2)."""
    tok = load_tokenizer(TokenizerConfig(path=make_chat_tokenizer(str(tmp_path))))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q?"}]
    # fixtures.CHAT_TEMPLATE: bos, then <|role|>content<|end|> per turn, then <|assistant|>.
    assert tok.render_chat(messages, True) == (
        "<s><|system|>be brief<|end|><|user|>q?<|end|><|assistant|>"
    )
    assert tok.render_chat(messages, False) == "<s><|system|>be brief<|end|><|user|>q?<|end|>"
