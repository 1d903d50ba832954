"""fused-optim: apex-style fused multi-tensor optimizers for PyTorch.

Install (torch must already be installed; it is deliberately NOT a dependency, so pip never
fetches a multi-GB CUDA build)::

    pip install .                                       # kernels built on first import
    pip install --no-build-isolation .                  # kernels built now, against this torch
    pip install --no-build-isolation --use-pep517 -e .  # development

A plain ``pip install .`` builds in an isolated environment where torch is not importable, so
the C++ kernels cannot be built there: the wheel then carries the C++ sources
(``multi_tensor/_csrc``) and the first ``import multi_tensor`` compiles the build this CPU needs
into a cache (``multi_tensor/build.py``; about 40 s on 2 cores, said on stderr). With
``--no-build-isolation`` all three ISA builds are compiled at install time (about 90 s on 2 cores
with ninja, built concurrently). Either way the kernels exist before the first step: never a
silent pure-Python install.

What gets built: the native CPU backend (``csrc/cpu``) compiled three times from the same sources
into ``multi_tensor._C_avx512``, ``multi_tensor._C_avx2`` and ``multi_tensor._C_default``; at
import ``multi_tensor.backends.cpu`` picks the best one that
``torch.backends.cpu.get_cpu_capability()`` allows (``ATEN_CPU_CAPABILITY`` is honoured). No
``-march=native``: one build runs on any x86-64 CPU.

Environment:
    FUSED_OPTIM_NO_EXT=1   build no extension now (first use builds one, unless FUSED_OPTIM_NO_JIT=1)
    MAX_JOBS=N             parallel compile jobs (honoured by torch's BuildExtension/ninja)
    FUSED_OPTIM_CPU_ISAS   comma list restricting the builds, e.g. "avx512,default"

Check the result with ``python -m multi_tensor.env``.
"""
import importlib.util
import os
import platform
import shutil
import threading

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_build_module():
    """multi_tensor/build.py on its own (the package itself needs torch at import)."""
    spec = importlib.util.spec_from_file_location("_fused_optim_build",
                                                  os.path.join(HERE, "multi_tensor", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _load_build_module()


class BuildPyWithSources(build_py):
    """Ship the C++ sources inside the package (multi_tensor/_csrc) for first-use builds."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "multi_tensor", "_csrc")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "csrc"), target,
                        ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))


def _ext_modules():
    if os.environ.get("FUSED_OPTIM_NO_EXT", "0") not in ("", "0"):
        print("fused-optim: FUSED_OPTIM_NO_EXT set; the kernels are built on first use")
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # an isolated build: torch is not importable here
        print(f"fused-optim: torch is not importable in this build environment ({exc}); the "
              f"C++ sources are installed and the kernels are built on first import "
              f"(or now: pip install --no-build-isolation .)")
        return [], {}

    isas = ["avx512", "avx2", "default"]
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        isas = ["default"]
    wanted = os.environ.get("FUSED_OPTIM_CPU_ISAS")
    if wanted:
        isas = [i for i in isas if i in {w.strip().lower() for w in wanted.split(",")}]
    exts = []
    for isa in isas:
        exts.append(CppExtension(
            name=f"multi_tensor._C_{isa}",
            sources=[f"csrc/cpu/isa/unity_{isa}.cpp"],
            include_dirs=[os.path.join(HERE, "csrc", "cpu")],
            extra_compile_args=BUILD.COMMON_FLAGS + BUILD.ISA_FLAGS[isa],
            extra_link_args=BUILD.LINK_FLAGS,
        ))
    base = BuildExtension.with_options(use_ninja=_have_ninja())
    tls = threading.local()
    lock = threading.Lock()

    class ParallelBuildExtension(base):
        """Build the per-ISA extensions concurrently (each is one unity TU), MAX_JOBS at most.

        torch's ninja path writes ``build.ninja`` into the shared build_temp, so each extension
        compiles into its own subdirectory (the compiler's output_dir is redirected per thread).
        """

        def finalize_options(self):
            super().finalize_options()
            if not self.parallel:
                jobs = os.environ.get("MAX_JOBS")
                self.parallel = max(1, int(jobs) if jobs and jobs.isdigit() else (os.cpu_count() or 1))

        def build_extension(self, ext):
            with lock:
                if not getattr(self.compiler, "_fused_optim_per_ext_dir", False):
                    compile_ = self.compiler.compile

                    def compile_per_ext(sources, output_dir=None, *args, **kwargs):
                        sub = getattr(tls, "subdir", None)
                        if output_dir and sub:
                            output_dir = os.path.join(output_dir, sub)
                            os.makedirs(output_dir, exist_ok=True)
                        return compile_(sources, output_dir, *args, **kwargs)

                    self.compiler.compile = compile_per_ext
                    self.compiler._fused_optim_per_ext_dir = True
            tls.subdir = ext.name.rsplit(".", 1)[-1]
            try:
                super().build_extension(ext)
            finally:
                tls.subdir = None

    return exts, {"build_ext": ParallelBuildExtension}


def _have_ninja():
    try:
        from torch.utils.cpp_extension import is_ninja_available
        return is_ninja_available()
    except Exception:
        return False


ext_modules, cmdclass = _ext_modules()
cmdclass["build_py"] = BuildPyWithSources

setup(
    name="fused-optim",
    version="0.1.0",
    description="apex-style fused multi-tensor optimizers (AdamW + EMA) for PyTorch",
    # multi_tensor.testing (the NPU stand-in and the simulated 910B) serves the tests and tools of
    # a checkout; the package never imports it, so the wheel leaves it out.
    packages=find_packages(include=["multi_tensor*", "fused_optim*"],
                           exclude=["multi_tensor.testing", "multi_tensor.testing.*"]),
    python_requires=">=3.9",
    install_requires=[],  # torch must already be installed; never list it here
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
