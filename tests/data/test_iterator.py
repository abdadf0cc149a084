"""Deterministic shuffling, epochs, and exact resume from a saved iterator state."""

from __future__ import annotations

import json

import pytest

from jaxrlhf.data import (
    BatchIterator,
    CharTokenizer,
    DataConfig,
    DataError,
    Encoder,
    TokenizedDataset,
    TokenizerConfig,
    encode_records,
    eval_batches,
)


def _dataset(n=10):
    tok = CharTokenizer()
    records = [{"prompt": f"p{i:02d}", "response": str(i % 10)} for i in range(n)]
    cfg = DataConfig(max_length=16, max_prompt_length=8)
    return TokenizedDataset.from_encoded(
        encode_records(records, "sft", Encoder(tok, TokenizerConfig()), cfg, "t"), tok.pad_id
    )


def _ids(batch):
    """Which examples a batch holds (the digits of each prompt)."""
    tok = CharTokenizer()
    rows = zip(batch["tokens"], batch["prompt_mask"], strict=True)
    return [int(tok.decode(row[m])[1:]) for row, m in rows]


def test_epochs_cover_every_example_once_and_reshuffle():
    it = BatchIterator(_dataset(10), batch_size=3, length=16, seed=0)
    epoch0 = sum((_ids(next(it)) for _ in range(3)), [])  # 3 batches; 1 example waits
    assert len(set(epoch0)) == 9
    assert it.state() == {"epoch": 0, "position": 3, "seed": 0}
    epoch1 = sum((_ids(next(it)) for _ in range(3)), [])
    assert it.state() == {"epoch": 1, "position": 3, "seed": 0}
    assert epoch1 != epoch0


def test_same_seed_same_order_other_seed_other_order():
    a = BatchIterator(_dataset(), 4, 16, seed=1)
    b = BatchIterator(_dataset(), 4, 16, seed=1)
    c = BatchIterator(_dataset(), 4, 16, seed=2)
    seq = lambda it: [_ids(next(it)) for _ in range(5)]  # noqa: E731
    first = seq(a)
    assert first == seq(b)
    assert first != seq(c)


def test_no_shuffle_is_file_order():
    it = BatchIterator(_dataset(), 5, 16, seed=0, shuffle=False)
    assert _ids(next(it)) == [0, 1, 2, 3, 4]


def test_state_restores_exactly():
    it = BatchIterator(_dataset(), 3, 16, seed=5)
    for _ in range(4):  # into the second epoch
        next(it)
    saved = json.loads(json.dumps(it.state()))
    expected = [_ids(next(it)) for _ in range(6)]
    fresh = BatchIterator(_dataset(), 3, 16, seed=123)
    fresh.restore(saved)
    assert [_ids(next(fresh)) for _ in range(6)] == expected


def test_eval_batches_pad_the_last_batch():
    batches = list(eval_batches(_dataset(10), 4, 16))
    assert len(batches) == 3
    assert batches[-1]["mask"][:2].any(-1).all() and not batches[-1]["mask"][2:].any()
    real = [{k: v[b["mask"].any(-1)] for k, v in b.items()} for b in batches]
    assert [i for b in real for i in _ids(b)] == list(range(10))


def test_fewer_examples_than_a_batch():
    with pytest.raises(DataError, match=r"t: 10 usable examples, fewer than one batch of 16"):
        BatchIterator(_dataset(10), 16, 16)


def test_a_too_small_dataset_names_the_batch_setting():
    match = r"t: 10 usable examples, fewer than one batch of 16 \(grpo.rollout.prompts_per_step\)"
    with pytest.raises(DataError, match=match):
        BatchIterator(_dataset(10), 16, 16, batch_from="grpo.rollout.prompts_per_step")
