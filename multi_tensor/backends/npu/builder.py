"""Builds the NPU backend's CANN binding (``csrc/npu/fused_ema_adam.cpp``) on first use.

Used only when MindSpeed (which ships the same operator binding) is not installed. Modelled on
MindSpeed's ``MindSpeedOpBuilder``: ``torch.utils.cpp_extension.load`` with torch_npu's and
CANN's include directories (torch_npu's first) and ``-lascendcl -ltorch_npu``; the built module is cached by
torch in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and reused by later
processes. The binding resolves ``aclnnApplyFusedEmaAdam`` at run time from the libraries torch_npu
searches, in its order (``csrc/npu/opapi_libs.h``), so it builds against any CANN that has the
headers named below.

Needs: torch_npu (importable), CANN (``ASCEND_HOME_PATH`` or ``ASCEND_TOOLKIT_HOME``, as set by
CANN's ``set_env.sh``; else ``/usr/local/Ascend/ascend-toolkit/latest``), a C++17 compiler.

Not verified here: this machine has neither torch_npu nor CANN, so the binding has never been
compiled in this repository's CI; ``tools/npu_check.py`` builds and exercises it on hardware.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List

from ... import build

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CANN = "/usr/local/Ascend/ascend-toolkit/latest"


class FusedEmaAdamBuilder:
    """``load()`` returns the compiled module (``npu_apply_fused_ema_adamw``, MindSpeed's signature)."""

    NAME = "multi_tensor_npu_fused_ema_adam"
    SOURCES = ("npu/fused_ema_adam.cpp",)

    def __init__(self, source_root: str = None):
        # the C++ sources: a checkout's csrc, or the copy a wheel ships (multi_tensor/_csrc)
        self.source_root = (source_root or os.environ.get("MULTI_TENSOR_NPU_SOURCE_ROOT")
                            or build.source_dir() or os.path.join(_ROOT, "csrc"))

    # --- paths ----------------------------------------------------------------------------------
    @staticmethod
    def cann_path() -> str:
        for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
            path = os.environ.get(var)
            if path and os.path.isdir(path):
                return path
        return DEFAULT_CANN

    @staticmethod
    def torch_npu_path() -> str:
        import torch_npu

        return os.path.dirname(os.path.abspath(torch_npu.__file__))

    def sources(self) -> List[str]:
        paths = [os.path.join(self.source_root, s) for s in self.SOURCES]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"the NPU binding's source is missing ({', '.join(missing)}): point "
                f"MULTI_TENSOR_NPU_SOURCE_ROOT at a checkout's csrc, or install MindSpeed (its op "
                f"is used instead)")
        return paths

    def include_paths(self) -> List[str]:
        """torch_npu's include directories before CANN's, as MindSpeed's builder orders them
        (``mindspeed/op_builder/builder.py``, ``MindSpeedOpBuilder.include_paths``: torch_npu's
        ``include``, ``include/third_party/hccl/inc``, ``include/third_party/acl/inc``, then
        ``$ASCEND_HOME_PATH/include``; ``fused_ema_adamw_builder.py`` appends torch's and
        torch_npu's framework directories): the acl headers torch_npu was built against win over
        a different CANN's."""
        import torch

        cann, npu = self.cann_path(), self.torch_npu_path()
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        return [
            os.path.join(npu, "include"),
            os.path.join(npu, "include", "third_party", "hccl", "inc"),
            os.path.join(npu, "include", "third_party", "acl", "inc"),
            os.path.join(cann, "include"),
            os.path.join(cann, "include", "aclnn"),
            os.path.join(torch_dir, "include"),
            os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
            os.path.join(npu, "include", "torch_npu", "csrc", "framework", "utils"),
            os.path.join(npu, "include", "torch_npu", "csrc", "aten"),
        ]

    def cxx_args(self) -> List[str]:
        # no -std: torch.utils.cpp_extension passes the standard the installed torch needs
        return ["-O2", "-fstack-protector-all", "-fPIC", "-Wno-narrowing"]

    def extra_ldflags(self) -> List[str]:
        cann, npu = self.cann_path(), self.torch_npu_path()
        return ["-L" + os.path.join(cann, "lib64"), "-lascendcl",
                "-L" + os.path.join(npu, "lib"), "-ltorch_npu", "-ldl"]

    def build_args(self) -> Dict[str, object]:
        """The keyword arguments of ``torch.utils.cpp_extension.load`` (inspectable without building)."""
        return dict(name=self.NAME, sources=self.sources(),
                    extra_include_paths=[p for p in self.include_paths() if os.path.isdir(p)],
                    extra_cflags=self.cxx_args(), extra_ldflags=self.extra_ldflags())

    # --- build ----------------------------------------------------------------------------------
    def load(self, verbose: bool = False):
        """The compiled module, building it on first use (cached across processes by torch)."""
        module = sys.modules.get(self.NAME)
        if module is not None:
            return module
        from torch.utils.cpp_extension import load

        module = load(verbose=verbose, **self.build_args())
        sys.modules[self.NAME] = module
        return module
