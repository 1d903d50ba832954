"""The NPU backend's whole path on CPU tensors, with the device operator replaced.

CPU CI has no NPU, CANN or torch_npu. The NPU backend's logic (flattening, re-pointing, the grad
gather, unscale, noop, the choice of path, the write-back, state dicts) does not depend on the
device, so :func:`standin_backend` registers a copy of it for device type ``"cpu"`` whose device
operator is one of:

* :func:`reference_device_op`: the seed operator computed by the package's reference backend
  (``multi_tensor/rules.py``'s order, unbiased EMA, IEEE rounding): what a correctly rounded
  device would compute;
* :func:`literal_device_op`: CANN's documented formula line by line in fp32 (biased EMA
  ``d*s + (1-d)*var'``, ``(m/bc1) / (sqrt(v/bc2) + eps)``): an emulation of the device's
  operation order, used to size tolerances;
* ``None``: the real loader (:func:`multi_tensor.backends.npu.load_device_op`), for tests that
  inject a fake ``torch_npu`` and a fake compiled binding.

Used by ``tests/test_npu_*.py`` and ``tools/npu_check.py --stand-in``. Nothing here is imported
by the package itself.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from .. import schema
from ..rules import AdamHyper, step_scalars
from . import npu, reference, registry


def _step_of(step) -> int:
    return int(step.reshape(-1)[0].item()) if isinstance(step, torch.Tensor) else int(step)


def reference_device_op(grad, var, m, v, s, step, lr=1e-3, ema_decay=0.9999, beta1=0.9,
                        beta2=0.999, eps=1e-8, mode=1, bias_correction=True, weight_decay=0.0):
    """The seed operator (SPEC section 2) as the reference backend computes it, in place."""
    h = AdamHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  decoupled=mode == 1, bias_correction=bool(bias_correction), ema_decay=ema_decay)
    lists = schema.AdamLists(grads=[grad], params=[var], exp_avgs=[m], exp_avg_sqs=[v], emas=[s])
    reference.adam_family(0, None, lists, step_scalars(h, _step_of(step)))
    return var, m, v, s


def literal_device_op(grad, var, m, v, s, step, lr=1e-3, ema_decay=0.9999, beta1=0.9,
                      beta2=0.999, eps=1e-8, mode=1, bias_correction=True, weight_decay=0.0):
    """CANN's documented formula, one torch op per line in fp32, in place (biased EMA)."""
    t = _step_of(step)
    f32 = torch.float32
    bc = 1.0 if bias_correction else 0.0

    def c(x):  # a scalar attribute as a float32 kernel would hold it
        return torch.tensor(x, dtype=torch.float64).to(f32).item()

    bc1 = c(1.0 - (beta1 ** t) * bc)
    bc2 = c(1.0 - (beta2 ** t) * bc)
    g, w = grad.to(f32), var.to(f32)
    mm, vv, ss = m.to(f32), v.to(f32), s.to(f32)
    if mode == 0:
        g = g + w * c(weight_decay)
    mm = mm * c(beta1) + g * c(1.0 - beta1)
    vv = vv * c(beta2) + (g * g) * c(1.0 - beta2)
    denom = torch.sqrt(vv / bc2) + c(eps)
    update = (mm / bc1) / denom
    if mode == 1:
        update = update + w * c(weight_decay)
    w_new = w - update * c(lr)
    ss = ss * c(ema_decay) + w_new * c(1.0 - ema_decay)
    for dst, src in ((var, w_new), (m, mm), (v, vv), (s, ss)):
        dst.copy_(src)
    return var, m, v, s


@contextlib.contextmanager
def standin_backend(device_op: Optional[Callable] = reference_device_op, *,
                    name: str = "npu_standin", mode: Optional[str] = None,
                    device_types=("cpu",), priority: int = 1000) -> Iterator[registry.Backend]:
    """Within the block, CPU tensors run the NPU backend's code (removed again on exit).

    ``mode``: the NPU op mode for the block (``None``: keep the current one).
    """
    backend = npu.make_backend(name=name, device_types=device_types, priority=priority,
                               device_op=device_op,
                               description="the NPU backend on CPU tensors (test stand-in)")
    registry.register_backend(backend)
    try:
        if mode is None:
            yield backend
        else:
            with npu.op_mode(mode):
                yield backend
    finally:
        registry.unregister_backend(name)
