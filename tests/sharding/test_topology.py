"""TPU topologies (``--topology``): their devices, and the one-line errors of the dry run.

Getting a topology's devices loads the TPU compiler (a second or two) and compiles nothing:
these tests are quick. Those that need libtpu are skipped where it is absent; the one for
its absence runs anywhere.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from jaxrlhf.sharding import MeshConfig
from jaxrlhf.sharding import topology as topology_lib
from jaxrlhf.train.__main__ import main
from tests.train import helpers

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler is not installed: pip install -e '.[tpu]'",
)
TINY_GRPO = os.path.join(helpers.CONFIGS, "tiny_grpo.yaml")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_without_libtpu_the_dry_run_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(topology_lib, "tpu_compiler_installed", lambda: False)
    assert main(["--config", TINY_GRPO, "--dry-run", "--topology", "v5e:2x2"]) == 2
    err = _one_line_error(capsys)
    assert "--topology needs the TPU compiler" in err and "pip install -e '.[tpu]'" in err


@pytest.mark.parametrize("name", ["v5e:3x3", "v9x:2x2", "h100"])
@pytest.mark.tpu
@needs_libtpu
def test_an_unknown_topology_is_one_line(name, capsys):
    assert main(["--config", TINY_GRPO, "--dry-run", "--topology", name]) == 2
    err = _one_line_error(capsys)
    assert f"--topology {name}: no such TPU topology" in err and "v5e:2x2" in err


@pytest.mark.parametrize(
    "overrides, needs",
    [(["mesh.fsdp=8"], 8), (["mesh.fsdp=1"], 1), (["mesh.fsdp=2", "mesh.tensor=1"], 2)],
)
@pytest.mark.tpu
@needs_libtpu
def test_a_mesh_of_another_size_is_one_line(overrides, needs, capsys):
    assert main(["--config", TINY_GRPO, "--dry-run", "--topology", "v5e:2x2", *overrides]) == 2
    err = _one_line_error(capsys)
    assert f"needs {needs} devices; topology v5e:2x2 has 4 (TPU v5 lite)" in err


def test_topology_flags_need_the_dry_run(capsys):
    assert main(["--config", TINY_GRPO, "--topology", "v5e:2x2"]) == 2
    assert "--topology and --json need --dry-run" in _one_line_error(capsys)


@pytest.mark.parametrize(
    "name, chips, kind, device_kind",
    [
        ("v5e:2x2", 4, "tpu-v5e", "TPU v5 lite"),
        ("v4:2x2x1", 4, "tpu-v4", "TPU v4"),  # megacore: one device per chip
        ("v5p:2x2x1", 4, "tpu-v5p", "TPU v5"),
        ("v6e:2x2", 4, "tpu-v6e", "TPU v6 lite"),
        ("v5e:4x4", 16, "tpu-v5e", "TPU v5 lite"),
    ],
)
@pytest.mark.tpu
@needs_libtpu
def test_topologies_give_one_device_per_chip(name, chips, kind, device_kind):
    topo = topology_lib.load_topology(name)
    assert len(topo.devices) == chips and topo.kind == kind
    assert topo.device_kind == device_kind and topo.compiler == f"XLA:TPU {name}"
    assert all(d.platform == "tpu" for d in topo.devices)
    mesh = topology_lib.topology_mesh(MeshConfig(data=-1, fsdp=2, tensor=2), topo.devices)
    assert dict(mesh.shape) == {"data": chips // 4, "fsdp": 2, "tensor": 2}
    assert set(mesh.devices.flat) == set(topo.devices)
