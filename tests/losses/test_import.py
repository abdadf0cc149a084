"""``import jaxrlhf.losses`` stays light: no Flax, optax, torch, transformers or model code."""

import os
import subprocess
import sys
from pathlib import Path

import jaxrlhf.losses

REPO_ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("flax", "torch", "transformers", "optax", "jaxrlhf.models", "jaxrlhf.train")

_PROBE = """
import sys
import jaxrlhf.losses
forbidden = {forbidden!r}
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
print(",".join(loaded))
"""


def test_import_pulls_in_no_heavy_modules():
    # A fresh interpreter: this pytest process may already have imported flax via other tests.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(forbidden=FORBIDDEN)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env=env,
    )
    assert out.stdout.strip() == "", f"jaxrlhf.losses imported: {out.stdout.strip()}"


def test_every_public_name_is_exported_and_documented():
    docs = (REPO_ROOT / "docs" / "losses.md").read_text()
    for name in jaxrlhf.losses.__all__:
        obj = getattr(jaxrlhf.losses, name)
        if callable(obj) and not isinstance(obj, type):
            assert obj.__doc__, f"{name} has no docstring"
        assert f"`{name}" in docs, f"{name} missing from docs/losses.md"
