"""Importing jaxrlhf and transformers without torch prints nothing about torch."""

from __future__ import annotations

import subprocess
import sys

# torch is hidden as it is on a fresh install without the test extras: a None entry in
# sys.modules makes importlib.util.find_spec("torch") return None.
_SCRIPT = """
import sys
sys.modules["torch"] = None
{first}
import transformers
from transformers import PreTrainedTokenizerFast
print("imported")
"""


def _stderr(first: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(first=first)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "imported"
    return done.stderr


def test_no_pytorch_not_found_warning():
    # Without jaxrlhf the warning is there: the test sees the case it is about.
    assert "PyTorch was not found" in _stderr("")
    assert "PyTorch was not found" not in _stderr("import jaxrlhf")


def test_other_transformers_warnings_still_show():
    stderr = _stderr(
        "import jaxrlhf\n"
        "from transformers.utils import logging\n"
        "logging.get_logger('transformers').warning('something else')"
    )
    assert "something else" in stderr
