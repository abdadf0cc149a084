"""KV-cached sampling: prompt prefill, a jitted decode loop, exact log-probs.

    from jaxrlhf.generation import Sampler, SamplingParams

    sampler = Sampler(cfg, mesh)
    params, stats = sampler.to_generate_layout(train_params)
    out = sampler.generate(params, prompt_tokens, prompt_mask, key,
                           SamplingParams(temperature=1.0, max_new_tokens=128, n=4))

See ``sampler.py`` for the loop (scan vs while_loop), ``cache.py`` for the cache layout and
``sampling.py`` for the sampling rules and what each log-prob means. For text in and text
out from an exported checkpoint and its tokenizer, see
``jaxrlhf.generation.text.TextGenerator`` (not imported here: it needs the data and
checkpoint modules).
"""

from jaxrlhf.generation.cache import DecodeCache, abstract_cache
from jaxrlhf.generation.params import SamplingParams, SamplingStatics
from jaxrlhf.generation.sampler import (
    LOOPS,
    SampleOutput,
    Sampler,
    SamplerState,
    decode_loop,
    finalize,
    init_state,
)
from jaxrlhf.generation.sampling import (
    draw_uniforms,
    next_tokens,
    sample_from_logits,
    truncate,
)

__all__ = [
    "LOOPS",
    "DecodeCache",
    "SampleOutput",
    "Sampler",
    "SamplerState",
    "SamplingParams",
    "SamplingStatics",
    "abstract_cache",
    "decode_loop",
    "draw_uniforms",
    "finalize",
    "init_state",
    "next_tokens",
    "sample_from_logits",
    "truncate",
]
