"""Half-precision training recipe: fp16 params, fp32 masters in the optimizer, dynamic loss scaling.

This is the recipe of labml.ai's "Adam optimizer for half-precision training" (seed 003), on the
fused optimizers:

* the model's params are fp16 themselves (``model.half()``): forward, backward and the grads are
  fp16; (``torch.autocast("cpu", dtype=torch.float16)`` works on the CPU in torch 2.13 as well,
  but with fp16 params it is not needed: ``--autocast`` runs the forward under it anyway);
* the optimizer keeps an fp32 ``master_param`` per param (``master_weights=True``) plus fp32
  ``exp_avg``/``exp_avg_sq`` (and, for ``FusedEmaAdamW``, an fp32 EMA); the update runs on the
  master and the fp16 param receives the master rounded once per step;
* ``torch.amp.GradScaler("cpu")`` scales the loss so small fp16 grads do not underflow in the
  backward pass, and adapts the scale: halved on an overflow (inf/NaN grad; that step changes
  nothing: param, master, moments, EMA and step stay), doubled after ``growth_interval`` clean steps.

The seed subclasses ``GradScaler`` so that unscaling writes fp32 copies of the fp16 grads
(``torch``'s own ``unscale_`` refuses fp16 grads, and unscaling them in fp16 flushes small values to
zero). Here no subclass is needed: the fused optimizers set ``_step_supports_amp_scaling``, so
``scaler.step(opt)`` only checks the grads for inf/NaN and hands the scale to the optimizer, whose
kernel reads each fp16 grad, converts it to fp32 and multiplies by ``1 / scale`` *in fp32*.
:func:`underflow_demo` shows the difference on gradients around 1e-9: the naive fp16 unscale
flushes most of them to zero, the in-kernel fp32 unscale recovers all of them.

Run ``python tools/fp16_recipe.py`` (add ``--help`` for options); ``tests/test_fp16_recipe.py``
runs it small.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

if __package__ in (None, ""):  # run as a script: import the package from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fused_optim import FusedEmaAdamW  # noqa: E402

FP16_TINY = torch.finfo(torch.float16).tiny                  # smallest normal fp16, 6.1e-5
FP16_SUBNORMAL_MIN = 2.0 ** -24                              # smallest fp16 > 0, 5.96e-8


def make_optimizer(params, name: str = "ema_adamw", lr: float = 3e-3, ema_decay: float = 0.95):
    """The fused optimizer with fp32 masters: ``FusedEmaAdamW`` or, if present, ``FusedAdam``.

    The EMA uses MindSpeed's warm-up schedule (``min(ema_decay, (1 + n) / (10 + n))``): with a
    constant decay the EMA of a short run would still remember the random initial weights.
    """
    if name == "adam":
        import fused_optim

        cls = getattr(fused_optim, "FusedAdam", None)
        if cls is None:
            raise RuntimeError("fused_optim.FusedAdam is not available in this checkout")
        return cls(params, lr=lr, weight_decay=0.0, master_weights=True)
    return FusedEmaAdamW(params, lr=lr, weight_decay=0.0, ema_decay=ema_decay,
                         ema_schedule="warmup", master_weights=True)


def make_data(n: int = 512, d_in: int = 16, seed: int = 0):
    """A regression task the script generates itself: y = sin(x @ w1) @ w2 + noise (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    w1 = torch.randn(d_in, 8, generator=gen) / math.sqrt(d_in)
    w2 = torch.randn(8, 1, generator=gen)
    y = torch.sin(x @ w1 * 2.0) @ w2 + 0.01 * torch.randn(n, 1, generator=gen)
    return x, y


def make_model(d_in: int = 16, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 1))
    return model.half()  # the params themselves are fp16


def train(steps: int = 300, batch: int = 64, lr: float = 3e-3, init_scale: float = 2.0 ** 24,
          growth_interval: int = 50, overflow_at: Sequence[int] = (), optimizer: str = "ema_adamw",
          autocast: bool = False, seed: int = 0) -> Dict[str, object]:
    """Train the fp16 MLP with ``GradScaler`` and the fused optimizer; return the history.

    ``init_scale`` 2**24 is deliberately too large: the first backward passes overflow fp16, and
    the scaler backs off until the scaled grads fit (dynamic loss scaling at work).
    ``overflow_at``: steps at which an inf is written into a grad, as an overflow would.

    Returns ``losses`` (fp32, per step), ``scales`` (the scale used at each step), ``skipped``
    (steps where the scaler found inf/NaN), ``unchanged_on_skip`` (whether params, masters, moments
    and EMA were bit-identical across every skipped step), the final ``eval_loss`` and, for the
    EMA optimizer, ``eval_loss_ema`` (the EMA weights, evaluated via ``swap_ema_weights``).
    """
    x, y = make_data(seed=seed)
    model = make_model(x.shape[1], seed=seed)
    params = list(model.parameters())
    opt = make_optimizer(params, optimizer, lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=growth_interval)
    gen = torch.Generator().manual_seed(seed + 1)
    losses: List[float] = []
    scales: List[float] = []
    skipped: List[int] = []
    unchanged_on_skip = True

    def forward(inputs):
        if autocast:
            with torch.autocast("cpu", dtype=torch.float16):
                return model(inputs.half())
        return model(inputs.half())

    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=gen)
        out = forward(x[idx]).float()                     # loss in fp32
        loss = torch.nn.functional.mse_loss(out, y[idx])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()                     # fp16 grads of the scaled loss
        if step in overflow_at:
            params[0].grad.view(-1)[0] = float("inf")
        scale = scaler.get_scale()
        before = _snapshot(opt)
        scaler.step(opt)                                  # unscale (fp32, in the kernel) + step
        scaler.update()
        if scaler.get_scale() < scale:                    # the scaler found inf/NaN: skipped
            skipped.append(step)
            unchanged_on_skip &= _same(before, _snapshot(opt))
        losses.append(loss.item())
        scales.append(scale)

    with torch.no_grad():
        eval_loss = float(torch.nn.functional.mse_loss(forward(x).float(), y))
        result: Dict[str, object] = dict(losses=losses, scales=scales, skipped=skipped,
                                         unchanged_on_skip=unchanged_on_skip,
                                         eval_loss=eval_loss, final_scale=scaler.get_scale(),
                                         param_dtype=params[0].dtype,
                                         master_dtype=opt.state[params[0]]["master_param"].dtype)
        if hasattr(opt, "swap_ema_weights"):
            with opt.swap_ema_weights():
                result["eval_loss_ema"] = float(torch.nn.functional.mse_loss(forward(x).float(), y))
    return result


