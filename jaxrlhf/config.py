"""The run config: component configs composed into one typed ``RunConfig``, and the one
validation of a run (:func:`validate`).

Each component keeps its own frozen dataclass in a light module beside its code
(``DataConfig`` in ``jaxrlhf.data.config``, ``MeshConfig`` and ``PlacementConfig`` in
``jaxrlhf.sharding``, the loop, optimizer and supervised algorithms in
``jaxrlhf.train.config``, PPO and GRPO in ``jaxrlhf.train.rl_config``); importing this module
loads no Flax, optax or model code. It composes them, loads them from YAML with dotted
command-line overrides (:func:`load_config`, each section checked as it is built), and
:func:`validate` checks once, before any device work, what no single component can check
alone (batch sizes against the mesh, sequence lengths against the model, the meshes against
the devices) and returns what the run derives (:class:`RunLayout`).

YAML layout (every section optional except ``algorithm``)::

    algorithm: sft              # sft | reward_model | dpo | ilql | ppo | grpo
    output_dir: runs/tiny_sft   # default: runs/<config file name>
    model: {preset: tiny, hidden_size: 64}   # or {hf_dir: PATH, dtype: bfloat16}
    tokenizer: {path: builtin}
    data: {train: builtin:sort, max_length: 32, max_prompt_length: 16}
    mesh: {data: -1, fsdp: 1, tensor: 1}
    placement: {cpu_devices: 2, train_devices: 1, generate_mesh: {data: -1, fsdp: 1}}
    optimizer: {lr: 1.0e-3, warmup_steps: 10}
    train: {steps: 200, batch_size: 32}
    logging: {progress: auto}
    checkpoint: {export_hf: true}
    lora: {rank: 8, alpha: 16, targets: [q, k, v, o]}   # default null: full fine-tuning
    sft: {...}  reward_model: {...}  dpo: {...}  ilql: {...}  ppo: {...}  grpo: {...}

Several files merge in order (:func:`read_configs`, ``--config RUN.yaml --config PLAN.yaml``):
sections merge key by key, a later scalar, list or null replaces the earlier value. Overrides
are ``section.field=value`` with the value parsed as YAML (``optimizer.lr=1e-5``,
``data.eval=null``, ``mesh.fsdp=4``), applied after every file. Every error is a
:class:`ConfigError` whose message is one line naming the file that set the field (or
``command line``) and the field path.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import yaml

from jaxrlhf.data.config import DataConfig, TokenizerConfig
from jaxrlhf.data.sources import BUILTIN_PREFIX
from jaxrlhf.data.tasks import BUILTIN_TASKS
from jaxrlhf.sharding.mesh import MeshConfig, MeshError, resolve_mesh_shape
from jaxrlhf.sharding.placement import (
    PlacementConfig,
    generate_shards,
    reference_shards,
    train_device_count,
)
from jaxrlhf.train.config import (
    CheckpointConfig,
    DPOConfig,
    ILQLConfig,
    LoggingConfig,
    LoraConfig,
    OptimizerConfig,
    RewardModelConfig,
    SFTConfig,
    TrainConfig,
)
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig, RLLayout, rl_layout, score_layout

if TYPE_CHECKING:  # models/ is loaded only when a model config is resolved
    from jaxrlhf.models.config import ModelConfig

logger = logging.getLogger(__name__)

ALGORITHMS = ("sft", "reward_model", "dpo", "ilql", "ppo", "grpo")
RL_ALGORITHMS = ("ppo", "grpo")
COMMAND_LINE = "command line"
PRESETS = (
    "tiny",
    "bench_s",
    "bench_m",
    "llama3_8b",
    "llama3_70b",
    "llama2_7b",
    "mistral_7b",
    "qwen2_7b",
    "qwen2_5_1_5b",
    "gemma_2b",
    "gpt2",
    "llama3_2_1b",
    "llama3_2_3b",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_30b_a3b",
    "mixtral_8x7b",
    "gemma2_2b",
    "gemma2_9b",
    "gemma3_1b",
    "gemma3_4b",
    "phi3_mini_4k",
)


class ConfigError(ValueError):
    """An invalid config. The message is one line: ``SOURCE: FIELD.PATH: problem``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model section: a preset or a Hugging Face directory, plus ModelConfig overrides.

    In YAML the overrides sit beside ``preset`` / ``hf_dir``:
    ``model: {preset: tiny, family: gpt2, hidden_size: 64}`` or
    ``model: {hf_dir: /ckpt/llama, dtype: bfloat16, remat: full}``.

    Attributes:
      preset: a ``ModelConfig`` classmethod name (``PRESETS``); random initialisation.
      hf_dir: a local Hugging Face checkpoint; its config.json and weights are loaded.
      family: for ``preset: tiny`` only, the architecture family (default llama).
      overrides: ``ModelConfig`` fields to set on top.
    """

    preset: str | None = "tiny"
    hf_dir: str | None = None
    family: str | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.hf_dir is None):
            raise ValueError("set exactly one of model.preset and model.hf_dir")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset: expected one of {list(PRESETS)}, got {self.preset!r}")
        if self.family is not None and self.preset != "tiny":
            raise ValueError("family: only applies to preset 'tiny' (others fix their family)")

    def resolve(self) -> ModelConfig:
        """The ModelConfig (reads ``hf_dir/config.json``; no weights, no devices)."""
        from jaxrlhf.models.config import ModelConfig

        if self.hf_dir is not None:
            from jaxrlhf.models.hf_config import load_hf_config

            return load_hf_config(self.hf_dir, **self.overrides)
        if self.preset == "tiny":
            return ModelConfig.tiny(self.family or "llama", **self.overrides)
        return getattr(ModelConfig, self.preset)(**self.overrides)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run. See the module docstring for the YAML layout."""

    algorithm: str
    output_dir: str | None = None
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    lora: LoraConfig | None = None  # LoRA adapters on the trained model (null: all weights)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    ilql: ILQLConfig = dataclasses.field(default_factory=ILQLConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm: expected one of {list(ALGORITHMS)}, got {self.algorithm!r}"
            )

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


