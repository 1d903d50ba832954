r"""The NPU backend's whole path on CPU tensors, with the device operator replaced.

CPU CI has no NPU, CANN or torch_npu. The NPU backend's logic (flattening, re-pointing, the grad
gather, unscale, noop, the choice of path, the write-back, state dicts) does not depend on the
device, so :func:`standin_backend` registers a copy of it for device type ``"cpu"`` whose device
operator is one of:

* :func:`reference_device_op`: the seed operator computed by the package's reference backend
  (``multi_tensor/rules.py``'s order, unbiased EMA, IEEE rounding): what a correctly rounded
  device would compute;
* :func:`cann_device_op` (also ``literal_device_op``): CANN's kernel operation by operation in
  fp32, as its source computes (below); used to size the tolerances of ``tools/npu_check.py``;
* ``None``: the real loader (:func:`multi_tensor.backends.npu.loader.load_device_op`), for tests
  that inject a fake ``torch_npu`` and a fake compiled binding.

What the kernel computes. Source: ops-nn (``github.com/hicann/ops-nn``, commit e5c3fa93, 2026-08),
``optim/apply_fused_ema_adam/``; line numbers of that commit.

* **Attributes as float.** The op definition declares lr, ema_decay, beta1, beta2, eps,
  weight_decay as ``Float`` attributes (``op_host/apply_fused_ema_adam_def.cpp:84-91``); the aclnn
  entry takes doubles and the tiling reads the attributes with ``GetAttrPointer<float>`` into
  ``float`` tiling fields (``op_host/apply_fused_ema_adam_tiling.cpp:74-105``,
  ``op_host/apply_fused_ema_adam_tiling.h:36-41``). Each double is rounded once to fp32 (C++
  ``static_cast<float>``: round to nearest even).
* **Complements in fp32 on the device.** The kernel writes ``1 - this->beta1``,
  ``1 - this->beta2``, ``1 - this->emaDecay`` with float members (``op_kernel/
  apply_fused_ema_adam_f32.h:140, 154, 176``; the same at ``apply_fused_ema_adam_f_bf16.h:140,
  156, 181``): ``fp32(1) - fp32(beta)``, exact for beta in [0.5, 1] (Sterbenz), so it is
  ``1 - fp32(beta)``, not ``fp32(1 - beta)``. For beta2 = 0.999 the two differ by 111 ulp of the
  coefficient (relative 1.29e-5); for beta1 = 0.9 by 3 ulp (relative 2.2e-7).
* **Bias correction.** ``beta1Correction = beta2Correction = 1.0`` as members
  (``op_kernel/apply_fused_ema_adam_base.h:51-52``); only with ``biasCorrection == 1`` they become
  ``1.0f - Power(beta, float(step))`` (``f32.h:106-111``; ``ScalarPow``, ``base.h:84-100``: an
  AscendC vector ``Power`` on 8 lanes, read back). The corrections enter as multiplications by
  the fp32 reciprocal ``1 / correction`` (``f32.h:144, 158``), not as divisions; with
  bias_correction=False (how the backend calls it) that multiplies by exactly 1.
* **Operation order** (``f32.h:124-184``, one rounding per instruction)::

      g      = wd * var + g                  (mode 0 only; Muls, Add: 128, 133)
      m'     = m * b1 + g * (1 - b1)         (Muls, Muls, Add: 139-141)     -> stored
      m_hat  = m' * (1 / bc1)                (Muls: 144)
      v'     = (g * g) * (1 - b2) + v * b2   (Muls, Mul, Muls, Add: 149-155) -> stored
      v_hat  = v' * (1 / bc2)                (Muls: 158)
      denom  = sqrt(v_hat) + eps             (Sqrt, Adds: 161-162)
      u      = m_hat / denom                 (Div: 163)
      u      = u + var * wd                  (mode 1 only; Muls, Add: 167-168)
      var'   = var - u * lr                  (Muls, Sub: 172-173)            -> stored
      s'     = s * d + var' * (1 - d)        (Muls, Muls, Add: 176-182)      -> stored

  So it is ``(m/bc1) / (sqrt(v/bc2) + eps)`` with the corrections as reciprocal products, the
  decoupled decay added to the update *before* the multiplication by lr, and the EMA in the
  biased (literal) form from the unrounded fp32 ``var'``.
* **fp16/bf16.** ``apply_fused_ema_adam_f_bf16.h`` casts every input to fp32 (``CAST_NONE``,
  exact), computes the same instructions in fp32, and rounds only the four stored outputs to the
  input dtype (``CAST_RINT``, nearest even: 142, 158, 178, 189); the later lines read the fp32
  values (``m_hat`` from the fp32 ``m'``, the EMA from the fp32 ``var'``), not the rounded ones.
* **Assumptions** (marked in the code): the vector ``Sqrt`` and ``Div`` are correctly rounded
  and ``Power`` returns ``beta ** step`` correctly rounded; no instruction fuses a multiply and
  an add (AscendC's ``Muls``/``Add`` are separate vector instructions). ``tools/npu_check.py``
  measures sqrt/div rounding and the real complements on hardware.

Used by ``tests/test_npu_*.py`` and ``tools/npu_check.py --stand-in``. Nothing here is imported
by the package itself.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from .. import schema
from ..rules import AdamHyper, step_scalars
from ..backends import npu, reference, registry


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


def f32(x: float) -> float:
    """``x`` rounded once to fp32 (round to nearest even), as a Python float."""
    return float(torch.tensor(float(x), dtype=torch.float64).to(torch.float32))


def _k(x: float) -> torch.Tensor:
    """An fp32 scalar operand: fp32 tensor op fp32 0-dim tensor computes and rounds in fp32."""
    return torch.tensor(x, dtype=torch.float32)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x.double()).to(torch.float32)


def _div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() / b.double()).to(torch.float32)


def device_complement(x: float) -> float:
    """``1 - x`` as the kernel forms it: ``1 - float(x)``, evaluated in fp32 (module docstring)."""
    return float(_k(1.0) - _k(f32(x)))


def cann_device_op(grad, var, m, v, s, step, lr=1e-3, ema_decay=0.9999, beta1=0.9, beta2=0.999,
                   eps=1e-8, mode=1, bias_correction=True, weight_decay=0.0):
    """``aclnnApplyFusedEmaAdam`` as ops-nn's kernel computes it, in place (module docstring).

    Each line below is one AscendC vector instruction of ``apply_fused_ema_adam_f32.h`` /
    ``apply_fused_ema_adam_f_bf16.h`` (one fp32 rounding each), with the scalars the kernel
    holds: the double attributes rounded once to fp32, complements and reciprocals formed in fp32.
    """
    f = torch.float32
    t = _step_of(step)
    lr_, d, b1, b2, eps_, wd = (f32(x) for x in (lr, ema_decay, beta1, beta2, eps, weight_decay))
    omb1, omb2, omd = (_k(1.0) - _k(x) for x in (b1, b2, d))           # f32.h:140, 154, 176
    if bias_correction:  # base.h:84-100 Power(); f32.h:108-111: 1.0f - beta ** float(step)
        # ASSUMPTION: AscendC Power<float> returns beta ** step correctly rounded to fp32.
        step_f = f32(t)
        bc1 = _k(1.0) - _k(f32(b1 ** step_f))
        bc2 = _k(1.0) - _k(f32(b2 ** step_f))
    else:  # base.h:51-52: the corrections keep their initial 1.0
        bc1 = bc2 = _k(1.0)
    rbc1, rbc2 = _k(1.0) / bc1, _k(1.0) / bc2                            # f32.h:144, 158: 1 / bc
    g, w = grad.to(f), var.to(f)                                         # bf16.h:125,130: CAST_NONE
    mm, vv, ss = m.to(f), v.to(f), s.to(f)
    if mode == 0:
        g = w * _k(wd) + g                                               # f32.h:128, 133
    m_out = mm * _k(b1) + g * omb1                                       # f32.h:139-141
    m_hat = m_out * rbc1                                                 # f32.h:144
    v_out = (g * g) * omb2 + vv * _k(b2)                                 # f32.h:149-155
    v_hat = v_out * rbc2                                                 # f32.h:158
    # ASSUMPTION: the vector Sqrt and Div are correctly rounded (tools/npu_check.py measures it).
    # Formed in fp64 and rounded once: correctly rounded for fp32 operands (53 >= 2 * 24 + 2),
    # where torch's CPU fp32 sqrt is not (it is 1 ulp off for some inputs).
    denom = _sqrt_rn(v_hat) + _k(eps_)                                   # f32.h:161-162
    update = _div_rn(m_hat, denom)                                       # f32.h:163
    if mode == 1:
        update = update + w * _k(wd)                                     # f32.h:167-168
    w_new = w - update * _k(lr_)                                         # f32.h:172-173
    s_new = ss * _k(d) + w_new * omd                                     # f32.h:176-182
    for dst, src in ((var, w_new), (m, m_out), (v, v_out), (s, s_new)):  # bf16.h: CAST_RINT
        dst.copy_(src)
    return var, m, v, s


literal_device_op = cann_device_op
"""The name the stand-in's users know the CANN emulation by."""


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
