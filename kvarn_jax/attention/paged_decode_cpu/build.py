"""Builds `kernel.cc` into a shared library with the machine's C++ compiler, once per machine and
source, and registers its handler with XLA's CPU backend (`jax.ffi`).

The library is cached under `$KVARN_JAX_CACHE` (default `~/.cache/kvarn_jax`) by a hash of the
source, the compiler and its flags, jaxlib's version and the CPU's instruction set; later processes
load it without compiling (a build takes ~10 s). It is compiled for the CPU it runs on
(`-march=native`). `CXX` names the compiler (default `g++`; any C++17 compiler that takes GCC's
flags). Without one, `load` raises `NativeKernelUnavailable` saying so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

TARGET = "kvarn_decode_cpu"
SOURCE = Path(__file__).with_name("kernel.cc")


class NativeKernelUnavailable(RuntimeError):
    """The CPU kernel could not be built or loaded (no C++ compiler, or it failed)."""


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model and flags where Linux says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep)))


def compiler() -> str | None:
    """The C++ compiler the build uses (`CXX` or g++), or None if there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _flags(include: str, arch: list[str] | None = None) -> list[str]:
    return ["-O3", "-std=c++17", "-fopenmp-simd", "-shared", "-fPIC",
            *(_arch_flags() if arch is None else arch), f"-I{include}"]


def library(arch: list[str] | None = None) -> Path:
    """The built library for this machine: from the cache, or compiled into it now. Raises
    NativeKernelUnavailable with the reason. arch: the instruction-set flags to compile for instead
    of this CPU's (`-march=native`); the tests build the AVX2 and baseline x86-64 paths with it."""
    import jax
    import jaxlib

    cxx = compiler()
    if cxx is None:
        raise NativeKernelUnavailable(
            f"the CPU decode kernel is compiled on first use and needs a C++17 compiler: none found "
            f"({os.environ.get('CXX', 'g++')!r}; set CXX, or install one, e.g. `apt install g++`), "
            "or pass impl='reference'")
    flags = _flags(jax.ffi.include_dir(), arch)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeKernelUnavailable(f"the C++ compiler {cxx} does not run: {e}") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, *flags, jaxlib.__version__,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("KVARN_JAX_CACHE") or Path.home() / ".cache" / "kvarn_jax") / "cpu_kernel"
    lib = root / f"{key}.so"
    if not lib.exists():
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)  # built aside, then renamed: concurrent builds are safe
        os.close(fd)
        try:
            done = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if done.returncode:
                raise NativeKernelUnavailable(f"building the CPU decode kernel failed ({cxx}):\n{done.stderr[-4000:]}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def _loaded() -> tuple[str | None, str | None]:
    """(target, None), or (None, why not): the library loaded and its handler registered with XLA's
    CPU backend, tried once per process."""
    import jax

    try:
        handle = ctypes.cdll.LoadLibrary(str(library()))
    except (NativeKernelUnavailable, OSError) as e:
        return None, str(e)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.KvarnDecodeCpu), platform="cpu")
    return TARGET, None


def load() -> str:
    """The target name `jax.ffi.ffi_call` takes (the library built and registered on first use).
    Raises NativeKernelUnavailable with the reason it cannot be."""
    target, why = _loaded()
    if why is not None:
        raise NativeKernelUnavailable(why)
    return target


def available() -> str | None:
    """None if the kernel loads, else why not."""
    return _loaded()[1]
