"""Parameter lists split between the tiers (tests/conftest.py): the cases of a parametrized
test that cover one path in several sizes, families or meshes run in the full tier, and a
chosen few of them in the default tier too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def tiered(values: Iterable[Any], default: Iterable[Any], *, single: bool = False) -> list[Any]:
    """``values`` as ``pytest.param``s, each of those not in ``default`` marked ``slow``.

    A tuple value is one case of several argument names (``pytest.param(*value)``), unless
    ``single``: the test takes one argument whose values are tuples.

    Raises:
      ValueError: a ``default`` value that is not among ``values`` (a renamed case would
        otherwise quietly leave the default tier).
    """
    values, default = list(values), list(default)
    missing = [v for v in default if v not in values]
    if missing:
        raise ValueError(f"default-tier cases {missing} are not among {values}")
    cases = []
    for v in values:
        args = v if isinstance(v, tuple) and not single else (v,)
        marks = () if v in default else (pytest.mark.slow,)
        cases.append(pytest.param(*args, marks=marks))
    return cases
