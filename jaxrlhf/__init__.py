"""jaxrlhf: RLHF post-training of decoder-only LLMs in JAX/Flax.

Subpackages: ``models`` (transformer, heads, Hugging Face I/O), ``sharding`` (meshes, rules,
resharding, multi-host), ``losses`` (pure loss and advantage functions). Import what you need;
this module imports nothing heavy so ``import jaxrlhf.losses`` stays light.
"""

import logging as _logging

__version__ = "0.1.0"


class _DropTorchNotFound(_logging.Filter):
    """Drops transformers' "PyTorch was not found" warning, which it logs on import when
    torch is absent. jaxrlhf uses only its tokenizers and config classes, which need no
    torch, so on every run the warning would only mislead; other records pass."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found.")


# A filter on transformers' library logger, where that record is created; it is installed
# before transformers is imported (this package's modules import it lazily).
_logging.getLogger("transformers").addFilter(_DropTorchNotFound())
