"""GradScaler with and without the fused unscale (``fused_unscale``), and gradient clipping."""
from __future__ import annotations

import pytest
import torch

from fused_optim import FusedAdamW, FusedEmaAdamW, FusedRAdam
from seed_reference import assert_bitwise_equal


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def _batches(n=6):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("cls", [FusedEmaAdamW, FusedAdamW, FusedRAdam])
def test_fused_unscale_switch(cls):
    """``fused_unscale=False``: the scaler unscales the grads itself (they are unscaled when
    step() runs, so code can clip them in between), and the result equals the fused unscale."""
    kwargs = dict(ema_decay=0.9) if cls is FusedRAdam else {}
    results = []
    for fused in (True, False):
        model = _model()
        opt = cls(model.parameters(), lr=1e-2, fused_unscale=fused, **kwargs)
        assert opt._step_supports_amp_scaling is fused
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for x, y in _batches():
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if not fused:
                scaler.unscale_(opt)
                assert all(abs(p.grad).max() < 100 for p in model.parameters())  # unscaled
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert_bitwise_equal(b, a, "fused_unscale=False vs True")
    assert type(opt)._step_supports_amp_scaling  # the class default is untouched


def _train(opt_factory, clip_by_torch=None, scaler=None, steps=6):
    model = _model()
    opt = opt_factory(model.parameters())
    norms = []
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * 50.0  # large grads: clipping acts
        (scaler.scale(loss) if scaler else loss).backward()
        if clip_by_torch is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_by_torch)))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if getattr(opt, "last_grad_norm", None) is not None:
            norms.append(float(opt.last_grad_norm))
    return [p.detach().clone() for p in model.parameters()], norms, opt


@pytest.mark.parametrize("cls", [FusedEmaAdamW, FusedAdamW, FusedRAdam])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_max_grad_norm_matches_clip_grad_norm(cls, with_scaler):
    """``max_grad_norm`` = ``torch.nn.utils.clip_grad_norm_`` before the step, to fp32 rounding
    (the clip factor joins the kernel's unscale multiplier instead of a pass over the grads)."""
    scaler = (lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)) if with_scaler else (lambda: None)
    ours, our_norms, opt = _train(lambda ps: cls(ps, lr=1e-2, max_grad_norm=0.5), scaler=scaler())
    ref, ref_norms, _ = _train(lambda ps: cls(ps, lr=1e-2), clip_by_torch=0.5)
    assert max(ref_norms) > 0.5  # clipping really happened
    for a, b in zip(our_norms, ref_norms):
        assert abs(a - b) <= 1e-5 * b
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def test_max_grad_norm_nonfinite_skips_the_step():
    model = _model()
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = [t.clone() for t in model.parameters()] + [
        v.clone() for st in opt.state.values() for v in st.values()]
    next(model.parameters()).grad[0, 0] = float("inf")
    opt.step()
    after = [t.clone() for t in model.parameters()] + [
        v.clone() for st in opt.state.values() for v in st.values()]
    assert not torch.isfinite(opt.last_grad_norm)
    for a, b in zip(before, after):
        assert_bitwise_equal(b, a, "after a non-finite grad norm")


def test_max_grad_norm_checked():
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedEmaAdamW([torch.nn.Parameter(torch.zeros(2))], max_grad_norm=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedEmaAdamW([torch.nn.Parameter(torch.zeros(2))], max_grad_norm=float("nan"))
