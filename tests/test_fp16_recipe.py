"""tools/fp16_recipe.py, run small: fp16 params, fp32 masters, GradScaler on the CPU."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import fp16_recipe  # noqa: E402


@pytest.fixture(scope="module")
def history():
    return fp16_recipe.train(steps=80, lr=2e-2, overflow_at=(40,), growth_interval=1000)


def test_dtypes(history):
    assert history["param_dtype"] == torch.float16
    assert history["master_dtype"] == torch.float32


def test_loss_goes_down(history):
    losses = history["losses"]
    assert all(l == l for l in losses)                     # no NaN reached the loss
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert history["eval_loss"] < 0.5 * losses[0]


def test_scale_backs_off_on_overflow_and_nothing_changes(history):
    scales, skipped = history["scales"], history["skipped"]
    assert scales[0] == 2.0 ** 24
    assert 0 in skipped                                   # 2**24 overflows fp16 at once
    assert 40 in skipped                                  # the injected inf
    assert scales[41] == scales[40] / 2                   # halved by scaler.update()
    assert history["final_scale"] < scales[0]
    assert history["unchanged_on_skip"]                   # param, master, m, v, EMA, step kept


def test_fused_unscale_has_no_fp16_underflow():
    d = fp16_recipe.underflow_demo(n=400)
    assert d["naive_dtype"] == torch.float16 and d["fused_dtype"] == torch.float32
    assert d["naive_zeros"] >= d["naive_below_subnormal"] > 100   # naive flushes them to zero
    assert d["naive_max_rel_err"] == 1.0
    assert d["fused_zeros"] == 0                                  # fp32 unscale keeps all
    assert d["fused_max_rel_err"] < 1e-2   # only the fp16 rounding of the *scaled* grads
    assert d["param_moved"]


def test_torch_unscale_refuses_fp16_grads():
    """Why the seed subclasses GradScaler: torch's unscale_ will not unscale fp16 grads."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = fp16_recipe.make_optimizer([w])
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((w.float() * 1e-3).sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_cli_runs(capsys):
    assert fp16_recipe.main(["--steps", "25", "--overflow-at", "12", "--autocast"]) == 0
    out = capsys.readouterr().out
    assert "fused fp32 unscale : 0 flushed to zero" in out
    assert "params torch.float16, masters torch.float32" in out
