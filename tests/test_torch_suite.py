"""torch's own optimizer test suite (``TestOptimRenewed``) run against our four optimizers.

torch's ``test/test_optim.py`` drives every test with ``@optims(optim_db, ...)``, one
``OptimizerInfo`` per torch optimizer. Here its pinned copy (see ``PINNED`` below) is imported
while ``common_optimizers.optim_db`` is our list, so its decorators parametrize over these
entries, built like torch's Adam/AdamW/RAdam ones (the same inputs, error inputs, LR schedulers
and tolerances):

* ``FusedAdam`` with ``adam_w_mode=False``, the mode ``torch.optim.Adam`` implements;
* ``FusedAdamW`` (``torch.optim.AdamW``), ``FusedRAdam`` (``torch.optim.RAdam``);
* ``FusedEmaAdamW`` (``torch.optim.AdamW``, plus the EMA).

The inputs with ``amsgrad=True`` are dropped (we raise ``NotImplementedError`` for it), and
``differentiable`` is not among the implementations we declare (``differentiable=True`` raises
``NotImplementedError`` too). ``foreach`` and ``fused`` are accepted by our optimizers (every
step is one fused call per bucket either way), so both are declared where the constructor takes
them. Where torch's tests compare an implementation with the for-loop one
(``test_foreach_matches_forloop``, ``test_fused_matches_forloop``), the flag off is torch's
for-loop optimizer and the flag on is ours: ours is compared with torch, not with itself.

The tests run on CPU only; those marked ``onlyCUDA`` or needing several GPUs skip with torch's
reason. ``test_adamw_serialization`` and ``test_step_iteration`` construct only
``torch.optim.AdamW`` / ``LBFGS`` (no optimizer of ours), so they are skipped saying so.
``test_fused_large_tensor`` (2**32-element params) is skipped for its time and memory. 233 tests,
186 run on CPU, in about 25 s on 2 cores, none over 2 s, on a machine with the pinned copy: the
copy is not in the repository, so CI (a fresh clone) skips this module (tests/torch_suite/README.md).
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import os
import pathlib
import unittest

import pytest
import torch

common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers",
    reason="torch.testing._internal needs expecttest (tools/bootstrap.sh --test installs it)")

from torch.testing._internal.common_device_type import (  # noqa: E402
    instantiate_device_type_tests, tol, toleranceOverride)
from torch.testing._internal.common_optimizers import DecorateInfo, OptimizerInfo  # noqa: E402

from fused_optim import FusedAdam, FusedAdamW, FusedEmaAdamW, FusedRAdam  # noqa: E402

# torch's test/test_optim.py for the installed torch (2.13.0); provenance and edits in its header
# and in tests/torch_suite/README.md. FUSED_OPTIM_TORCH_OPTIM_SUITE may name another copy.
PINNED = pathlib.Path(os.environ.get(
    "FUSED_OPTIM_TORCH_OPTIM_SUITE",
    pathlib.Path(__file__).parent / "torch_suite" / "optim_suite_pinned.py"))
if not PINNED.is_file():
    pytest.skip(f"torch's optimizer test suite is not at {PINNED} (see tests/torch_suite/README.md "
                f"for the torch file and commit it is pinned to)", allow_module_level=True)

_TORCH_INFO = {info.optim_cls: info for info in common_optimizers.optim_db}

# what our constructors take and torch's do not; dropped when the same inputs build torch's
_OURS_ONLY = ("adam_w_mode", "master_weights")


def _inputs(torch_cls, extra=None):
    """torch's inputs for ``torch_cls`` without the amsgrad ones, with ``extra`` in each."""
    torch_inputs = _TORCH_INFO[torch_cls].optim_inputs_func

    def optim_inputs_func(device, dtype=None):
        inputs = [i for i in torch_inputs(device, dtype) if not i.kwargs.get("amsgrad")]
        for i in inputs:
            i.kwargs.update(extra or {})
        return inputs
    return optim_inputs_func


def _swap_info(transform):
    """A decorator that hands the test ``transform(optim_info)`` in place of its optim_info."""
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            kwargs["optim_info"] = transform(kwargs["optim_info"])
            return fn(self, *args, **kwargs)
        return wrapper
    return decorator


