"""fused-optim: apex-style fused multi-tensor optimizers for PyTorch.

Install (torch must already be installed; it is deliberately NOT a dependency, so pip never
fetches a multi-GB CUDA build)::

    pip install ninja                                   # optional, parallel + faster builds
    pip install --no-build-isolation --use-pep517 -e .  # editable / development install
    pip install --no-build-isolation --use-pep517 .     # regular install

``--no-build-isolation`` is required: the C++ extensions are built against the torch that is
already installed in this environment. Build time (2 cores, gcc 12, ninja): about 90 s for all
three ISA builds (one unity translation unit each, built concurrently).

What gets built: the native CPU backend (``csrc/cpu``) compiled three times from the same sources
into ``multi_tensor._C_avx512``, ``multi_tensor._C_avx2`` and ``multi_tensor._C_default``; at
import ``multi_tensor.backends.native_cpu`` picks the best one that
``torch.backends.cpu.get_cpu_capability()`` allows (``ATEN_CPU_CAPABILITY`` is honoured). No
``-march=native``: one build runs on any x86-64 CPU.

Environment:
    FUSED_OPTIM_NO_EXT=1   install pure Python (the reference backend runs everything)
    MAX_JOBS=N             parallel compile jobs (honoured by torch's BuildExtension/ninja)
    FUSED_OPTIM_CPU_ISAS   comma list restricting the builds, e.g. "avx512,default"

If torch is not importable at build time, the package installs as pure Python.
Check the result with ``python -m multi_tensor.env``.
"""
import os
import platform
import threading

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# The same sources per ISA; -ffp-contract=off keeps GCC from fusing a*b+c into an FMA, which
# would change the bits relative to the reference backend.
# One unity TU per ISA: csrc/cpu/isa/unity_<isa>.cpp includes csrc/cpu/unity.cpp, which includes
# adam_family.cpp, scale_l2norm.cpp and module.cpp (distinct paths -> distinct object files).
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-std=c++17",
                "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
ISA_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
               "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}


def _ext_modules():
    if os.environ.get("FUSED_OPTIM_NO_EXT", "0") not in ("", "0"):
        print("fused-optim: FUSED_OPTIM_NO_EXT set; installing pure Python")
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # torch missing or broken: pure Python install
        print(f"fused-optim: torch not importable ({exc}); installing pure Python")
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
            extra_compile_args=COMMON_FLAGS + ISA_FLAGS[isa],
            # torch ships libgomp.so.1 and loads it first; linking -fopenmp resolves to that copy,
            # so torch.set_num_threads() governs our parallel regions too.
            extra_link_args=["-fopenmp"],
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

setup(
    name="fused-optim",
    version="0.1.0",
    description="apex-style fused multi-tensor optimizers (AdamW + EMA) for PyTorch",
    packages=find_packages(include=["multi_tensor*", "fused_optim*"]),
    python_requires=">=3.9",
    install_requires=[],  # torch must already be installed; never list it here
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