def _snapshot(opt) -> List[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            for value in opt.state[p].values():
                if isinstance(value, torch.Tensor):
                    out.append(value.detach().clone())
    return out


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def underflow_demo(n: int = 1000, scale: float = 2.0 ** 16, low: float = -10.0,
                   high: float = -6.0, optimizer: str = "ema_adamw") -> Dict[str, object]:
    """Tiny gradients (10**low .. 10**high): naive fp16 unscaling vs the fused fp32 unscale.

    An fp16 param ``w`` gets the grad of ``scale * sum(w * c)`` with fp32 constants ``c`` in that
    range: the backward pass writes ``scale * c`` rounded to fp16 (all normal fp16 numbers at
    2**16). Then

    * naive: unscale in fp16 as ``GradScaler.unscale_`` would (``torch._amp_foreach_non_finite_
      check_and_unscale_`` on the fp16 grads): ``c`` below fp16's smallest subnormal (6e-8)
      becomes 0, the rest loses precision;
    * fused: ``scaler.step(opt)``; the kernel unscales each grad in fp32. After one step
      ``exp_avg = (1 - beta1) * g`` with the recovered fp32 grad ``g``.

    Returns the counts of true grads that came out as zero each way and the worst relative error
    of the recovered grads.
    """
    c = torch.logspace(low, high, n, dtype=torch.float32)
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.float16))
    opt = make_optimizer([w], optimizer, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    loss = (w.float() * c).sum()
    scaler.scale(loss).backward()
    scaled = w.grad.detach().clone()
    assert scaled.dtype == torch.float16

    naive = scaled.clone()
    found_inf = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_([naive], found_inf,
                                                     torch.full((1,), 1.0 / scale))
    scaler.step(opt)
    scaler.update()
    beta1 = opt.param_groups[0]["betas"][0]
    fused = opt.state[w]["exp_avg"] / (1.0 - beta1)   # the fp32 grad the kernel used

    def rel_err(g):
        return float(((g.double() - c.double()).abs() / c.double()).max())

    return dict(
        n=n, scale=scale, grad_range=(float(c.min()), float(c.max())),
        naive_dtype=naive.dtype, fused_dtype=opt.state[w]["exp_avg"].dtype,
        naive_zeros=int((naive == 0).sum()), fused_zeros=int((fused == 0).sum()),
        naive_below_subnormal=int((c < FP16_SUBNORMAL_MIN / 2).sum()),
        naive_max_rel_err=rel_err(naive.float()), fused_max_rel_err=rel_err(fused),
        param_moved=bool((w.detach() != 1).any()) or bool(
            (opt.state[w]["master_param"] != 1).any()),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", choices=("ema_adamw", "adam"), default="ema_adamw")
    parser.add_argument("--overflow-at", type=int, nargs="*", default=[150],
                        help="steps at which to inject an inf grad (an overflow)")
    parser.add_argument("--autocast", action="store_true",
                        help="run the forward under torch.autocast('cpu', dtype=torch.float16)")
    args = parser.parse_args(argv)

    r = train(steps=args.steps, lr=args.lr, overflow_at=args.overflow_at,
              optimizer=args.optimizer, autocast=args.autocast)
    losses = r["losses"]
    print(f"params {r['param_dtype']}, masters {r['master_dtype']}, optimizer {args.optimizer}")
    print(f"loss: first 10 steps {sum(losses[:10]) / 10:.4f} -> last 10 steps "
          f"{sum(losses[-10:]) / 10:.4f}; full-data eval {r['eval_loss']:.4f}"
          + (f", EMA weights {r['eval_loss_ema']:.4f}" if "eval_loss_ema" in r else ""))
    print(f"loss scale: {r['scales'][0]:.0f} -> {r['final_scale']:.0f}; overflow (skipped) steps "
          f"{r['skipped']}; nothing changed on them: {r['unchanged_on_skip']}")

    d = underflow_demo(optimizer=args.optimizer)
    print(f"\nunderflow: {d['n']} grads in [{d['grad_range'][0]:.1e}, {d['grad_range'][1]:.1e}], "
          f"loss scale {d['scale']:.0f}")
    print(f"  naive fp16 unscale : {d['naive_zeros']} flushed to zero, worst relative error "
          f"{d['naive_max_rel_err']:.3g}")
    print(f"  fused fp32 unscale : {d['fused_zeros']} flushed to zero, worst relative error "
          f"{d['fused_max_rel_err']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
