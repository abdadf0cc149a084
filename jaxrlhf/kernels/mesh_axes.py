"""Mesh axis names of a ``PartitionSpec`` entry and back, for the kernels' partitioning
rules (``custom_partitioning`` hands them each operand's sharding)."""

from __future__ import annotations


def entry_names(entry: object) -> tuple[str, ...]:
    """The mesh axes one dimension's spec entry names: ``None`` -> (), ``"x"`` -> ("x",),
    ``("x", "y")`` -> ("x", "y")."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_entry(names: tuple[str, ...]) -> object:
    """The spec entry for a dimension split over ``names``, the inverse of
    :func:`entry_names`."""
    return None if not names else names[0] if len(names) == 1 else names
