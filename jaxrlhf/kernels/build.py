"""Compiles a C++ XLA FFI kernel of this package on first use, once per machine.

The shared library is cached under ``$JAXRLHF_KERNEL_CACHE`` (default
``~/.cache/jaxrlhf/kernels``), named by a hash of everything that changes the binary: the
source, the compiler and its flags, jaxlib's version (its FFI headers) and the CPU's
instruction-set flags (the code is built with ``-march=native``). A build is written to a
temporary file and renamed into place, so processes building or loading the same library at
once (pytest workers, a trainer's processes) never see half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax.ffi
import jaxlib

# -ffp-contract=fast: ``a += x * w`` is one fused multiply-add (the kernels' numerics).
FLAGS = ("-O3", "-std=c++17", "-ffp-contract=fast", "-shared", "-fPIC", "-w")
# Tried in order: the host's own instruction set, then the compiler's default target.
ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())


BUILD_TIMEOUT_S = 600


def first_error(stderr: str) -> str:
    """The compiler's first line naming an error (else its first line), stripped."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled (no C++ compiler, or it rejected the source)."""


def cache_dir() -> Path:
    """Where built kernels live: ``$JAXRLHF_KERNEL_CACHE`` or ``~/.cache/jaxrlhf/kernels``."""
    return Path(os.environ.get("JAXRLHF_KERNEL_CACHE", "~/.cache/jaxrlhf/kernels")).expanduser()


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` found."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor() or platform.machine()


def build(source: Path) -> Path:
    """The shared library of ``source`` (a ``.cc`` file), compiled now or found in the cache.

    Raises:
      KernelBuildError: no compiler; every ``ARCH_FLAGS`` choice failed to compile (the
        message has the compiler's first error line); the compiler ran past
        ``BUILD_TIMEOUT_S`` or could not start; or the cache directory is not writable.
    """
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    text = source.read_bytes()
    include = jax.ffi.include_dir()
    errors = []
    for arch in ARCH_FLAGS:
        flags = [*FLAGS, *arch]
        key = hashlib.sha256(
            b"\0".join(
                [
                    text,
                    cxx.encode(),
                    " ".join(flags).encode(),
                    jaxlib.__version__.encode(),
                    _cpu_flags().encode(),
                ]
            )
        ).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
        except OSError as e:
            raise KernelBuildError(
                f"cannot write the kernel cache {target.parent} ({e.strerror}; set "
                "JAXRLHF_KERNEL_CACHE to a writable directory)"
            ) from e
        os.close(fd)
        try:
            try:
                run = subprocess.run(
                    [cxx, *flags, "-isystem", include, str(source), "-o", tmp],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                )
            except (OSError, subprocess.SubprocessError) as e:  # e.g. the timeout
                raise KernelBuildError(f"{cxx} could not compile {source.name}: {e}") from e
            if run.returncode == 0:
                os.chmod(tmp, 0o755)  # mkstemp makes it private; others may share the cache
                os.replace(tmp, target)
                return target
            errors.append(f"{' '.join(arch) or 'default target'}: {first_error(run.stderr)}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise KernelBuildError(f"{cxx} could not compile {source.name} ({'; '.join(errors)})")


def register(source: Path, targets: dict[str, str], without: str) -> str | None:
    """Builds ``source`` (:func:`build`) and registers its exported FFI handlers with XLA,
    ``{CPU custom-call target: handler symbol}``. Returns None once registered, else why
    not: ``JAXRLHF_CPU_KERNELS=0`` in the environment, or the build or load failed (also
    warned: "jaxrlhf: {without}, the {source} kernel is unavailable: ...", ``without``
    saying what runs instead). Call it once per process (the kernels' modules cache it)."""
    if os.environ.get("JAXRLHF_CPU_KERNELS", "1") == "0":
        return "turned off by JAXRLHF_CPU_KERNELS=0"
    try:
        library = ctypes.cdll.LoadLibrary(str(build(source)))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
            )
    except (KernelBuildError, OSError, AttributeError) as e:
        warnings.warn(
            f"jaxrlhf: {without}, the {source.stem} kernel is unavailable: {e}", stacklevel=4
        )
        return str(e)
    return None
