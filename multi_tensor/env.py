"""Environment report: ``python -m multi_tensor.env``.

Prints the torch version, the CPU capability torch reports (``ATEN_CPU_CAPABILITY`` honoured),
which native extension module loaded (or why not), and, for every available device type (cpu;
cuda when available; npu when ``torch_npu`` imports), the backend each op resolves to.
"""
from __future__ import annotations

import importlib
import os
import sys

OPS = ("fused_ema_adamw", "adam", "radam", "radam_ema", "scale", "l2norm")


def _device_types():
    import torch

    types = ["cpu"]
    try:
        if torch.cuda.is_available():
            types.append("cuda")
    except Exception:
        pass
    try:  # never required: imported lazily, only to see whether an NPU is present
        importlib.import_module("torch_npu")
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            types.append("npu")
    except Exception:
        pass
    return types


def report() -> str:
    import torch

    from . import backends
    from .backends import cpu as native_cpu

    lines = [f"python            {sys.version.split()[0]}",
             f"torch             {torch.__version__}"]
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception as exc:  # pragma: no cover
        cap = f"unknown ({exc})"
    env_cap = os.environ.get("ATEN_CPU_CAPABILITY")
    lines.append(f"cpu capability    {cap}" + (f" (ATEN_CPU_CAPABILITY={env_cap})" if env_cap else ""))
    lines.append(f"torch threads     {torch.get_num_threads()}")
    mod = native_cpu.loaded_module
    if mod is not None:
        lines.append(f"native extension  {mod.__name__} ({native_cpu.capability}, IEEE sqrt/div)")
        lines.append(f"                  {getattr(mod, '__file__', '?')}")
    else:
        lines.append(f"native extension  not loaded: {native_cpu.load_error}")
    lines.append("registered backends:")
    for b in backends.registered_backends():
        lines.append(f"  {b.name:<12} priority {b.priority:>3}  devices {','.join(b.device_types):<10} "
                     f"ops {','.join(sorted(b.ops))}  - {b.description}")
        for line in (b.report() if callable(getattr(b, "report", None)) else ()):
            lines.append(f"  {'':<12} {line}")
    lines.append("op resolution:")
    for dev in _device_types():
        for op in OPS:
            try:
                name = backends.backend_for(op, dev).name
            except NotImplementedError as exc:
                name = f"none ({exc})"
            lines.append(f"  {dev:<5} {op:<16} -> {name}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
