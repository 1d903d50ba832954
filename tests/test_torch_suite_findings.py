"""What torch's optimizer test suite (tests/test_torch_suite.py) found, tested on its own, so it
is covered where that suite's torch file is not present.

* ``state_dict()`` passes entries of ``optimizer.state`` that are not a param's through, as torch;
* ``load_state_dict(opt.state_dict())`` leaves the state dict, the groups and the defaults as
  they were (torch's ``__setstate__`` adds ``differentiable`` to the defaults);
* ``copy.deepcopy`` and pickle keep what is kept on the instance (``max_grad_norm``,
  ``fused_unscale``, ``set_grad_none``, ``chunk_size``, ``last_ema_decays``, a stored or swapped
  EMA); ``load_state_dict`` keeps the loading optimizer's own;
* option errors start with torch's text (``Invalid learning rate: -1``, ...);
* a step of params on the meta device is refused and creates no state.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fused_optim import FusedAdam, FusedAdamW, FusedEmaAdamW, FusedRAdam
from multi_tensor import ops

CLASSES = {
    "FusedAdam": lambda params, **kw: FusedAdam(params, adam_w_mode=False, **kw),
    "FusedAdamW": FusedAdamW,
    "FusedRAdam": FusedRAdam,
    "FusedEmaAdamW": FusedEmaAdamW,
}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 2, generator=g)),
            torch.nn.Parameter(torch.randn(3, generator=g))]


def _step(opt, params, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    opt.step()


@pytest.mark.parametrize("name", CLASSES)
def test_state_dict_passes_non_param_entries_through(name):
    params = _params()
    opt = CLASSES[name](params, lr=1e-2)
    _step(opt, params)
    opt.state["test"] = 1
    state_dict = opt.state_dict()
    assert state_dict["state"]["test"] == 1
    assert set(state_dict["state"]) == {0, 1, "test"}
    assert state_dict["state"][0]["step"] is not opt.state[params[0]]["step"]  # own copies still


@pytest.mark.parametrize("name", CLASSES)
def test_loading_own_state_dict_changes_nothing(name):
    params = _params()
    opt = CLASSES[name](params, lr=1e-2)
    _step(opt, params)
    saved = copy.deepcopy(opt.state_dict())
    defaults = dict(opt.defaults)
    opt.load_state_dict(opt.state_dict())
    assert opt.defaults == defaults
    assert opt.state_dict()["param_groups"] == saved["param_groups"]
    torch.testing.assert_close(opt.state_dict()["state"], saved["state"], rtol=0, atol=0)
    if name in ("FusedAdam", "FusedEmaAdamW"):  # no differentiable option in their constructors
        assert "differentiable" not in opt.param_groups[0]


def _copies(opt):
    return {"deepcopy": copy.deepcopy(opt), "pickle": pickle.loads(pickle.dumps(opt))}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_clipping_and_unscale_options(how):
    params = _params()
    opt = FusedEmaAdamW(params, lr=1e-2, max_grad_norm=1.0, fused_unscale=False, chunk_size=512)
    _step(opt, params, scale=100.0)
    copied = _copies(opt)[how]
    assert copied.max_grad_norm == 1.0
    assert copied._step_supports_amp_scaling is False  # GradScaler unscales before step()
    assert copied._chunk_size == 512
    torch.testing.assert_close(copied.last_grad_norm, opt.last_grad_norm, rtol=0, atol=0)
    assert copied.last_ema_decays == opt.last_ema_decays == {(0, 1): 0.9999}
    # the copy clips its next step exactly as the original does
    copied_params = [p for g in copied.param_groups for p in g["params"]]
    _step(opt, params, seed=2, scale=100.0)
    _step(copied, copied_params, seed=2, scale=100.0)
    for p, q in zip(params, copied_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_set_grad_none(how):
    params = _params()
    copied = _copies(FusedAdam(params, set_grad_none=False))[how]
    assert copied.set_grad_none is False
    copied_params = copied.param_groups[0]["params"]
    for p in copied_params:
        p.grad = torch.ones_like(p)
    copied.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in copied_params)


def test_copies_keep_a_stored_and_a_swapped_ema():
    params = _params()
    opt = FusedEmaAdamW(params, lr=1e-1, ema_decay=0.5)
    _step(opt, params)
    trained = [p.detach().clone() for p in params]
    opt.store()
    opt.copy_to()
    copied = copy.deepcopy(opt)
    copied.restore()  # the copy holds what store() saved
    for p, t in zip(copied.param_groups[0]["params"], trained):
        assert torch.equal(p, t)
    opt.restore()
    with opt.swap_ema_weights():
        swapped = copy.deepcopy(opt)
    swapped_params = swapped.param_groups[0]["params"]
    for p in swapped_params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="swap_ema_weights"):
        swapped.step()  # its params hold the EMA, as the original's did when it was copied


def test_load_state_dict_keeps_the_loading_optimizers_options():
    params = _params()
    source = FusedEmaAdamW(params, lr=1e-2)
    _step(source, params)
    target = FusedEmaAdamW(_params(), lr=1e-2, max_grad_norm=0.5, fused_unscale=False)
    target.load_state_dict(source.state_dict())
    assert target.max_grad_norm == 0.5 and target._step_supports_amp_scaling is False
    adam = FusedAdam(_params(), set_grad_none=False)
    adam.load_state_dict(FusedAdam(_params()).state_dict())
    assert adam.set_grad_none is False


TORCH_TEXTS = [
    (dict(lr=-1.0), r"^Invalid learning rate: -1\.0 \("),
    (dict(eps=-1e-8), r"^Invalid epsilon value: -1e-08 \("),
    (dict(betas=(1.0, 0.0)), r"^Invalid beta parameter at index 0: 1\.0 \("),
    (dict(betas=(0.9, 1.0)), r"^Invalid beta parameter at index 1: 1\.0 \("),
    (dict(weight_decay=-1), r"^Invalid weight_decay value: -1 \("),
]


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("kwargs, text", TORCH_TEXTS)
def test_option_errors_start_with_torchs_text(name, kwargs, text):
    with pytest.raises(ValueError, match=text):
        CLASSES[name](_params(), **kwargs)
    # the same in a param group, added or changed before a step
    opt = CLASSES[name](_params(), lr=1e-2)
    with pytest.raises(ValueError, match=text):
        opt.add_param_group({"params": _params(1), **kwargs})
    assert len(opt.param_groups) == 1
    group = opt.param_groups[0]
    group.update(kwargs)
    for p in group["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=text):
        opt.step()
    assert not opt.state


def test_torch_texts_name_ours_after_them():
    with pytest.raises(ValueError, match=r"^Invalid learning rate: nan \(FusedAdamW: lr must be a "
                                         r"finite real number, got nan\)$"):
        FusedAdamW(_params(), lr=float("nan"))
    with pytest.raises(ValueError, match=r"^Invalid ema_decay value: 1\.0 \(FusedEmaAdamW: "
                                         r"ema_decay must be in \[0, 1\)\)$"):
        FusedEmaAdamW(_params(), ema_decay=1.0)


def test_apex_op_front_end_texts():
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    noop = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^Invalid beta parameter at index 1: 1\.5 "
                                         r"\(multi_tensor_adam: beta2 must be in \[0, 1\)\)$"):
        ops.multi_tensor_adam(2048, noop, [[g], [p], [m], [v]], 1e-3, 0.9, 1.5, 1e-8, 1, 1,
                              True, 0.0)
    assert not p.any()


@pytest.mark.parametrize("name", CLASSES)
def test_meta_params_are_refused_before_any_state(name):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = CLASSES[name](model.parameters(), lr=1e-2)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] is on the meta "
                                           r"device.*to_empty"):
        opt.step()
    assert len(opt.state) == 0
    opt.zero_grad(set_to_none=True)
    opt.step()  # nothing to step: no error, still no state
    assert len(opt.state) == 0