def _against_torch(flag):
    """optim_info whose class is torch's for-loop optimizer with ``flag`` False, ours with it True.

    Ours keeps no fp32 master here: torch keeps fp16/bf16 state in the param's dtype, and the
    test compares every state tensor torch has (ours may hold more, e.g. the EMA)."""
    def transform(info):
        def make(params, **kwargs):
            if kwargs.pop(flag):
                return info.optim_cls(params, **{flag: True, **kwargs, "master_weights": False})
            kwargs = {k: v for k, v in kwargs.items() if k not in _OURS_ONLY}
            return info.torch_cls(params, foreach=False, **kwargs)
        make.__name__ = f"{info.torch_cls.__name__}_vs_{info.optim_cls.__name__}"
        swapped = copy.copy(info)
        swapped.optim_cls = make
        return swapped
    return transform


def _without_default_decay(info):
    """``test_step_is_noop_for_zero_grads`` sets ``weight_decay=0`` for torch's AdamW by class
    name (its default decay moves params even with zero grads); the same for ours."""
    swapped = copy.copy(info)
    inputs = info.optim_inputs_func

    def optim_inputs_func(device, dtype=None):
        out = inputs(device, dtype)
        for i in out:
            i.kwargs.setdefault("weight_decay", 0.0)
        return out
    swapped.optim_inputs_func = optim_inputs_func
    return swapped


# torch's test steps 2**32-element fp16 params where the machine has 64 GB: minutes of CPU time
# and memory this suite's budget does not have (it skips for memory on smaller machines anyway)
_LARGE = DecorateInfo(unittest.skip("2**32-element params (64 GB): beyond this suite's time and "
                                    "memory budget on CPU"),
                      "TestOptimRenewed", "test_fused_large_tensor")


def _info(cls, torch_cls, impls, extra=None, decorators=()):
    torch_info = _TORCH_INFO[torch_cls]
    comparisons = [DecorateInfo(_swap_info(_against_torch(flag)), "TestOptimRenewed",
                                f"test_{flag}_matches_forloop") for flag in impls]
    comparisons.append(_LARGE)
    info = OptimizerInfo(
        cls,
        optim_inputs_func=_inputs(torch_cls, extra),
        optim_error_inputs_func=torch_info.optim_error_inputs_func,
        scheduler_inputs=torch_info.scheduler_inputs,
        supported_impls=impls,
        not_og_supported_flags=torch_info.not_og_supported_flags,
        supports_fused_on=("cpu",) if "fused" in impls else (),
        has_capturable_arg=True,
        supports_complex=True,
        # torch's entry's tolerances (and dynamo skips) apply to the same tests of ours
        decorators=(*torch_info.decorators, *comparisons, *decorators),
    )
    info.torch_cls = torch_cls
    return info


_DECOUPLED_DEFAULT = (DecorateInfo(_swap_info(_without_default_decay), "TestOptimRenewed",
                                   "test_step_is_noop_for_zero_grads"),)

OUR_OPTIM_DB = [
    _info(FusedAdam, torch.optim.Adam, ("foreach", "fused"), extra={"adam_w_mode": False}),
    _info(FusedAdamW, torch.optim.AdamW, ("foreach", "fused"), decorators=_DECOUPLED_DEFAULT),
    _info(FusedRAdam, torch.optim.RAdam, ("foreach",),
          # torch's RAdam entry loosens only the foreach comparison's fp64 tolerance; ours is
          # compared with torch's for-loop there, so the same tolerance applies
          decorators=(DecorateInfo(toleranceOverride({torch.float64: tol(atol=1.5e-7, rtol=1.1e-7)}),
                                   "TestOptimRenewed", "test_foreach_matches_forloop"),)),
    _info(FusedEmaAdamW, torch.optim.AdamW, ("foreach", "fused"), decorators=_DECOUPLED_DEFAULT),
]


def _load_suite():
    """Import the pinned file with ``optim_db`` = ours (its decorators read it at import)."""
    saved = common_optimizers.optim_db
    common_optimizers.optim_db = OUR_OPTIM_DB
    try:
        spec = importlib.util.spec_from_file_location("_torch_optim_suite", PINNED)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        common_optimizers.optim_db = saved
    return module


_suite = _load_suite()

_TORCH_ONLY = {
    "test_adamw_serialization": "constructs torch.optim.AdamW/Adam only, no optimizer of ours",
    "test_step_iteration": "constructs torch.optim.LBFGS only, no optimizer of ours",
}
for _name, _why in _TORCH_ONLY.items():
    setattr(_suite.TestOptimRenewed, _name, unittest.skip(_why)(getattr(_suite.TestOptimRenewed, _name)))

TestOptimRenewed = _suite.TestOptimRenewed  # replaced by TestOptimRenewedCPU below
instantiate_device_type_tests(TestOptimRenewed, globals(), only_for="cpu")
