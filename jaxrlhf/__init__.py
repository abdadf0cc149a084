"""jaxrlhf: RLHF post-training of decoder-only LLMs in JAX/Flax.

Subpackages: ``models`` (transformer, heads, Hugging Face I/O), ``sharding`` (meshes, rules,
resharding, multi-host), ``losses`` (pure loss and advantage functions). Import what you need;
this module imports nothing heavy so ``import jaxrlhf.losses`` stays light.
"""

__version__ = "0.1.0"
