"""torch's own argument errors: every input torch's optimizer tests reject for Adam, AdamW and
RAdam (``optim_error_inputs_func_*`` in ``torch.testing._internal.common_optimizers``) is
rejected by the fused counterparts with the same exception (or warning) type, and every torch
option they cannot honour raises ``NotImplementedError`` naming the feature."""
from __future__ import annotations

import warnings

import pytest
import torch

from fused_optim import FusedAdam, FusedAdamW, FusedEmaAdamW, FusedRAdam

co = pytest.importorskip("torch.testing._internal.common_optimizers",
                         reason="torch's optimizer test inputs need expecttest (bootstrap --test)")

# (torch's error-input function, the torch optimizer, the fused counterparts)
PAIRS = [
    ("optim_error_inputs_func_adam", torch.optim.Adam, (FusedAdam, FusedEmaAdamW)),
    ("optim_error_inputs_func_adamw", torch.optim.AdamW, (FusedAdamW, FusedEmaAdamW)),
    ("optim_error_inputs_func_radam", torch.optim.RAdam, (FusedRAdam,)),
]
CASES = [(fn, torch_cls, fused_cls, i)
         for fn, torch_cls, fused in PAIRS
         for fused_cls in fused
         for i in range(len(getattr(co, fn)("cpu", torch.float32)))]


def _raised(cls, params, kwargs):
    """What constructing (and, when that works, stepping) ``cls`` warns and raises: the
    UserWarning types, then the exception type (a warning comes first: a duplicate param is
    warned about by torch's ``add_param_group``, and refused by our step)."""
    raised = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = cls(params, **kwargs)
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.ones_like(p)
            opt.step()
        except Exception as exc:  # the type is what is compared
            raised.append(type(exc))
    return [w.category for w in caught if issubclass(w.category, UserWarning)] + raised


@pytest.mark.parametrize("fn,torch_cls,fused_cls,index", CASES,
                         ids=[f"{c[2].__name__}-{c[0].rsplit('_', 1)[-1]}-{c[3]}" for c in CASES])
def test_same_exception_type_as_torch(fn, torch_cls, fused_cls, index):
    error_input = getattr(co, fn)("cpu", torch.float32)[index]
    optim_input = error_input.optimizer_error_input
    kwargs = dict(optim_input.kwargs)

    def params():
        if optim_input.params is not None:
            return optim_input.params
        return [torch.nn.Parameter(torch.randn(2, 3))]

    expected = error_input.error_type
    assert _raised(torch_cls, params(), kwargs)  # torch rejects it here too
    if issubclass(expected, UserWarning) and "duplicate parameters" in optim_input.desc:
        # torch warns and then updates the param twice per step; ours warns alike when the group
        # is made and refuses the step (the result of a double update depends on the backend)
        with pytest.warns(expected):
            opt = fused_cls(params(), **kwargs)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match="is the same tensor as"):
            opt.step()
        return
    got = _raised(fused_cls, params(), kwargs)
    assert got and issubclass(got[0], expected), (
        f"{fused_cls.__name__}({optim_input.desc}): torch raises {expected.__name__}, "
        f"ours {[t.__name__ for t in got]}")


UNSUPPORTED = ["amsgrad", "differentiable"]  # capturable=True is supported (the Triton backend)
OPTIMIZERS = {
    FusedEmaAdamW: UNSUPPORTED,
    FusedAdamW: UNSUPPORTED,
    FusedAdam: UNSUPPORTED,
    FusedRAdam: ["differentiable"],  # torch's RAdam has no amsgrad
}
FEATURE = {"amsgrad": "AMSGrad", "differentiable": "differentiable"}


@pytest.mark.parametrize("cls,flag", [(c, f) for c, fs in OPTIMIZERS.items() for f in fs],
                         ids=[f"{c.__name__}-{f}" for c, fs in OPTIMIZERS.items() for f in fs])
def test_unsupported_torch_option_names_the_feature(cls, flag):
    with pytest.raises(NotImplementedError, match=FEATURE[flag]):
        cls([torch.nn.Parameter(torch.zeros(2))], **{flag: True})
