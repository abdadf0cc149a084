"""Prompt and preference datasets, tokenizers, chat templates and built-in tasks.

Typical use::

    from jaxrlhf import data

    tok = data.load_tokenizer(data.TokenizerConfig(path="builtin"))
    train, held_out = data.load_datasets("preference", data.DataConfig(max_length=32,
        max_prompt_length=16), tok, data.TokenizerConfig())
    batches = data.BatchIterator(train, batch_size=32, length=32, seed=0)
    batch = next(batches)  # numpy: tokens/mask/prompt_mask/response_mask [32, 2, 32]
"""

from jaxrlhf.data.config import (
    CHAT_TEMPLATE_MODES,
    TRUNCATION_POLICIES,
    DataConfig,
    TokenizerConfig,
)
from jaxrlhf.data.dataset import (
    KINDS,
    Batch,
    BatchIterator,
    IteratorState,
    TokenizedDataset,
    eval_batches,
    load_datasets,
)
from jaxrlhf.data.errors import DataError
from jaxrlhf.data.examples import DataReport, Encoder, encode_records
from jaxrlhf.data.sources import read_jsonl, read_records
from jaxrlhf.data.tasks import BUILTIN_TASKS, builtin_records, make_problem, perturb
from jaxrlhf.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    uses_chat_template,
)

__all__ = [
    "BUILTIN_TASKS",
    "CHAT_TEMPLATE_MODES",
    "KINDS",
    "TRUNCATION_POLICIES",
    "Batch",
    "BatchIterator",
    "CharTokenizer",
    "DataConfig",
    "DataError",
    "DataReport",
    "Encoder",
    "HFTokenizer",
    "IteratorState",
    "TokenizedDataset",
    "Tokenizer",
    "TokenizerConfig",
    "builtin_records",
    "encode_records",
    "eval_batches",
    "load_datasets",
    "load_tokenizer",
    "make_problem",
    "perturb",
    "read_jsonl",
    "read_records",
    "uses_chat_template",
]
