"""``check_output_dir``: a run directory that cannot be one fails in one line, up front."""

from __future__ import annotations

import os

import pytest

from jaxrlhf.config import ConfigError
from jaxrlhf.train.run_dir import check_output_dir


def test_existing_and_new_directories_pass(tmp_path):
    check_output_dir(str(tmp_path))
    check_output_dir(str(tmp_path / "runs" / "new"))
    assert not (tmp_path / "runs").exists()  # nothing is created


def test_output_dir_that_is_a_file(tmp_path):
    path = tmp_path / "run.txt"
    path.write_text("x")
    with pytest.raises(ConfigError) as e:
        check_output_dir(str(path))
    assert str(e.value) == f"output_dir: {path} is a file, not a directory; choose another"


def test_output_dir_under_a_file(tmp_path):
    (tmp_path / "run.txt").write_text("x")
    path = tmp_path / "run.txt" / "sft"
    with pytest.raises(ConfigError) as e:
        check_output_dir(str(path))
    assert str(e.value) == (
        f"output_dir: {path} cannot be created: {tmp_path / 'run.txt'} is a file, not a directory"
    )


def test_unwritable_parent(tmp_path, monkeypatch):
    # os.access is patched: the test suite may run as root, for whom every path is writable.
    monkeypatch.setattr(os, "access", lambda p, mode: os.path.abspath(p) != str(tmp_path))
    with pytest.raises(ConfigError) as e:
        check_output_dir(str(tmp_path / "sft"))
    assert str(e.value) == (
        f"output_dir: {tmp_path / 'sft'} cannot be created: {tmp_path} is not writable by this user"
    )
    with pytest.raises(ConfigError, match=r"^output_dir: \S+ is not writable by this user$"):
        check_output_dir(str(tmp_path))
