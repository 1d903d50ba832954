"""Build the native CPU kernels: ahead of time, or on first use into a cache.

Two ways to get the kernels, one set of flags (this module; ``setup.py`` reads it too):

* ahead of time: ``pip install --no-build-isolation .`` (or ``-e .``) builds them against the
  torch in the environment, as apex is installed; ``python -m multi_tensor.build`` builds them
  into the cache for an installed package;
* on first use: a plain ``pip install .`` builds in an isolated environment where torch is not
  importable (and must not be downloaded: pip would fetch a multi-GB CUDA build), so the wheel
  ships the C++ sources instead, and the first ``import multi_tensor`` compiles the one build
  this CPU needs (about 40 s on 2 cores, said on stderr) into
  ``$FUSED_OPTIM_CACHE`` (default ``~/.cache/fused_optim``), keyed by the sources, the flags,
  torch and Python, as DeepSpeed's and MindSpeed's op builders do.

The compiler is called directly (``$CXX``, default ``c++``): one translation unit per ISA, so
no ninja is needed. A failed build raises :class:`BuildError` with the compiler's output; the
native backend then warns with it and the reference backend runs.

This file imports nothing from the package and torch only inside functions, so ``setup.py``
can load it on its own.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from typing import Dict, List, Optional

# -ffp-contract=off keeps the compiler from fusing a*b+c into an FMA (the numerics contract,
# multi_tensor/rules.py); no -ffast-math for the same reason.
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-std=c++17",
                "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
ISA_FLAGS: Dict[str, List[str]] = {
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
               "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}
# torch ships libgomp and loads it first; linking -fopenmp resolves to that copy, so
# torch.set_num_threads() governs our parallel regions too.
LINK_FLAGS = ["-fopenmp"]


class BuildError(RuntimeError):
    """The native kernels could not be compiled (the message holds the compiler's output)."""


def source_dir() -> Optional[str]:
    """The C++ sources: the repository's ``csrc`` (source tree, editable install) or the copy a
    wheel ships as ``multi_tensor/_csrc``."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(os.path.dirname(here), "csrc"), os.path.join(here, "_csrc")):
        if os.path.isfile(os.path.join(candidate, "cpu", "unity.cpp")):
            return candidate
    return None


def isa_source(isa: str, src: Optional[str] = None) -> str:
    return os.path.join(src or source_dir() or "", "cpu", "isa", f"unity_{isa}.cpp")


def _sources_digest(src: str) -> str:
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(src)):
        for name in sorted(files):
            if name.endswith((".cpp", ".h")):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, src).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def compile_command(isa: str, output: str, src: Optional[str] = None) -> List[str]:
    """The compiler command that builds ``multi_tensor._C_<isa>`` into ``output``."""
    import torch
    from torch.utils import cpp_extension

    src = src or source_dir()
    includes = cpp_extension.include_paths() + [sysconfig.get_paths()["include"],
                                                os.path.join(src, "cpu")]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = cpp_extension.library_paths()[0]
    return ([os.environ.get("CXX", "c++"), "-shared", "-fPIC", *COMMON_FLAGS, *ISA_FLAGS[isa],
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME=_C_{isa}",
             "-DTORCH_API_INCLUDE_EXTENSION_H"]
            + [f"-I{p}" for p in includes]
            + [isa_source(isa, src), "-o", output, f"-L{lib}", f"-Wl,-rpath,{lib}",
               "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", *LINK_FLAGS])


def cache_path(isa: str) -> str:
    """Where the first-use build of ``isa`` lives (a new key for new sources, flags or torch)."""
    import torch

    src = source_dir()
    key = hashlib.sha256("\n".join([
        _sources_digest(src), " ".join(COMMON_FLAGS + ISA_FLAGS[isa] + LINK_FLAGS),
        torch.__version__, sys.version, os.environ.get("CXX", "c++")]).encode()).hexdigest()[:16]
    root = os.environ.get("FUSED_OPTIM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fused_optim")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return os.path.join(root, key, f"_C_{isa}{suffix}")


def build(isa: str, *, quiet: bool = False) -> str:
    """Compile ``isa`` into the cache unless it is there; returns the module's path."""
    if source_dir() is None:
        raise BuildError("the C++ sources are not installed (multi_tensor/_csrc is missing)")
    path = cache_path(isa)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    import fcntl

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if os.path.exists(path):
            return path
        if not quiet:
            print(f"fused-optim: building the native CPU kernels ({isa}) into "
                  f"{os.path.dirname(path)} (first use; about 40 s on 2 cores)",
                  file=sys.stderr, flush=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        cmd = compile_command(isa, tmp)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"compiling the {isa} kernels failed ({shlex.join(cmd[:1])} exit "
                             f"{proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
        os.replace(tmp, path)
    return path


def load(isa: str, path: str):
    """Import a built ``_C_<isa>`` module from ``path``."""
    import importlib.util

    name = f"multi_tensor._C_{isa}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the native CPU kernels into the cache.")
    parser.add_argument("--isa", action="append", choices=sorted(ISA_FLAGS),
                        help="ISA builds to make (default: the one this CPU uses)")
    args = parser.parse_args(argv)
    if args.isa:
        isas = args.isa
    else:
        import torch
        cap = str(torch.backends.cpu.get_cpu_capability()).lower()
        isas = [cap if cap in ISA_FLAGS else "default"]
    for isa in isas:
        print(build(isa))
    return 0


if __name__ == "__main__":
    sys.exit(main())
