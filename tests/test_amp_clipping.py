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
