"""``--dry-run --json FILE``: the dry run's report as JSON, for scripts and dashboards.

The file holds one entry per stage (a single config is one stage)::

    {"version": 1,
     "stages": [
       {"source": "configs/tiny_grpo.yaml", "algorithm": "grpo", "model": "...",
        "compiler": "XLA:TPU v5e:2x2", "topology": "v5e:2x2", "device_kind": "TPU v5 lite",
        "mesh": {"data": 1, "fsdp": 4, "tensor": 1}, "devices": 4,
        "device_memory_bytes": 17179869184, "fits": true, "verdict": "fits: ...",
        "peak": {"phase": "generate", "program": "admit", "bytes": 3951616},
        "roles": [{"role": "policy", "params": 90432, "param_bytes": 90432, ...}],
        "programs": [
          {"phase": "train", "program": "update", "runs": 1.0, "compile_s": 6.8,
           "memory": {"argument_bytes": ..., "output_bytes": ..., "alias_bytes": ...,
                      "temp_bytes": ..., "resident_bytes": ..., "peak_bytes": ...,
                      "state_bytes": ..., "code_bytes": ..., "compiler_peak_bytes": ...},
           "cost": {"flops": ..., "bytes_accessed": ..., "collective_bytes": ...,
                    "collectives": [{"group_size": 4, "bytes": ...}]}}, ...],
        "notes": ["..."], "seconds": 22.1},
       {"source": "...", "error": "train/update does not compile: ..."}]}

Bytes are per device; ``memory`` is the compiler's memory analysis plus the dry run's
accounting (``dry_run_phases.ProgramMemory``: ``peak_bytes`` = arguments + outputs -
aliased + temporaries + resident); ``cost`` is the compiler's cost analysis of one run of
the program, loop bodies counted once, with the bytes each device sends in collectives
parsed from the compiled HLO (``program_cost.ProgramCost``); ``runs`` is how many times
that body runs per iteration. ``compiler_peak_bytes`` is the compiler's own peak figure
(XLA:TPU's also counts on-chip memory spaces), 0 where it has none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["VERSION", "error_entry", "read_stages", "report_entry", "write_report"]

VERSION = 1


def _program(p: Any) -> dict[str, Any]:
    """One ``ProgramMemory`` as JSON."""
    entry: dict[str, Any] = {
        "phase": p.phase,
        "program": p.name,
        "runs": p.runs,
        "compile_s": round(p.compile_s, 3),
        "memory": {
            "argument_bytes": p.argument_bytes,
            "output_bytes": p.output_bytes,
            "alias_bytes": p.alias_bytes,
            "temp_bytes": p.temp_bytes,
            "resident_bytes": p.resident_bytes,
            "peak_bytes": p.peak_bytes,
            "state_bytes": p.state_bytes,
            "code_bytes": p.code_bytes,
            "compiler_peak_bytes": p.compiler_peak_bytes,
        },
    }
    if p.group:
        entry["group"] = p.group
    if p.cost is not None:
        entry["cost"] = {
            "flops": p.cost.flops,
            "bytes_accessed": p.cost.bytes_accessed,
            "collective_bytes": p.cost.collective_bytes,
            "collectives": [{"group_size": g, "bytes": b} for g, b in p.cost.collectives],
        }
    return entry


def report_entry(report: Any) -> dict[str, Any]:
    """A ``dry_run.DryRunReport`` as one stage's JSON entry."""
    peak = report.peak
    return {
        "source": report.source,
        "algorithm": report.algorithm,
        "model": report.model,
        "compiler": report.compiler,
        "topology": report.topology,
        "device_kind": report.device_kind,
        "mesh": dict(report.mesh),
        "devices": report.devices,
        "shapes": report.shapes,
        "device_memory_bytes": report.device_memory,
        "device_label": report.device_label,
        "fits": report.fits,
        "verdict": report.reason(),
        "peak": {"phase": peak.phase, "program": peak.name, "bytes": peak.peak_bytes},
        "roles": [
            {
                "role": r.role,
                "head": r.head,
                "params": r.params,
                "param_bytes": r.param_bytes,
                "generate_bytes": r.generate_bytes,
                "optimizer_bytes": r.optimizer_bytes,
                "note": r.note,
            }
            for r in report.roles
        ],
        "programs": [_program(p) for p in report.programs],
        "notes": list(report.notes),
        "seconds": round(report.seconds, 3),
    }


def error_entry(source: str, message: str) -> dict[str, Any]:
    """The entry of a stage that could not be planned (a program that does not compile)."""
    return {"source": source, "error": message}


def write_report(path: str, stages: Sequence[dict[str, Any]]) -> None:
    """Writes the stages' entries to ``path`` (replaced whole)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"version": VERSION, "stages": list(stages)}, f, indent=1)
        f.write("\n")


def read_stages(path: str) -> list[dict[str, Any]]:
    """The stages' entries of a file :func:`write_report` wrote ([] when it is absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            return list(json.load(f).get("stages", []))
    except FileNotFoundError:
        return []
