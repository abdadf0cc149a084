"""``docs/configuration.md``, generated from the config dataclasses so that it cannot drift.

    python -m jaxrlhf.config_docs            # print the page
    python -m jaxrlhf.config_docs --write    # rewrite docs/configuration.md in this checkout

Walks :class:`jaxrlhf.config.RunConfig` section by section (nested sections such as
``ppo.rollout`` included) and lists every field with its type, its default (read from a
default instance, so subclass defaults such as GRPO's ``kl_coef`` are right) and its
description, taken from the ``Attributes:`` section of the class's Google-style docstring
(searched along the MRO), else from a ``# comment`` on the field's line, else from
``_FALLBACK`` below. ``tests/test_docs.py`` fails when the committed page differs from the
output, and when any field ends up without a description.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jaxrlhf import config as config_lib
from jaxrlhf.models import config as model_config

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
COMMAND = "python -m jaxrlhf.config_docs --write"

# Descriptions for fields whose class documents them nowhere (no Attributes entry, no
# comment). Better moved into the classes' docstrings; the tests check that every key names
# a real field, so this table cannot go stale silently.
_FALLBACK: Mapping[tuple[type, str], str] = {
    (config_lib.RunConfig, "algorithm"): "what to train: one of {algorithms}.",
    (config_lib.RunConfig, "output_dir"): (
        "the run directory (resolved config, metrics, checkpoints, ``hf/`` export); "
        "null: ``runs/<config file name>``."
    ),
    (model_config.ModelConfig, "family"): "architecture family: one of {families}.",
    (model_config.ModelConfig, "vocab_size"): "V, token vocabulary size.",
    (model_config.ModelConfig, "hidden_size"): "D, model width.",
    (model_config.ModelConfig, "intermediate_size"): "F, feed-forward width.",
    (model_config.ModelConfig, "num_layers"): "L, decoder layers.",
    (model_config.ModelConfig, "num_heads"): "N, query heads.",
    (model_config.ModelConfig, "max_position_embeddings"): "longest sequence the model takes.",
    (model_config.ModelConfig, "norm_type"): "one of {norm_types}.",
    (model_config.ModelConfig, "norm_eps"): "epsilon of the normalisation layers.",
    (model_config.ModelConfig, "activation"): "MLP activation: one of {activations}.",
    (model_config.ModelConfig, "position_embedding"): "one of {position_types}.",
    (model_config.ModelConfig, "rope_theta"): "RoPE base frequency.",
    (model_config.ModelConfig, "rope_scaling"): (
        "RoPE frequency scaling ``{{type, factor, ...}}``, type one of {rope_scaling_types}; "
        "null: none."
    ),
    (model_config.ModelConfig, "qkv_bias"): "biases on the q/k/v projections (Qwen2).",
    (model_config.ModelConfig, "mlp_bias"): "biases on the MLP projections.",
    (model_config.ModelConfig, "tie_embeddings"): "the LM head reuses the embedding matrix.",
    (model_config.ModelConfig, "param_dtype"): (
        "storage dtype of the weights: one of {dtypes}. Trained weights are float32 masters "
        "computed in ``dtype`` (e.g. ``param_dtype: float32, dtype: bfloat16``); a run "
        "refuses trained ``bfloat16`` weights unless ``optimizer.stochastic_rounding`` is "
        "set (AdamW steps far below a bfloat16 weight's spacing round away), and "
        "``float16`` ones always. A LoRA run trains float32 adapters, so its frozen base "
        "may be ``bfloat16``."
    ),
    (model_config.ModelConfig, "remat"): "activation rematerialisation: one of {remat}.",
    (model_config.ModelConfig, "attention_impl"): (
        "attention kernel: one of {attention_impls} (cudnn: GPU, bf16/fp16)."
    ),
    (model_config.ModelConfig, "layer_loop"): (
        "how the layer stack runs: one of {layer_loops} (auto: unrolled up to 16 layers, "
        "a scan above: compile time stays flat with depth)."
    ),
    (model_config.ModelConfig, "initializer_range"): "std of the random initialisation.",
    (model_config.ModelConfig, "bos_token_id"): "beginning-of-sequence token id.",
    (model_config.ModelConfig, "eos_token_id"): "end-of-sequence token id.",
    (model_config.ModelConfig, "pad_token_id"): "padding token id.",
}


def _choices(values: tuple) -> str:
    return ", ".join(f"``{v}``" for v in values)


_FORMAT_ARGS = {
    "algorithms": _choices(config_lib.ALGORITHMS),
    "families": _choices(model_config.FAMILIES),
    "norm_types": _choices(model_config.NORM_TYPES),
    "activations": _choices(model_config.ACTIVATIONS),
    "position_types": _choices(model_config.POSITION_TYPES),
    "rope_scaling_types": _choices(model_config.ROPE_SCALING_TYPES),
    "dtypes": _choices(model_config.DTYPES),
    "remat": _choices(model_config.REMAT_POLICIES),
    "attention_impls": _choices(model_config.ATTENTION_IMPLS),
    "layer_loops": _choices(model_config.LAYER_LOOPS),
}

# The ModelConfig fields of the model section are overrides on top of the preset or the
# checkpoint's config.json; ``family`` is a ModelSpec key there, ``overrides`` no YAML key.
_MODEL_SPEC_SKIP = ("overrides",)

_ENTRY = re.compile(r"^([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*): (.*)$")


@dataclasses.dataclass(frozen=True)
class Field:
    """One documented config field.

    Attributes:
      path: dotted YAML path, e.g. ``ppo.rollout.num_samples``.
      type: the annotation in YAML words (``int``, ``str or null``, ...).
      default: the default in YAML syntax, or ``required`` / ``from the preset``.
      description: one paragraph of text.
    """

    path: str
    type: str
    default: str
    description: str


@dataclasses.dataclass(frozen=True)
class Section:
    """A config section: its dotted path, the class, a one-line summary and its fields."""

    path: str
    cls: type
    summary: str
    fields: tuple[Field, ...]


def docstring_attributes(cls: type) -> dict[str, str]:
    """Field descriptions from the ``Attributes:`` sections along ``cls``'s MRO.

    Entries may name several fields (``b1, b2, eps: Adam moments.``); continuation lines are
    indented deeper than the entry. A subclass's entry wins over its base's.
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = klass.__dict__.get("__doc__")
        if doc:
            out.update(_parse_attributes(inspect.cleandoc(doc)))
    return out


