"""Every code block of README.md and docs/*.md runs, and the generated pages are current.

Blocks are fenced with a language: ``python`` and ``bash`` blocks are executed, ``yaml``
blocks are parsed (and validated as a run config when they have an ``algorithm``),
``text`` blocks (diagrams, output) are not code. An HTML comment on the line before a block
changes what happens to it:

* ``<!-- not-run: REASON -->``: not executed (needs a TPU, a cluster, minutes); each one is
  reported as a skipped test with its reason, and there may be at most ``MAX_NOT_RUN``.
* ``<!-- file: NAME -->``: the block is written to ``NAME`` in the scratch directory (and
  compiled, for Python) so that later blocks can run it.

Each page runs in a fresh interpreter (``JAX_PLATFORMS=cpu``, the repo on ``PYTHONPATH``),
the one running the tests; so does ``python`` in its bash blocks, whatever is first on the
caller's ``PATH`` (``venv/bin/python -m pytest`` works without activating the venv). Its
working directory is a scratch directory holding a link to ``configs/``, so snippets
use the same relative paths as a reader in a checkout, and nothing is written into the
repo. Python blocks of one page share a namespace and run in order, interleaved with its
bash blocks; the two set-up commands (``pip install ...``) are run by ``.ci/run`` instead
(``tests/test_repo.py`` keeps them identical).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "yaml", "text")
MAX_NOT_RUN = 4
PAGE_TIMEOUT_S = 300

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(not-run|file):\s*(.+?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # path relative to the repo root
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    not_run: str | None = None  # the reason
    file: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_setup_command(self) -> bool:
        return self.lang == "bash" and self.code.lstrip().startswith("pip install")


def extract_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of a Markdown page, with the marker comment before each."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{page}:{start + 1}: unclosed code fence")
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(prev.strip())
        kind, value = (mark.group(1), mark.group(2)) if mark else (None, None)
        blocks.append(
            Block(
                page=page,
                line=start + 2,
                lang=m.group(1),
                code="\n".join(lines[start + 1 : end]) + "\n",
                not_run=value if kind == "not-run" else None,
                file=value if kind == "file" else None,
            )
        )
        i = end + 1
    return blocks


def _page_blocks(path: Path) -> list[Block]:
    return extract_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))


ALL_BLOCKS = [b for page in PAGES for b in _page_blocks(page)]
NOT_RUN = [b for b in ALL_BLOCKS if b.not_run]


def _runnable(blocks: list[Block]) -> list[Block]:
    return [
        b
        for b in blocks
        if b.lang in ("python", "bash") and not b.not_run and not b.is_setup_command
    ]


# The interpreter that runs one page: blocks in order, Python ones in a shared namespace.
_DRIVER = r"""
import json, subprocess, sys, time, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__docs__"}
start = time.perf_counter()
for b in blocks:
    print(f"--- {b['where']} ({b['lang']}) at {time.perf_counter() - start:.1f} s", flush=True)
    if b["file"]:
        with open(b["file"], "w") as f:
            f.write(b["code"])
        if b["lang"] == "python":
            compile(b["code"], b["where"], "exec")
        continue
    if b["lang"] == "bash":
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]])
        if done.returncode:
            print(f"FAILED: {b['where']}: bash exited with {done.returncode}", flush=True)
            sys.exit(1)
        continue
    try:
        exec(compile(b["code"], b["where"], "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {b['where']}", flush=True)
        sys.exit(1)
print(f"--- done at {time.perf_counter() - start:.1f} s", flush=True)
"""


def _pages_with_code() -> list[Path]:
    return [p for p in PAGES if _runnable(_page_blocks(p))]


def _page_env(scratch: Path) -> dict[str, str]:
    """The environment of a page's interpreter and of its bash blocks.

    ``python`` and ``python3`` on its ``PATH`` are scripts in ``scratch/bin`` that exec this
    interpreter. Scripts rather than symlinks: a venv's interpreter finds its
    ``pyvenv.cfg`` (and so its site-packages) beside the path it was started from.
    """
    bin_dir = scratch / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        shim.chmod(0o755)
    env = dict(os.environ)
    env.update(
        PATH=os.pathsep.join(filter(None, [str(bin_dir), env.get("PATH")])),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        MPLBACKEND="Agg",
    )
    return env


@pytest.mark.slow
def test_bash_blocks_run_this_interpreter(tmp_path: Path, monkeypatch) -> None:
    """A ``python`` first on the caller's PATH (here one that fails) is not the one used."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "python").write_text("#!/bin/sh\nexit 3\n")
    (decoy / "python").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(decoy), os.environ.get("PATH", "")]))
    done = subprocess.run(
        ["bash", "-c", "python -c 'import sys, jax; print(sys.executable)'"],
        env=_page_env(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == sys.executable


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_snippets_run(page: Path, tmp_path: Path) -> None:
    blocks = _runnable(_page_blocks(page))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([dict(dataclasses.asdict(b), where=b.where) for b in blocks]))
    env = _page_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(spec)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    print(done.stdout)
    assert done.returncode == 0, (
        f"a snippet of {page.name} failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    )


def test_not_run_snippets_are_few() -> None:
    listed = "\n".join(f"  {b.where}: {b.not_run}" for b in NOT_RUN)
    assert len(NOT_RUN) <= MAX_NOT_RUN, f"{len(NOT_RUN)} blocks are not run:\n{listed}"


def test_every_block_has_a_known_language() -> None:
    bad = [f"{b.where}: ```{b.lang}" for b in ALL_BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"fence every block with one of {LANGUAGES}: {bad}"


def test_yaml_blocks_are_valid_configs() -> None:
    from jaxrlhf.config import from_dict, validate

    for b in ALL_BLOCKS:
        if b.lang != "yaml" or b.not_run:
            continue
        data = yaml.safe_load(b.code)
        if isinstance(data, dict) and "algorithm" in data:
            validate(from_dict(data, source=b.where), 1, source=b.where)


def test_relative_links_resolve() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_configuration_reference_is_current() -> None:
    from jaxrlhf import config_docs

    committed = config_docs.DOC_PATH.read_text(encoding="utf-8")
    assert committed == config_docs.render(), (
        f"docs/configuration.md differs from the config dataclasses; run `{config_docs.COMMAND}`"
    )


def test_every_config_field_is_described() -> None:
    from jaxrlhf import config_docs

    missing = config_docs.undocumented()
    assert not missing, (
        f"config fields without a description: {missing}; add them to the class's "
        "'Attributes:' docstring section"
    )


def test_config_docs_fallbacks_name_real_fields() -> None:
    from jaxrlhf import config_docs

    for cls, name in config_docs._FALLBACK:
        assert name in {f.name for f in dataclasses.fields(cls)}, (cls.__name__, name)


def test_docstring_attributes_parser() -> None:
    from jaxrlhf.config_docs import _parse_attributes

    doc = (
        "Summary.\n\nAttributes:\n  lr: peak rate.\n  b1, b2: Adam\n    moments.\n"
        "  flag: on.\n\nReturns:\n  nothing: here."
    )
    assert _parse_attributes(doc) == {
        "lr": "peak rate.",
        "b1": "Adam moments.",
        "b2": "Adam moments.",
        "flag": "on.",
    }
    # Classes whose docstring starts with "Attributes:" (entries at the same indent).
    assert _parse_attributes("Attributes:\nbeta: inverse\n  temperature.") == {
        "beta": "inverse temperature."
    }


def test_sharding_guide_tables_match_the_rules() -> None:
    """docs/sharding.md's table of TRAIN / GENERATE rules is the rule tables' content."""
    from jaxrlhf.sharding import GENERATE, SCORE, TRAIN

    assert SCORE == TRAIN  # the guide shows one column for both
    text = (ROOT / "docs" / "sharding.md").read_text(encoding="utf-8")

    def cell(mesh_axes) -> str:
        if mesh_axes is None:
            return "replicated"
        if isinstance(mesh_axes, str):
            return f"`{mesh_axes}`"
        return "`" + " x ".join(mesh_axes) + "`"

    train, generate = dict(TRAIN), dict(GENERATE)
    assert train.keys() == generate.keys()
    for name in train:
        row = f"| `{name}` | {cell(train[name])} | {cell(generate[name])} |"
        assert row in text, f"docs/sharding.md lacks the rule row {row}"


def test_readme_first_screen_has_the_setup_commands() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    setup = [b.code.strip() for b in _page_blocks(ROOT / "README.md") if b.is_setup_command]
    assert len(setup) == 2
    for command in setup:
        assert command in first_screen, f"move {command!r} into the README's first 30 lines"
