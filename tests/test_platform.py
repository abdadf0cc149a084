"""jaxrlhf.platform: freed host memory is reused on the CPU backend; core counting.

The settings are process-wide and must precede JAX's backend, so the real check runs in a
fresh process: there a jitted program with four 32 MiB float32 intermediates live at once (a
temporary buffer of at least 128 MiB) runs 28 times, and at most half of the last 24 runs
may page-fault in a quarter or more of those pages. Not all reuse it: now and then a small
allocation made between two runs takes a piece of the freed buffer, which then no longer
fits the next run's, and the heap grows by one buffer that is faulted in fresh. How often
varies: 0-3 of 24 runs in four processes at once on a 2-core VM, but one CI run saw 5 of 12
(hence a bound of half over a longer window rather than a third over 12). Without the
settings glibc maps the buffer fresh on every run (checked too: every one of the last 24
runs faults in more than half of the pages; measured 32,769-33,799 each). Faults are
counted by the kernel (``getrusage``), not timed, so the check does not depend on machine
speed.

A second fresh process checks that a freed buffer larger than any bound ``mallopt`` takes (2
GiB) stays with it: 2.5 GiB are allocated and freed without being touched (no page becomes
resident), and the heap's end (``sbrk(0)``) must not move back until
``release_freed_host_memory`` is called. With a 2 GiB trim threshold
glibc gives it back on free, and a step with a temporary buffer that large faults all of it
in again on every execution (benchmarks/RESULTS.md: 1.6 million faults per bench-M R1-long
step).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrlhf import platform

ROOT = Path(__file__).resolve().parents[1]

_PROGRAM = """
import json, resource, sys
from jaxrlhf import platform
reason = platform.reuse_freed_host_memory() if sys.argv[1] == "reuse" else "not asked"
import jax, jax.numpy as jnp, numpy as np

@jax.jit
def step(x):  # intermediates of 32 MiB each, live together: a temp buffer of >= 128 MiB
    a = jnp.sin(x); b = jnp.cos(x); c = a * b; d = jnp.exp(-x * x)
    return (a + b + c + d).sum(axis=(1, 2)) + (a * d).sum(axis=(1, 2)) + (b * c).max(axis=(1, 2))

x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 1024, 256)), jnp.float32)
outputs, faults = [], []
for _ in range(28):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    outputs.append(np.asarray(step(x)))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({
    "reason": reason, "faults": faults,
    "same": all(bool((o == outputs[0]).all()) for o in outputs),
    "async": jax.config.values["jax_cpu_enable_async_dispatch"],
}))
"""


_LARGE_FREE = """
import ctypes, json, sys
from jaxrlhf import platform
reason = platform.reuse_freed_host_memory()
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 5 * 2**29
start = libc.sbrk(0)
block = libc.malloc(size)
grown = libc.sbrk(0) - start
libc.free(block)
kept = libc.sbrk(0) - start
released = platform.release_freed_host_memory()
print(json.dumps({"reason": reason, "size": size, "allocated": block is not None,
                  "grown": grown, "kept": kept, "released": released,
                  "after_release": libc.sbrk(0) - start}))
"""


def _run(mode: str, program: str = _PROGRAM) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    # glibc's perturb option would write every byte of a block on malloc and free, making the
    # untouched 2.5 GiB of _LARGE_FREE resident.
    for name in (platform.OPT_OUT_ENV, "MALLOC_PERTURB_", "GLIBC_TUNABLES"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", program, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_later_steps_reuse_their_temporary_buffer():
    pages = 128 * 2**20 // 4096
    with_reuse = _run("reuse")
    if with_reuse["reason"] == "no mallopt (not glibc)":
        pytest.skip("the C library is not glibc")
    assert with_reuse["reason"] is None
    assert with_reuse["async"] is False
    assert with_reuse["same"]
    refaulted = [f for f in with_reuse["faults"][-24:] if f >= pages // 4]
    assert len(refaulted) <= 12, with_reuse
    # The reference: the same program with glibc's and JAX's defaults faults it all in again.
    default = _run("default")
    assert min(default["faults"][-24:]) > pages // 2, default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
@pytest.mark.skipif(bool(os.environ.get("LD_PRELOAD")), reason="another malloc may be preloaded")
def test_a_freed_buffer_above_two_gib_stays_with_the_process():
    result = _run("reuse", _LARGE_FREE)
    if result["reason"] == "no mallopt (not glibc)":
        pytest.skip("the C library is not glibc")
    if not result["allocated"]:
        pytest.skip("the system refused 2.5 GiB of address space (overcommit policy)")
    assert result["reason"] is None
    # Served from the heap (not by mmap): the heap grew by about the block (less whatever was
    # free at its top already).
    assert result["grown"] > result["size"] // 2, result
    assert result["kept"] >= result["grown"], result  # not trimmed when freed (2 GiB: ~0)
    assert result["released"], result  # until asked to: then given back
    assert result["after_release"] < result["grown"] // 2, result


def test_not_applied_once_a_backend_exists_or_when_opted_out(monkeypatch):
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # this test process's backend exists
    assert platform.reuse_freed_host_memory() == "a JAX backend already exists"
    monkeypatch.setenv(platform.OPT_OUT_ENV, "system")
    assert platform.reuse_freed_host_memory() == "JAXRLHF_HOST_MEMORY=system"


def test_cpu_backend_expected_follows_jax_platforms(monkeypatch):
    monkeypatch.setattr(platform, "_configured_platforms", lambda: "cpu")
    assert platform.cpu_backend_expected()
    monkeypatch.setattr(platform, "_configured_platforms", lambda: "cuda,cpu")
    assert not platform.cpu_backend_expected()


def test_usable_cores_honours_a_cgroup_quota(tmp_path, monkeypatch):
    """``usable_cores``: the affinity mask (``os.cpu_count`` where there is none), capped by a
    cgroup v2 ``cpu.max`` quota rounded up (250000 / 100000 -> 3 of 8), unchanged by "max"
    or a missing file."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")
    assert platform.usable_cores(str(cpu_max)) == 3
    cpu_max.write_text("max 100000\n")
    assert platform.usable_cores(str(cpu_max)) == 8
    assert platform.usable_cores(str(tmp_path / "absent")) == 8
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # e.g. macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert platform.usable_cores(str(tmp_path / "absent")) == 4
