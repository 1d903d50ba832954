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

The cache is trusted only when it is the user's own: a library found there runs inside every
training process, so the cache directory, the build's key directory and the module must each be
owned by the current user and writable by no one else (ssh's StrictModes, op-plugin's
``checkOwner``). Otherwise (a cache on a shared directory, where another user could plant a
library at the predictable path) nothing there is loaded or written: the kernels are built into
a private directory of this process (mode 0700), with one warning saying why. The cache's
directories are made 0700 and its modules 0755 whatever the umask.

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
import stat
import subprocess
import sys
import sysconfig
import tempfile
import warnings
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


def cache_root() -> str:
    """The cache directory: ``$FUSED_OPTIM_CACHE``, default ``~/.cache/fused_optim``."""
    return os.environ.get("FUSED_OPTIM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fused_optim")


def cache_path(isa: str, root: Optional[str] = None) -> str:
    """Where the first-use build of ``isa`` lives under ``root`` (default :func:`cache_root`):
    ``<root>/<key>/_C_<isa><suffix>``, a new key for new sources, flags or torch."""
    import torch

    src = source_dir()
    key = hashlib.sha256("\n".join([
        _sources_digest(src), " ".join(COMMON_FLAGS + ISA_FLAGS[isa] + LINK_FLAGS),
        torch.__version__, sys.version, os.environ.get("CXX", "c++")]).encode()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return os.path.join(root or cache_root(), key, f"_C_{isa}{suffix}")


def _current_uid() -> int:
    return os.getuid()


def untrusted(path: str) -> Optional[str]:
    """Why the cache module or directory at ``path`` (with everything above it up to the cache
    directory) must not be trusted, or None: each that exists must be owned by the current user
    and not writable by its group or by others."""
    key_dir = os.path.dirname(path)
    for p in (os.path.dirname(key_dir), key_dir, path):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if st.st_uid != _current_uid():
            return f"{p} is owned by uid {st.st_uid}, not by this user (uid {_current_uid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return (f"{p} is writable by its group or by others (mode "
                    f"{stat.S_IMODE(st.st_mode):04o})")
    return None


_private: List[str] = []  # this process's private build directory, once made


def _private_root(why: str) -> str:
    """A directory only this process's user can use (``mkdtemp``: mode 0700), made once, with
    the one warning that the cache is not used."""
    if not _private:
        _private.append(tempfile.mkdtemp(prefix="fused_optim-"))
        warnings.warn(
            f"fused-optim: the native kernels' build cache is not used: {why}. Another user "
            f"could place a library there that every training process would load. Building "
            f"into the private directory {_private[0]} instead (again in every process). Make "
            f"the cache yours and writable only by you (chown, chmod go-w), or set "
            f"FUSED_OPTIM_CACHE to such a directory.", RuntimeWarning, stacklevel=3)
    return _private[0]


def build(isa: str, *, quiet: bool = False) -> str:
    """Compile ``isa`` into the cache unless it is there; returns the module's path."""
    if source_dir() is None:
        raise BuildError("the C++ sources are not installed (multi_tensor/_csrc is missing)")
    path = cache_path(isa)
    why = untrusted(path)
    if why is not None:
        path = cache_path(isa, _private_root(why))
    if os.path.exists(path):
        return path
    for directory in (os.path.dirname(os.path.dirname(path)), os.path.dirname(path)):
        os.makedirs(directory, mode=0o700, exist_ok=True)
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
        os.chmod(tmp, 0o755)  # the linker's mode follows the umask, which may let the group write
        os.replace(tmp, path)
    return path


def load(isa: str, path: str):
    """Import a built ``_C_<isa>`` module from ``path`` (:func:`build`'s), refusing one that is
    not trusted (:func:`untrusted`) now."""
    import importlib.util

    why = untrusted(path)
    if why is not None:
        raise BuildError(f"not loading {path}: {why}")

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
