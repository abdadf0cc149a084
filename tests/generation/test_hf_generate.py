"""Greedy decoding equals transformers' ``generate`` on the same safetensors weights.

Tiny random HF models (tests/models/hf_fixtures.py), a left-padded batch with an explicit
attention mask (HF derives position ids from it), no EOS stop. Token equality is exact:
both sides compute in float32, so logits differ by summation-order rounding (~1e-6), far
below the gaps between the top tokens of these models.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.models.hf_checkpoint import load_hf
from tests.generation.helpers import prompts
from tests.models.hf_fixtures import FAMILY_CASES, make_hf_model
from tests.tiers import tiered

torch = pytest.importorskip("torch")
NEW = 8


# Every family; the llama3 RoPE-scaling case is left to the model parity tests (decode uses
# the same RoPE function as the model).
@pytest.mark.parametrize(
    "case",
    tiered(sorted(set(FAMILY_CASES) - {"llama3"}), ["llama", "gpt2", "gemma2", "qwen3_moe"]),
)
def test_greedy_equals_transformers_generate(case, tmp_path):
    hf_model = make_hf_model(case, seed=3)
    hf_model.save_pretrained(tmp_path)
    cfg, params = load_hf(str(tmp_path))
    tokens, mask = prompts(cfg.vocab_size, lengths=(7, 4, 2), total=7, seed=3)
    with torch.no_grad():
        expected = hf_model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            eos_token_id=None,
            pad_token_id=0,
        )[:, tokens.shape[1] :].numpy()
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    out = Sampler(cfg).generate(params, tokens, mask, jax.random.key(0), sp)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