def _parse_attributes(doc: str) -> dict[str, str]:
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    entries: list[tuple[list[str], list[str]]] = []
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        m = _ENTRY.match(line.strip()) if depth == indent else None
        if m:
            entries.append((m.group(1).split(", "), [m.group(2)]))
        elif depth > indent and entries:
            entries[-1][1].append(line.strip())
        else:
            break
    return {name: " ".join(text) for names, text in entries for name in names}


def inline_comments(cls: type) -> dict[str, str]:
    """``field: type = default  # comment`` comments in ``cls``'s own source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    pattern = re.compile(r"^\s+([A-Za-z_]\w*)\s*:[^#\n]*#\s*(.+)$")
    return {m.group(1): m.group(2).strip() for m in map(pattern.match, source.splitlines()) if m}


def type_name(tp: Any) -> str:
    """An annotation in YAML words: ``int``, ``float or null``, ``list of int``, ..."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names + (["null"] if type(None) in args else []))
    if origin is tuple:
        (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return f"list of {type_name(elem)}"
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """``value`` as it would be written in a config file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        items = ", ".join(f"{f.name}: {yaml_value(getattr(value, f.name))}" for f in _fields(value))
        return "{" + items + "}"
    return repr(value)


def _fields(cls_or_obj: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls_or_obj) if f.init]


def _default(f: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, f.name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _describe(cls: type, name: str, docs: dict[str, str], comments: dict[str, str]) -> str:
    text = docs.get(name) or comments.get(name)
    if text is None:
        fallback = _FALLBACK.get((cls, name))
        text = fallback.format(**_FORMAT_ARGS) if fallback else ""
    return _expand_constants(" ".join(text.split()), sys.modules[cls.__module__])


def _expand_constants(text: str, module: types.ModuleType) -> str:
    """``LOSS_TYPES`` in a description -> ``LOSS_TYPES`` (``sigmoid``, ``ipo``, ...), read
    from the class's module, so the page shows the valid values."""

    def expand(m: re.Match) -> str:
        value = getattr(module, m.group(1), None)
        if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            return f"{m.group(0)} ({_choices(value)})"
        return m.group(0)

    return re.sub(r"``([A-Z][A-Z0-9_]+)``", expand, text)


def _summary(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    first = doc.split("\n\n")[0].replace("\n", " ").strip()
    if first.startswith("Attributes:") or cls is config_lib.RunConfig:
        return ""  # RunConfig's points at the module docstring; the page has its own intro
    return first


def _walk(cls: type, instance: Any, path: str) -> Iterator[Section]:
    """Sections of ``cls`` (with ``instance`` giving the defaults), depth first."""
    hints = typing.get_type_hints(cls)
    docs, comments = docstring_attributes(cls), inline_comments(cls)
    rows, nested = [], []
    for f in _fields(cls):
        value = _default(f, instance)
        if dataclasses.is_dataclass(value):
            nested.append((f, value))
            continue
        section = _optional_section(hints[f.name])
        if value is None and section is not None:  # ``lora: null`` by default: its own table
            try:
                nested.append((f, section()))
            except ValueError:  # no valid default (a placement group): its row alone
                pass
        required = value is dataclasses.MISSING
        rows.append(
            Field(
                path=f"{path}.{f.name}" if path else f.name,
                type=type_name(hints[f.name]),
                default="required" if required else yaml_value(value),
                description=_describe(cls, f.name, docs, comments),
            )
        )
    yield Section(path=path, cls=cls, summary=_summary(cls), fields=tuple(rows))
    for f, value in nested:
        child = f"{path}.{f.name}" if path else f.name
        if isinstance(value, config_lib.ModelSpec):
            yield from _model_sections(child)
        else:
            yield from _walk(type(value), value, child)


def _optional_section(tp: Any) -> type | None:
    """The dataclass of an ``X | None`` annotation (an optional section), else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    classes = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
    return classes[0] if len(classes) == 1 else None


def _model_sections(path: str) -> Iterator[Section]:
    spec = config_lib.ModelSpec
    yield from (
        dataclasses.replace(
            s, fields=tuple(f for f in s.fields if f.path.split(".")[-1] not in _MODEL_SPEC_SKIP)
        )
        for s in _walk(spec, spec(), path)
    )
    mc = model_config.ModelConfig
    hints = typing.get_type_hints(mc)
    docs, comments = docstring_attributes(mc), inline_comments(mc)
    rows = []
    for f in _fields(mc):
        if f.name == "family":  # a ModelSpec key in YAML (``family`` of ``preset: tiny``)
            continue
        value = _default(f, None)
        rows.append(
            Field(
                path=f"{path}.{f.name}",
                type=type_name(hints[f.name]),
                default="from the preset" if value is dataclasses.MISSING else yaml_value(value),
                description=_describe(mc, f.name, docs, comments),
            )
        )
    yield Section(
        path=f"{path} (ModelConfig fields)", cls=mc, summary=_summary(mc), fields=tuple(rows)
    )


def sections() -> list[Section]:
    """Every section of :class:`RunConfig`, the top level first."""
    return list(_walk(config_lib.RunConfig, None, ""))


def _cell(text: str) -> str:
    text = text.replace("``", "`").replace("|", "\\|")
    return text or "—"


def _presets_table() -> list[str]:
    rows = [
        "| preset | family | layers | width D | MLP F | heads N / K | vocab V | max positions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in config_lib.PRESETS:
        c = getattr(model_config.ModelConfig, name)()
        rows.append(
            f"| `{name}` | {c.family} | {c.num_layers} | {c.hidden_size} | "
            f"{c.intermediate_size} | {c.num_heads} / {c.kv_heads} | {c.vocab_size} | "
            f"{c.max_position_embeddings} |"
        )
    return rows


def render() -> str:
    """The whole of ``docs/configuration.md``."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses; do not edit. -->",
        "",
        "A run is one YAML file (`python -m jaxrlhf.train --config FILE`) whose sections are",
        "the tables below; every section is optional except `algorithm`. Any field can be set",
        "on the command line as `section.field=value` (the value is parsed as YAML:",
        "`optimizer.lr=1e-5`, `data.eval=null`, `ppo.rollout.num_samples=4`). Unknown keys,",
        "wrong types and invalid values are one-line errors naming the file and the field.",
        "Types and defaults come from the dataclasses (`jaxrlhf/config.py` composes them);",
        "descriptions from their docstrings. A pipeline file (`pipeline: [a.yaml, b.yaml]`)",
        "runs several such configs in order. Repeating `--config` merges files in order",
        "(`--config RUN.yaml --config PLAN.yaml`): sections merge key by key, a later value",
        "(scalar, list or null) replaces the earlier one, and overrides apply after all files.",
        "",
        "```yaml",
        "algorithm: sft",
        "model: {preset: tiny, hidden_size: 64}",
        "data: {train: builtin:sort, max_length: 32, max_prompt_length: 16}",
        "train: {steps: 10, batch_size: 8}",
        "```",
        "",
        "Sections:",
        "",
    ]
    all_sections = sections()
    for s in all_sections:
        name = s.path or "top level"
        anchor = _anchor(name)
        out.append(f"- [`{name}`](#{anchor}) ({s.cls.__name__})")
    for s in all_sections:
        name = s.path or "top level"
        out += ["", f"## {name}", ""]
        where = f"`{s.cls.__module__}.{s.cls.__qualname__}`"
        if s.summary:
            out.append(f"{where}: {_cell(s.summary)}")
        else:
            out.append(where)
        if s.cls is model_config.ModelConfig:
            out += [
                "",
                "Beside `preset` / `hf_dir`, the model section takes any `ModelConfig` field;",
                "it overrides the preset's (or the checkpoint's `config.json`) value. Presets:",
                "",
                *_presets_table(),
            ]
        out += ["", "| field | type | default | description |", "|---|---|---|---|"]
        for f in s.fields:
            out.append(f"| `{f.path}` | {f.type} | `{f.default}` | {_cell(f.description)} |")
    return "\n".join(out) + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def undocumented() -> list[str]:
    """Paths of fields that have no description anywhere."""
    return [f.path for s in sections() for f in s.fields if not f.description]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.config_docs",
        description=textwrap.dedent(__doc__.split("\n\n")[0]),
    )
    parser.add_argument(
        "--write", action="store_true", help=f"rewrite {DOC_PATH} instead of printing"
    )
    args = parser.parse_args(argv)
    text = render()
    if not args.write:
        sys.stdout.write(text)
        return 0
    if not DOC_PATH.parent.is_dir():
        print(f"error: {DOC_PATH.parent} does not exist (not a source checkout?)", file=sys.stderr)
        return 2
    DOC_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