# ---- typed loading ---------------------------------------------------------------------


class _Context:
    """Where values came from, for error messages.

    ``source`` is the (first) config file; ``override_paths`` the fields set after it: a
    mapping field path -> where (an overlay file or ``command line``), or bare paths, all
    set on the command line. A field's source is the one that set it or a section above it;
    a section's also lists where the fields below it were set (``RUN.yaml + PLAN.yaml``).
    """

    def __init__(self, source: str, override_paths: Iterable[str] | Mapping[str, str] = ()):
        self.source = source
        if isinstance(override_paths, Mapping):
            self.origins = dict(override_paths)
        else:
            self.origins = dict.fromkeys(override_paths, COMMAND_LINE)

    def source_of(self, path: str) -> str:
        own, depth = self.source, -1
        for p, where in self.origins.items():
            if (path == p or path.startswith(p + ".")) and len(p) > depth:
                own, depth = where, len(p)
        below = [w for p, w in self.origins.items() if not path or p.startswith(path + ".")]
        return " + ".join(dict.fromkeys([own, *below]))

    def fail(self, path: str, message: str) -> typing.NoReturn:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{self.source_of(path)}: {where}{message}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is tuple:  # YAML writes a sequence as a list
        (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return f"a list of {_type_name(elem)}"
    if origin is not None:
        return getattr(origin, "__name__", str(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, ctx: _Context) -> Any:
    """``value`` checked against (and, for numbers, converted to) the annotation ``tp``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            ctx.fail(path, f"expected {_type_name(tp)}, got null")
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, Mapping) and len(sections) == 1:  # its own error, not "expected"
            return _build(sections[0], value, path, ctx)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, ctx)
            except ConfigError:
                continue
        ctx.fail(path, f"expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, ctx)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
            return tuple(_coerce(v, elem, f"{path}[{i}]", ctx) for i, v in enumerate(value))
    elif origin in (dict, Mapping) or tp in (dict, Mapping):
        if isinstance(value, Mapping):
            return dict(value)
    else:
        raise TypeError(f"config loader cannot check {path} of type {tp}")
    ctx.fail(path, f"expected {_type_name(tp)}, got {value!r}")


def _section_fields_named(key: str) -> list[str]:
    """``section.key`` for each top-level section of :class:`RunConfig` with a field ``key``."""
    found = []
    for name, tp in typing.get_type_hints(RunConfig).items():
        sections = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if sections and key in {f.name for f in dataclasses.fields(sections[0])}:
            found.append(f"{name}.{key}")
    return found


def _unknown(path: str, key: str, valid: Iterable[str], ctx: _Context) -> typing.NoReturn:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    nested = _section_fields_named(str(key)) if not path else []
    if nested:  # e.g. a top-level ``rollout:`` that belongs under ``grpo:``
        hint = f"did you mean {' or '.join(nested)}? "
    ctx.fail(_join(path, str(key)), f"unknown key ({hint}valid: {', '.join(valid)})")


def _construct(cls: type, kwargs: dict[str, Any], path: str, ctx: _Context) -> Any:
    """``cls(**kwargs)``, turning ``__post_init__`` errors into field-named ConfigErrors.

    Component configs raise ``ValueError("field: problem")``; the field is prefixed with the
    section path. Other messages (e.g. MeshError's ``mesh.data must be ...``) are kept.
    """
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        m = re.match(r"(\w+): (.*)", message)
        names = {f.name for f in dataclasses.fields(cls)}
        if m and m.group(1) in names:
            ctx.fail(_join(path, m.group(1)), m.group(2))
        if path and message.startswith(path + "."):
            raise ConfigError(f"{ctx.source_of(path)}: {message}") from None
        ctx.fail(path, message)


def _build(cls: type, data: Any, path: str, ctx: _Context) -> Any:
    if cls is ModelSpec:
        return _build_model(data, path, ctx)
    if not isinstance(data, Mapping):
        ctx.fail(path, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            _unknown(path, key, fields, ctx)
        kwargs[key] = _coerce(value, hints[key], _join(path, key), ctx)
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in kwargs and no_default:
            ctx.fail(_join(path, name), "required field is missing")
    return _construct(cls, kwargs, path, ctx)


_MODEL_SPEC_KEYS = ("preset", "hf_dir", "family")


def _build_model(data: Any, path: str, ctx: _Context) -> ModelSpec:
    from jaxrlhf.models.config import ModelConfig

    if not isinstance(data, Mapping):
        ctx.fail(path, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(ModelConfig)
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"family"}
    spec: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for key, value in data.items():
        if key in _MODEL_SPEC_KEYS:
            spec[key] = _coerce(value, str | None, _join(path, key), ctx)
        elif key in model_fields:
            overrides[key] = _coerce(value, hints[key], _join(path, key), ctx)
        else:
            _unknown(path, key, set(_MODEL_SPEC_KEYS) | model_fields, ctx)
    if spec.get("hf_dir") is not None and "preset" not in spec:
        spec["preset"] = None
    return _construct(ModelSpec, dict(spec, overrides=overrides), path, ctx)


# ---- overrides ---------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Any]:
    """``"optimizer.lr=1e-5"`` -> ``("optimizer.lr", 1e-05)``; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", key):
        raise ConfigError(
            f"{COMMAND_LINE}: {text!r}: expected an override like section.field=value"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> tuple[dict, list[str]]:
    """``data`` with each ``key=value`` override set (a deep copy); also the paths set."""
    out = _deep_copy(data)
    paths = []
    for text in overrides:
        key, value = parse_override(text)
        node = out
        *parents, leaf = key.split(".")
        for i, name in enumerate(parents):
            child = node.setdefault(name, {})
            if child is None:
                child = node[name] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parents[: i + 1])
                raise ConfigError(f"{COMMAND_LINE}: {key}: {prefix} is not a section")
            node = child
        node[leaf] = value
        paths.append(key)
    return out, paths


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


# ---- loading and validation --------------------------------------------------------------


def from_dict(
    data: Mapping[str, Any], *, source: str = "<config>", override_paths: Iterable[str] = ()
) -> RunConfig:
    """A typed RunConfig from a parsed YAML mapping; each section checks its own fields.

    Checks across sections and against the devices are :func:`validate`'s, which every run
    (and the dry run) calls once before anything else.

    Args:
      data: the mapping (sections as nested mappings).
      source: the file name used in error messages (the first file of several); it names the
        default ``output_dir`` (``runs/<its name without .yaml>``).
      override_paths: fields set after that file: field path -> the overlay file or
        ``command line`` that set it (:func:`read_configs`), or bare paths, all set on the
        command line; their errors name where.

    Raises:
      ConfigError: unknown keys, wrong types or invalid values.
    """
    ctx = _Context(source, override_paths)
    if not isinstance(data, Mapping):
        ctx.fail("", "expected a mapping of sections at the top level")
    cfg = _build(RunConfig, data, "", ctx)
    if cfg.output_dir is None:
        stem = os.path.splitext(os.path.basename(source))[0] if source != "<config>" else ""
        cfg = cfg.replace(output_dir=os.path.join("runs", stem or cfg.algorithm))
    return cfg


def load_config(paths: str | Sequence[str], overrides: Iterable[str] = ()) -> RunConfig:
    """Reads ``paths`` (one YAML file, or several merged in order: :func:`read_configs`) and
    applies ``overrides`` (see :func:`from_dict`; the source, which names the default
    ``output_dir``, is the first file)."""
    paths = (paths,) if isinstance(paths, str) else tuple(paths)
    data, origins = read_configs(paths, overrides)
    return from_dict(data, source=paths[0], override_paths=origins)


def source_of(source: str, override_paths: Iterable[str] | Mapping[str, str], path: str) -> str:
    """Where the field ``path`` was set: ``source`` (the first file), an overlay file or
    ``command line`` (``override_paths`` as in :func:`from_dict`)."""
    return _Context(source, override_paths).source_of(path)


def config_files(source: str, override_paths: Iterable[str] | Mapping[str, str] = ()) -> str:
    """``"RUN.yaml + PLAN.yaml"``: the first file and the overlay files that set a field
    (``override_paths`` as in :func:`from_dict`)."""
    overlays = override_paths.values() if isinstance(override_paths, Mapping) else ()
    return " + ".join(dict.fromkeys([source, *(w for w in overlays if w != COMMAND_LINE)]))


def override_paths(overrides: Iterable[str]) -> list[str]:
    """The field paths that ``key=value`` overrides set (for error attribution)."""
    return [parse_override(text)[0] for text in overrides]


def read_config(path: str, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """``path``'s YAML mapping with ``overrides`` applied, not yet typed or validated (what
    must be read before JAX starts); and the overridden field paths.

    Raises:
      ConfigError: the file is missing or not a YAML mapping, or an override is malformed.
    """
    return apply_overrides(_read_yaml(path), overrides)


def read_configs(
    paths: str | Sequence[str], overrides: Iterable[str] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """The YAML mappings of ``paths`` merged in order (:func:`merge_configs`), then
    ``overrides`` applied; not yet typed or validated.

    Returns:
      The mapping, and where each field set after the first file came from: field path ->
      the file or ``command line`` (``override_paths`` of :func:`from_dict` and
      :func:`validate`, which name it in their errors).

    Raises:
      ConfigError: a file is missing or not a YAML mapping (naming it), or an override is
        malformed.
    """
    paths = (paths,) if isinstance(paths, str) else paths
    if not paths:
        raise ConfigError(f"{COMMAND_LINE}: no config file given")
    data = _read_yaml(paths[0])
    origins: dict[str, str] = {}
    for path in paths[1:]:
        _merge_into(data, _read_yaml(path), "", path, origins)
    data, set_paths = apply_overrides(data, overrides)
    for key in set_paths:
        _set_origin(origins, key, COMMAND_LINE)
    return data, origins


def merge_configs(*mappings: Mapping[str, Any]) -> dict[str, Any]:
    """Config mappings deep-merged in order, later ones winning (a new dict).

    A mapping merges into a mapping key by key; anything else (a scalar, a list, null, or a
    mapping where the earlier value was not one) replaces the earlier value whole. So
    ``{mesh: {data: 1, fsdp: -1}}`` then ``{mesh: {fsdp: 4}, lora: null}`` gives
    ``{mesh: {data: 1, fsdp: 4}, lora: null}``.
    """
    out: dict[str, Any] = {}
    for m in mappings:
        _merge_into(out, m, "", "", {})
    return out


def _merge_into(
    dst: dict[str, Any], src: Mapping[str, Any], prefix: str, where: str, origins: dict
) -> None:
    """Merges ``src`` into ``dst`` in place, recording ``where`` for each field it sets."""
    for key, value in src.items():
        path = _join(prefix, str(key))
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge_into(dst[key], value, path, where, origins)
        else:
            dst[key] = _deep_copy(value)
            _set_origin(origins, path, where)


def _set_origin(origins: dict[str, str], path: str, where: str) -> None:
    """``path`` (and everything below it) was set by ``where``."""
    for p in [p for p in origins if p == path or p.startswith(path + ".")]:
        del origins[p]
    origins[path] = where


def _read_yaml(path: str) -> dict[str, Any]:
    """One config file's top-level mapping (``{}`` for an empty file)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "syntax error"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """Everything a run derives from its config and devices (:func:`validate`'s result),
    computed once and used by the trainers and the dry run.

    Attributes:
      model: the resolved model config (``model.preset`` or ``model.hf_dir/config.json``).
      devices: devices of the whole run (a sampler with its own mesh spans them all).
      train_devices: devices of the training mesh (the first ones).
      mesh_shape: the training mesh's ``(data, fsdp, tensor)`` sizes.
      data_shards: the training mesh's ``data x fsdp``, over which batches are split.
      generate_shards: data shards of the sampler's own mesh (``placement.generate_mesh``);
        None: the sampler uses the training mesh.
      num_micro: gradient-accumulation micro-batches per update (RL: per minibatch).
      rl: the RL sizes (PPO and GRPO), else None.
      reference_rl: ``placement.reference: sampler | own``: the reference forward's scoring
        sizes on the sampler's (or its own group's) data shards
        (:func:`~jaxrlhf.train.rl_config.score_layout`), else None.
    """

    model: ModelConfig
    devices: int
    train_devices: int
    mesh_shape: tuple[int, int, int]
    data_shards: int
    generate_shards: int | None
    num_micro: int
    rl: RLLayout | None = None
    reference_rl: RLLayout | None = None


def _fail_with_field(ctx: _Context, message: str) -> typing.NoReturn:
    """A component's ``"field.path: problem"`` ValueError as a ConfigError."""
    field, sep, problem = message.partition(": ")
    if sep and re.fullmatch(r"[A-Za-z_][\w.]*", field):
        ctx.fail(field, problem)
    ctx.fail("", message)


def _check_model(cfg: RunConfig, ctx: _Context) -> ModelConfig:
    from jaxrlhf.models.safetensors_io import CheckpointError

    try:
        model_cfg = cfg.model.resolve()
    except CheckpointError as e:
        ctx.fail("model.hf_dir", str(e))
    except (ValueError, TypeError) as e:
        ctx.fail("model", str(e))
    if cfg.data.max_length > model_cfg.max_position_embeddings:
        ctx.fail(
            "data.max_length",
            f"{cfg.data.max_length} exceeds the model's max_position_embeddings "
            f"({model_cfg.max_position_embeddings})",
        )
    if cfg.algorithm in RL_ALGORITHMS:
        total = cfg.data.max_prompt_length + rl_section(cfg).rollout.max_new_tokens
        if total > model_cfg.max_position_embeddings:
            ctx.fail(
                f"{cfg.algorithm}.rollout.max_new_tokens",
                f"data.max_prompt_length + {cfg.algorithm}.rollout.max_new_tokens = {total} "
                f"exceeds the model's {model_cfg.max_position_embeddings} positions",
            )
    return model_cfg


def _check_lora(cfg: RunConfig, model_cfg: ModelConfig, ctx: _Context) -> None:
    """LoRA's targets must exist in the model: no MLP targets on mixture-of-experts layers,
    no ``gate`` on an ungated MLP (GPT-2)."""
    if cfg.lora is None:
        return
    mlp = [t for t in cfg.lora.targets if t in ("gate", "up", "down")]
    if mlp and model_cfg.num_experts:
        ctx.fail(
            "lora.targets",
            f"{mlp} adapt a dense MLP; this {model_cfg.family} model's MLPs are mixtures of "
            "experts (adapt the attention: q, k, v, o)",
        )
    if "gate" in cfg.lora.targets and not model_cfg.gated_mlp:
        ctx.fail("lora.targets", f"'gate': this {model_cfg.family} model's MLP has no gate")


def _check_hydra(cfg: RunConfig, model_cfg: ModelConfig, ctx: _Context) -> None:
    """A Hydra critic branches below the top layer, of a dense model, without LoRA."""
    if cfg.algorithm != "ppo" or not cfg.ppo.hydra:
        return
    b, layers = cfg.ppo.value.branch_layer, model_cfg.num_layers
    if b >= layers:
        ctx.fail("ppo.value.branch_layer", f"must be below the model's {layers} layers, got {b}")
    if cfg.lora is not None:
        ctx.fail("ppo.value.branch_layer", "a Hydra critic and LoRA cannot be combined")
    if model_cfg.num_experts:
        ctx.fail("ppo.value.branch_layer", "a Hydra critic needs a dense model, not experts")


def _check_ilql(cfg: RunConfig, model_cfg: ModelConfig, ctx: _Context) -> None:
    """ILQL trains the whole model (its heads read the final hidden states); its evaluation
    generates after prompts of ``data.max_prompt_length`` tokens."""
    if cfg.algorithm != "ilql":
        return
    if cfg.lora is not None:
        ctx.fail("lora", "ILQL trains the whole model; LoRA is not supported with it")
    if cfg.ilql.eval_reward == "builtin" and not cfg.data.train.startswith(BUILTIN_PREFIX):
        ctx.fail(
            "ilql.eval_reward",
            f"'builtin' needs a built-in dataset (data.train: builtin:TASK), got "
            f"{cfg.data.train!r}",
        )
    if cfg.ilql.eval_reward is not None and cfg.data.eval is None and not cfg.data.eval_size:
        ctx.fail(
            "ilql.eval_reward",
            "the sampled evaluation needs held-out prompts (data.eval, or data.eval_size > 0)",
        )
    total = cfg.data.max_prompt_length + cfg.ilql.max_new_tokens
    if cfg.ilql.eval_reward is not None and total > model_cfg.max_position_embeddings:
        ctx.fail(
            "ilql.max_new_tokens",
            f"data.max_prompt_length + ilql.max_new_tokens = {total} exceeds the model's "
            f"{model_cfg.max_position_embeddings} positions",
        )


def _check_precision(cfg: RunConfig, model_cfg: ModelConfig, ctx: _Context) -> None:
    """Trained weights are float32 masters (compute in ``model.dtype``), or bfloat16 with
    ``optimizer.stochastic_rounding``. Without LoRA every run trains its model's weights,
    stored in ``param_dtype``; LoRA trains float32 adapters (and score head) above a frozen
    base, which may be bfloat16. A low-precision weight keeps ``m`` mantissa bits (7 in
    bfloat16, 10 in float16), so half its rounding spacing is ``2**-(m+2)`` to
    ``2**-(m+1)`` of its magnitude (0.2-0.4% in bfloat16): an AdamW step of ~lr (1e-6 on
    weights ~0.02) is far below it and rounds to nothing."""
    dtype = model_cfg.param_dtype
    if cfg.lora is not None or dtype == "float32":
        return
    if dtype == "bfloat16" and cfg.optimizer.stochastic_rounding:
        return
    bits = _MANTISSA_BITS[dtype]
    half_spacing = f"{100 * 2.0 ** -(bits + 2):.2g}-{100 * 2.0 ** -(bits + 1):.2g}%"
    option = " or set optimizer.stochastic_rounding: true" if dtype == "bfloat16" else ""
    ctx.fail(
        "model.param_dtype",
        f"{dtype} weights would be trained, and an AdamW step (~lr = {cfg.optimizer.lr:g}) "
        f"smaller than half a {dtype} spacing ({half_spacing} of the weight) rounds away; "
        f"keep float32 masters with {dtype} compute (model.param_dtype: float32, "
        f"model.dtype: {dtype}){option}",
    )


_MANTISSA_BITS = {"bfloat16": 7, "float16": 10}  # explicit mantissa bits of each dtype


def _check_data(cfg: RunConfig, ctx: _Context) -> None:
    for field in ("train", "eval"):
        src = getattr(cfg.data, field)
        if src is not None and src.startswith(BUILTIN_PREFIX):
            task = src[len(BUILTIN_PREFIX) :]
            if task not in BUILTIN_TASKS:
                ctx.fail(
                    f"data.{field}",
                    f"unknown built-in task {task!r} (expected one of {list(BUILTIN_TASKS)})",
                )


def _device_counts(
    cfg: RunConfig, devices: int | None, train_devices: int | None, ctx: _Context
) -> tuple[int, int]:
    """``(devices of the run, devices of the training mesh)``."""
    placement = cfg.placement
    if devices is None:  # a real run: check the placement against this process's JAX
        import jax

        from jaxrlhf.sharding.placement import check_cpu_devices

        try:
            check_cpu_devices(placement.cpu_devices)
        except MeshError as e:
            ctx.fail("placement.cpu_devices", str(e).split(": ", 1)[1])
        if placement.train_devices not in (-1, jax.device_count()) and jax.process_count() > 1:
            ctx.fail("placement.train_devices", "only single-process runs can use a subset")
        devices = jax.device_count()
    if train_devices is not None:
        return devices, train_devices
    try:
        return devices, train_device_count(placement, devices)
    except MeshError as e:
        field, _, problem = str(e).partition(": ")
        if field.startswith("placement."):  # a device group's own field
            ctx.fail(field, problem)
        ctx.fail("placement.train_devices", str(e))


def _generate_shards(cfg: RunConfig, devices: int, ctx: _Context) -> int | None:
    """Data shards of the sampler's own mesh (``placement.generate_mesh``, or the sampler group
    of a separated placement; None: none); it must fit the devices and
    split the prompts evenly. Like the ``ppo``/``grpo`` sections, it is unused by the other
    algorithms (so one override can serve every stage of a pipeline)."""
    separated = cfg.placement.strategy != "colocated"
    if separated and cfg.placement.sampler is None:  # interleaved: samples on the learner's
        return None
    if (cfg.placement.generate_mesh is None and not separated) or (
        cfg.algorithm not in RL_ALGORITHMS
    ):
        return None
    field = "placement.sampler.mesh" if separated else "placement.generate_mesh"
    sampler_mesh = cfg.placement.sampler.mesh if separated else cfg.placement.generate_mesh
    if sampler_mesh is not None and sampler_mesh.axis_type != "auto":
        ctx.fail(
            f"{field}.axis_type",
            "the sampler's sharding rules need 'auto' axes (jaxrlhf's rule-based sharding)",
        )
    try:
        shards = generate_shards(cfg.placement, devices)
    except MeshError as e:
        ctx.fail(field, str(e))
    prompts = rl_section(cfg).rollout.prompts_per_step
    if prompts % shards:
        ctx.fail(
            field,
            f"its {shards} data shard(s) (data x fsdp) do not divide "
            f"{cfg.algorithm}.rollout.prompts_per_step = {prompts}",
        )
    return shards


def _check_interleaved(cfg: RunConfig, devices: int, train: int, ctx: _Context) -> None:
    """An interleaved placement's critic group (PPO) has the learner's data shards (the two
    updates split the rollout alike); the GRPO family interleaves the reference alone."""
    placement = cfg.placement
    if placement.strategy != "interleaved" or placement.critic is None:
        return
    if cfg.algorithm != "ppo":
        ctx.fail(
            "placement.critic",
            f"{cfg.algorithm} has no critic; interleave its reference instead "
            "(placement.reference: own with placement.reference_group)",
        )
    if cfg.ppo.hydra:
        ctx.fail(
            "placement.strategy",
            "interleaved puts the critic on its own devices, but a Hydra critic "
            "(ppo.value.branch_layer) shares the policy's trunk; use colocated or separated",
        )
    from jaxrlhf.sharding.placement import role_devices, role_mesh_config

    try:
        size = len(role_devices(placement, devices)["critic"])
        critic = resolve_mesh_shape(role_mesh_config(placement, "critic", cfg.mesh), size)
        learner = resolve_mesh_shape(cfg.mesh, train)
    except MeshError as e:
        ctx.fail("placement.critic", str(e))
    if critic[0] * critic[1] != learner[0] * learner[1]:
        ctx.fail(
            "placement.critic",
            f"its {critic[0] * critic[1]} data shard(s) differ from the learner's "
            f"{learner[0] * learner[1]}",
        )


def _check_staleness(cfg: RunConfig, ctx: _Context) -> None:
    """Weights synced every k updates are up to k - 1 versions old: the staleness bound must
    allow it; asynchronous RL scores rewards with functions (the reward model would run on
    the learner's devices from the sampler's thread)."""
    algo, every = rl_section(cfg), cfg.placement.weight_sync_every
    k = algo.rollout.max_staleness
    if every - 1 > k:
        ctx.fail(
            "placement.weight_sync_every",
            f"{every} lets the sampler's weights fall {every - 1} version(s) behind; set "
            f"{cfg.algorithm}.rollout.max_staleness >= {every - 1}",
        )
    if algo.rollout.partial_rollouts and every > k:
        ctx.fail(
            "placement.weight_sync_every",
            f"{every} with partial rollouts lets carried tokens fall more than "
            f"{cfg.algorithm}.rollout.max_staleness = {k} versions behind; use at most {k}",
        )
    if k and algo.reward.model_dir is not None:
        ctx.fail(
            f"{cfg.algorithm}.rollout.max_staleness",
            "asynchronous RL scores with a reward function; reward.model_dir needs 0",
        )
    import jax

    if k and jax.process_count() > 1:  # a 2-process staleness-1 run hung in a collective
        ctx.fail(
            f"{cfg.algorithm}.rollout.max_staleness",
            f"{k} runs in one process for now: the sampler's thread and the learner dispatch "
            "their programs in a different order on each process, and programs whose "
            "collectives span processes must start in the same order everywhere; use 0",
        )


def _reference_layout(
    cfg: RunConfig, sampler_shards: int | None, devices: int, ctx: _Context
) -> RLLayout | None:
    """``placement.reference: sampler | own``: the reference forward's sizes on the sampler's
    (or its own group's) data shards; not with a Hydra or LoRA policy (their reference is
    part of the learner's weights) nor with streamed scoring (it runs the reference on the
    learner's devices)."""
    where = cfg.placement.reference
    if where == "learner":
        return None
    algo = rl_section(cfg)
    if cfg.algorithm == "ppo" and cfg.ppo.hydra:
        ctx.fail(
            "placement.reference",
            f"{where}: a Hydra critic's reference is the shared trunk on the learner's devices",
        )
    if cfg.lora is not None:
        ctx.fail(
            "placement.reference",
            f"{where}: a LoRA policy's reference is its frozen base on the learner's devices",
        )
    r = algo.rollout
    if r.engine == "continuous" and r.stream_scoring and r.environment is None:
        ctx.fail(
            "placement.reference",
            f"{where}: streamed scoring runs the reference on the learner's devices while the "
            f"engine decodes; set {cfg.algorithm}.rollout.stream_scoring: false",
        )
    shards, whose = sampler_shards, "the sampler's data shards"
    if where == "own":
        try:
            shards, whose = reference_shards(cfg.placement, devices), "its group's data shards"
        except MeshError as e:
            field, _, problem = str(e).partition(": ")
            ctx.fail(field, problem)
    try:
        return score_layout(algo, cfg.algorithm, shards)
    except ValueError as e:
        ctx.fail("placement.reference", f"{where}: {e} ({whose})")


def _check_engine(cfg: RunConfig, sampler_shards: int, devices: int, ctx: _Context) -> None:
    """The rollout engine's slots (set, or one per started row) split over the sampler's
    data shards; one process."""
    rollout = rl_section(cfg).rollout
    if rollout.engine != "continuous":
        return
    slots = rollout.engine_slots
    if slots % sampler_shards and rollout.slots is not None:
        ctx.fail(
            f"{cfg.algorithm}.rollout.slots",
            f"{slots} slots do not split over the sampler's {sampler_shards} data shard(s)",
        )
    elif slots % sampler_shards:  # slots unset: one for every row the iteration starts
        field = "oversample_groups" if rollout.oversample_groups else "prompts_per_step"
        ctx.fail(
            f"{cfg.algorithm}.rollout.{field}",
            f"the engine's slots (unset: one per started row, (prompts_per_step + "
            f"oversample_groups) x num_samples = {slots}) do not split over the sampler's "
            f"{sampler_shards} data shard(s); set {cfg.algorithm}.rollout.slots",
        )
    import jax

    if jax.process_count() > 1:
        ctx.fail(f"{cfg.algorithm}.rollout.engine", "continuous runs in one process for now")


def _supervised_micro_batches(cfg: RunConfig, shards: int, ctx: _Context) -> int:
    t = cfg.train
    if t.micro_batch_size is None:
        if t.batch_size % shards:
            ctx.fail(
                "train.batch_size",
                f"{t.batch_size} is not divisible by the {shards} data shards (mesh data x fsdp)",
            )
    elif t.batch_size % (t.micro_batch_size * shards):
        ctx.fail(
            "train.batch_size",
            f"{t.batch_size} is not divisible by train.micro_batch_size x data shards = "
            f"{t.micro_batch_size} x {shards} = {t.micro_batch_size * shards}",
        )
    eval_batch = t.eval_batch_size or t.batch_size
    if eval_batch % shards:
        ctx.fail(
            "train.eval_batch_size",
            f"{eval_batch} is not divisible by the {shards} data shards (mesh data x fsdp)",
        )
    if cfg.optimizer.warmup_steps > t.steps:
        ctx.fail(
            "optimizer.warmup_steps",
            f"{cfg.optimizer.warmup_steps} exceeds train.steps ({t.steps})",
        )
    return 1 if t.micro_batch_size is None else t.batch_size // (t.micro_batch_size * shards)


def rl_section(cfg: RunConfig) -> PPOConfig | GRPOConfig:
    """The config section of an RL run's algorithm (``ppo`` or ``grpo``)."""
    return cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo


def validate(
    cfg: RunConfig,
    devices: int | None = None,
    *,
    mesh: Any = None,
    source: str = "<config>",
    override_paths: Iterable[str] = (),
) -> RunLayout:
    """Every check across sections and against the devices, before any device work; returns
    what the run derives (:class:`RunLayout`). Call it once per run.

    Args:
      cfg: the config.
      devices: devices of the whole run; None: this process's JAX devices (a real run: the
        placement's ``cpu_devices`` and process count are checked against JAX too).
      mesh: a training mesh passed in code (a ``jax.sharding.Mesh``: its ``data``, ``fsdp``
        and ``tensor`` sizes are the training mesh's, in place of ``cfg.mesh`` over the
        placement's ``train_devices``); None: from the config.
      source, override_paths: where the config came from, for the messages (as in
        :func:`from_dict`).

    Raises:
      ConfigError: the model cannot be resolved, trained weights are below float32
        (``model.param_dtype``, without ``optimizer.stochastic_rounding``), sequence lengths
        exceed the model's positions, the meshes do not fit the devices, batch or rollout
        sizes do not split into micro-batches x data shards, or the warmup is longer than
        the run (one line each).
    """
    ctx = _Context(source, override_paths)
    model_cfg = _check_model(cfg, ctx)
    _check_lora(cfg, model_cfg, ctx)
    _check_hydra(cfg, model_cfg, ctx)
    _check_ilql(cfg, model_cfg, ctx)
    _check_precision(cfg, model_cfg, ctx)
    _check_data(cfg, ctx)
    given = None if mesh is None else tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    devices, train = _device_counts(cfg, devices, None if given is None else mesh.size, ctx)
    try:  # the config's mesh must fit even where a mesh passed in code then replaces it
        shape = resolve_mesh_shape(cfg.mesh, train)
    except MeshError as e:
        subset = cfg.placement.train_devices
        ctx.fail(
            "mesh", str(e) + (f" (placement.train_devices = {subset})" if subset != -1 else "")
        )
    shape = given or shape
    shards = shape[0] * shape[1]
    generate = _generate_shards(cfg, devices, ctx)
    rl = None
    if cfg.algorithm in RL_ALGORITHMS:
        _check_interleaved(cfg, devices, train, ctx)
        # RL batches are rollouts: train.batch_size is unused.
        try:
            rl = rl_layout(
                rl_section(cfg),
                section=cfg.algorithm,
                shards=shards,
                micro_batch_size=cfg.train.micro_batch_size,
                iterations=cfg.train.steps,
            )
        except ValueError as e:
            _fail_with_field(ctx, str(e))
        for note in rl.notes:
            logger.warning("%s: %s", ctx.source_of(f"{cfg.algorithm}.rollout"), note)
        _check_engine(cfg, generate or shards, devices, ctx)
        _check_staleness(cfg, ctx)
        reference_rl = _reference_layout(cfg, generate, devices, ctx)
        if cfg.placement.critic is not None:  # interleaved: the critic's values are scored apart
            rl = dataclasses.replace(rl, reuse_value_forward=False)
        num_micro = rl.num_micro
    else:
        num_micro = _supervised_micro_batches(cfg, shards, ctx)
        reference_rl = None
    return RunLayout(
        model=model_cfg,
        devices=devices,
        train_devices=train,
        mesh_shape=shape,
        data_shards=shards,
        generate_shards=generate,
        num_micro=num_micro,
        rl=rl,
        reference_rl=reference_rl,
    )


# ---- writing -----------------------------------------------------------------------------


def to_dict(cfg: Any) -> Any:
    """Plain nested dicts/lists/scalars; ``from_dict(to_dict(cfg))`` gives ``cfg`` back."""
    if isinstance(cfg, ModelSpec):
        out = {k: getattr(cfg, k) for k in _MODEL_SPEC_KEYS if getattr(cfg, k) is not None}
        out.update({k: to_dict(v) for k, v in cfg.overrides.items()})
        return out
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_config(cfg: RunConfig, path: str, header: str = "") -> None:
    """Writes the resolved config as YAML (loadable with :func:`load_config`)."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
    with open(path, "w", encoding="utf-8") as f:
        if header:
            f.write("".join(f"# {line}\n" for line in header.splitlines()))
        f.write(text)


def describe_fields() -> str:
    """Every config field with its default, for ``--help``."""
    lines = []
    for f in dataclasses.fields(RunConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if isinstance(default, ModelSpec):
            lines.append("  model: preset (tiny), hf_dir, family, or any ModelConfig field")
        elif dataclasses.is_dataclass(default):
            items = ", ".join(
                f"{g.name}={getattr(default, g.name)!r}" for g in dataclasses.fields(default)
            )
            lines.append(
                textwrap.fill(
                    f"{f.name}: {items}", width=96, initial_indent="  ", subsequent_indent="    "
                )
            )
        else:
            shown = "required" if default is dataclasses.MISSING else repr(default)
            lines.append(f"  {f.name}: {shown}")
    return "\n".join(lines)
