"""TextGenerator: text prompts in, completions out, from an exported checkpoint and its
tokenizer; greedy output equals a no-cache greedy loop over each prompt alone."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.data import CharTokenizer, DataError
from jaxrlhf.generation.text import TextGenerator, left_pad
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.models.safetensors_io import CheckpointError
from tests.data.fixtures import make_chat_tokenizer
from tests.generation.helpers import greedy_reference

PROMPTS = ["sort 31415:", "ab", "the quick brown fox"]  # three lengths; 2 batches of 2 rows
NEW = 6


def _export(directory, vocab_size: int, seed: int = 0) -> str:
    """A tiny random Llama (std-0.3 weights: no near-ties for greedy) saved as HF files."""
    cfg = ModelConfig.tiny("llama", vocab_size=vocab_size)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        scale = 0.1 if "norm" in jax.tree_util.keystr(path) else 0.3
        base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
        return jnp.asarray(base + scale * rng.standard_normal(leaf.shape), leaf.dtype)

    params = jax.tree_util.tree_map_with_path(draw, M.abstract_params(cfg))
    save_hf(str(directory), cfg, params)
    return str(directory)


@pytest.fixture(scope="module")
def char_export(tmp_path_factory):
    directory = _export(tmp_path_factory.mktemp("char"), CharTokenizer().vocab_size)
    CharTokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def generator(char_export):
    return TextGenerator(char_export, batch_size=2)


def _reference(generator, prompt: str, stop_ids=()) -> str:
    """Greedy with a full forward per step over the prompt alone (no padding, no cache),
    cut after the first stop token (the sampler keeps it in the response)."""
    tok = generator.tokenizer
    ids = np.array([[tok.bos_id, *tok.encode(prompt)]], np.int32)
    new = list(greedy_reference(generator.cfg, generator.params, ids, ids >= 0, NEW)[0])
    stops = [i for i, t in enumerate(new) if t in (tok.eos_id, *stop_ids)]
    return tok.decode(new[: stops[0] + 1] if stops else new)


@pytest.mark.slow
def test_greedy_equals_a_full_forward_loop(generator):
    completions = generator.generate(PROMPTS, max_new_tokens=NEW)
    expected = [_reference(generator, p) for p in PROMPTS]
    assert completions == expected
    assert any(completions)  # a random model still says something (not all EOS)


def test_stop_ids_from_generation_config(tmp_path, generator, char_export):
    """A stop id listed in generation_config.json ends the completion, stop token included."""
    first = generator.tokenizer.encode(_reference(generator, PROMPTS[0])[:1])[0]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(f"{char_export}/{name}", "rb").read())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, 2]}))
    stopping = TextGenerator(str(tmp_path), batch_size=1)
    assert stopping.stop_token_ids == (2, first)  # the tokenizer's EOS (2) first, no repeat
    completion = stopping.generate(PROMPTS[:1], max_new_tokens=NEW)[0]
    assert completion == _reference(generator, PROMPTS[0], stop_ids=(first,))
    assert len(completion) == 1


def test_sampling_is_seeded(generator):
    a = generator.generate(PROMPTS[:2], max_new_tokens=NEW, temperature=1.0, seed=1)
    assert a == generator.generate(PROMPTS[:2], max_new_tokens=NEW, temperature=1.0, seed=1)


def test_left_pad():
    tokens, mask = left_pad([[5, 6, 7], [8]], pad_id=0, rows=3, multiple=4)
    np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 8]])
    np.testing.assert_array_equal(mask, tokens > 0)
    with pytest.raises(ValueError, match="need 1 to 3 non-empty prompts"):
        left_pad([[1], []], pad_id=0, rows=3)


def test_chat_prompts_use_the_template(tmp_path):
    directory = make_chat_tokenizer(str(tmp_path))
    _export(tmp_path, vocab_size=104)  # 8 special tokens + 96 characters
    generator = TextGenerator(directory)
    messages = [{"role": "user", "content": "hi"}]
    ids = generator.encode(messages)
    assert generator.tokenizer.decode(ids, False) == "<s><|user|>hi<|end|><|assistant|>"
    assert generator.encode("hi") == ids  # text is a user turn


def test_errors(char_export, generator, tmp_path):
    with pytest.raises(ValueError, match=r"holds chat messages but the tokenizer \(.*\) has no"):
        generator.encode([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"\+ max_new_tokens 120 is over the model's "):
        generator.generate(PROMPTS, max_new_tokens=120)  # 20 + 120 > 128 positions
    small = _export(tmp_path / "small", vocab_size=64)
    CharTokenizer().save_pretrained(small)
    with pytest.raises(CheckpointError, match=r"the tokenizer has 100 tokens, more than the "):
        TextGenerator(small)
    with pytest.raises(DataError, match=r"holds no tokenizer files"):
        TextGenerator(_export(tmp_path / "bare", vocab_size=100))
