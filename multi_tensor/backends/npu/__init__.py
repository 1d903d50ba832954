r"""The Ascend NPU backend: flat buckets, one ``aclnnApplyFusedEmaAdam`` launch per bucket.

Registered for device type ``"npu"`` (the name torch_npu gives PrivateUse1) at import, *without*
importing torch_npu: installing torch-npu without CANN breaks ``import torch`` itself, so
torch_npu is imported only when a bucket of tensors on an ``npu`` device is prepared (by then
the caller has imported it anyway) and when the CANN operator is loaded.

What a bucket is here (:class:`FlatAdamBucket`). The flat layout itself is an engine
capability, :mod:`multi_tensor.backends.npu.flat` (device- and op-agnostic; its docstring says why it
is not wired into the CPU and GPU backends, whose kernels already take any number of tensors in
one launch):

* **Flat state.** At ``prepare`` the bucket's optimizer state (``exp_avg``, ``exp_avg_sq``,
  ``ema``, fp32 ``master_param``) goes into one contiguous buffer per kind, one layout for all
  of them (views start every 512 bytes); the existing values are copied in once and every state
  tensor in ``optimizer.state`` is re-pointed at its view (``Tensor.set_``): same objects, same
  ``state_dict`` format. ``load_state_dict`` replaces the state tensors and clears the plans, so
  the next step simply flattens again. State that is already flat in this layout (a re-built
  plan) is used as is, without a copy.
* **Params.** An optimizer's bucket moves its params into one flat buffer of their dtype at
  planning (values copied once, then ``p.data = view``: the same ``Parameter`` objects, as
  torch_npu's combined-buffer fused optimizers re-point theirs), so that fp32 params without
  masters *are* the op's ``var`` (no copy in or out) and with fp32 masters the params receive the
  masters rounded once in one converting copy, flat buffer to flat buffer. Params that already
  tile one buffer without gaps (Megatron's param buffer) are used in place. Not moved: params
  whose storage something else holds (a view of them, a tensor made from their ``.data``), a
  DTensor's local shard, the real view of a complex param, non-contiguous params, and the
  caller's tensors of a one-shot apex call: those are copied in and out per step. A param
  reallocated later (``p.data = new``, ``model.to()``) is noticed at the next ``bind``: re-plan.
* **Grads.** At the bucket's first step its params' grads become views of one flat grad buffer
  (:class:`~multi_tensor.backends.npu.flat.FlatGrads`; the values copied in once) that backward
  accumulates into in place. The optimizer's ``zero_grad`` zeroes that buffer (one launch) and,
  with ``set_to_none=True``, sets the grads to None as torch does; each param's grad hook (run by
  backward before accumulation) gives it its zero view back, so backward accumulates into the
  buffer and a param that receives no grad keeps ``None`` and is skipped, exactly as in torch.
  ``set_to_none=False`` leaves every param its zero view. A grad assigned by the user (``p.grad = g``)
  is copied into the buffer for that step (one copy of one dtype) and the next ``zero_grad`` gives
  the view back. fp16/bf16 grads of fp32 masters are converted into one fp32 buffer, one copy.
  ``MULTI_TENSOR_NPU_FLAT_GRADS=0`` leaves grads as they are (gathered per step). Grads that are
  views of someone else's buffer (DDP's bucket views) are gathered per step; views of one such
  buffer without gaps in the bucket's layout (Megatron-style grad buffers) are used in place.
* **One launch.** The update is one call of CANN's fused EMA-Adam operator over the five flat
  buffers (MindSpeed's ``npu_apply_fused_ema_adamw`` when MindSpeed is installed, else a small
  binding, ``csrc/npu/fused_ema_adam.cpp``, compiled on first use by
  :mod:`multi_tensor.backends.npu.builder`). Grad unscale and the inf/NaN check run on the flat
  grad buffer, one launch each (both in one: ``torch._amp_foreach_non_finite_check_and_unscale_``).

Numerics. The package's contract is bitwise equality with the reference backend; on an NPU that
is opt-in (``exact``), and the default is CANN's operator, within a derived tolerance of the
reference (docs/npu.md gives the numbers measured on the stand-in):

* ``MULTI_TENSOR_NPU_OP=cann`` (**the default**). CANN's op updates var, m and v in one
  launch, then one ``lerp_`` takes the EMA in the package's unbiased form
  ``s + (1 - d) * (var' - s)`` (the op is called with ``ema_decay=1``, which leaves ``s``
  untouched), so the EMA keeps the package's bound (1e-5 of float64 after 20,000 steps at
  decay 0.9999, ``tests/test_numerics.py``). The op's step arguments are *folded*: it is called
  with ``bias_correction=False`` and a constant step tensor ``[1]`` (int64, kept on the device:
  no per-step host-to-device copy), and with ``lr' = lr * sqrt(bc2) / bc1``,
  ``eps' = eps * sqrt(bc2)``, ``weight_decay' = lr * weight_decay / lr'`` (AdamW; Adam's L2
  decay passes unchanged), which is the same update in exact arithmetic, from the engine's own
  per-step scalars (:func:`multi_tensor.rules.step_scalars`, EMA schedules included), so no
  engine hook for the step count is needed. Results differ from the reference by the kernel's
  fp32 complements (``1 - fp32(beta)``, formed on the device) and its roundings; tolerance:
  ``tools/npu_check.py`` (``cann_bounds``: the error bound of each sum, allowances measured on
  the stand-in x2).
* ``MULTI_TENSOR_NPU_OP=cann_literal``: one launch, the op's own EMA ``d*s + (1-d)*var'``. The
  kernel forms ``1 - d`` in fp32 from the fp32 attribute (exact for d in [0.5, 1]), so the two
  coefficients sum to 1 and the EMA of a constant stays at it, but its decay is ``fp32(d)``:
  the EMA of a constant from 0 misses the package's bound (9.8e-5 after 20,000 steps at 0.9999
  on the stand-in), which is why it is not the default.
* ``MULTI_TENSOR_NPU_OP=exact`` (``torch`` is accepted too): the flat buffers run the reference
  backend's own code (:func:`multi_tensor.backends.reference.adam_family` on one-element
  lists: one flat tensor per list *is* the bucket), i.e. ``multi_tensor/rules.py``'s operation
  order with one torch op per line, whatever the bucket's number of params. On the CPU stand-in
  this is bitwise equal to the unflattened reference (tested). No op runs in fp64 (the AI Core
  has none): sqrt and division are made correctly rounded from fp32 operations
  (:mod:`multi_tensor.backends.npu.fp32_exact`, the device's own sqrt/div only a first guess;
  about 255 launches per bucket), so on an NPU it is bitwise if the device's fp32 multiply,
  add and subtract are IEEE, which ``tools/npu_check.py`` checks. Where ``tools/npu_check.py``
  has shown the device's own fp32 sqrt and division correctly rounded (its check 7, sqrt over
  every positive fp32 with ``--sqrt-exhaustive``), ``MULTI_TENSOR_NPU_IEEE_SQRT_DIV=1``
  (:func:`set_device_sqrt_div`) uses them as they are: one launch each, the same bits, about
  a tenth of the launches and bytes.

Where the op cannot serve, the same flat buffers run the exact path for that step (the reason
logged once at debug level and listed by ``python -m multi_tensor.env``: :data:`EXACT_PATH_FOR`):
``maximize``; the ``adam``, ``radam`` and ``radam_ema`` ops (no EMA in the op, or
RAdam's un-rectified steps); fp64; a bf16 EMA beside fp32 or fp16 state (``ema_dtype``: the op
takes its five tensors in one dtype; the flat EMA buffer is bf16 and the exact path rounds it
once per step, as the reference does); grads whose dtype does not convert exactly into the
update's dtype (fp32 grads of bf16 params without masters); a grad scale with fp16/bf16 state
(unscaled grads would be rounded to fp16/bf16); chips without the operator (CANN ships it for
Atlas A2/A3 and Ascend 950 only: :data:`SUPPORTED_CHIP_PREFIXES`); an operator that fails to
load. The optimizer's steps pass ``noop_flag=None`` (its flag is never set:
``noop_flag_optional``), so a plain step reads nothing on the host; a one-shot apex call keeps
apex's flag, read on the host once per call (on the CANN path with ``check_finite`` together with
the finite check, in one read). A step that GradScaler (``found_inf``) or clipping (a non-finite
norm) may cancel reads that flag on the host, once: CANN's operator has no skip input, and the
read is cheaper than the alternative, which a capturable group gets instead.

``capturable=True`` (:class:`CapturableFlatAdamBucket`): the engine's device-step protocol
(``run_device_step``), nothing read on the host, so the step can be captured in an NPU graph. The
step counter is an int64 device tensor and the operator computes the bias corrections from it
(``bias_correction=True``; lr, eps and weight decay the group's own); a step that may be
cancelled saves var, m, v and s into scratch before the operator and selects them back where
the flag is set (``torch.where``): 80 bytes per element more and 16 bytes per element of scratch
(at most :data:`SKIP_SLICE` elements at a time). It needs the operator (a ``cann`` mode, the
default; the ``fused_ema_adamw`` op) and a float lr, and is refused at planning otherwise.

Everything that touches CANN (the binding, its build, the op's rounding, the chip check, the
step times) is verified only on Ascend hardware with ``tools/npu_check.py``; the rest runs on
CPU CI through :mod:`multi_tensor.testing.npu_standin` (this backend registered for ``"cpu"``
with the device operator replaced).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ... import schema
from ..contract import Backend
from ..registry import register_backend
from . import fp32_exact
from . import ops as npu_ops
from .bucket import FlatAdamBucket
from .capturable import CapturableFlatAdamBucket
from .loader import SUPPORTED_CHIP_PREFIXES, DeviceOp, load_device_op  # noqa: F401  (re-exported)
from .modes import (CANN_DTYPES, CANN_OPS, DEFAULT_MODE, FLAT_GRADS_ENV, IEEE_ENV,  # noqa: F401
                    OP_MODES, device_sqrt_div, fallback_reasons, flat_grads_enabled, fold_scalars,
                    get_op_mode, op_mode, set_device_sqrt_div, set_op_mode)

EXACT_PATH_FOR = (
    "the adam, radam and radam_ema ops (the operator serves fused_ema_adamw only)",
    "maximize",
    "a bf16 EMA beside fp32 or fp16 state (the operator takes its five tensors in one dtype)",
    "grads that do not convert exactly into the state dtype (fp32 grads of bf16 params "
    "without masters)",
    "a grad scale with fp16/bf16 state",
    "chips without the operator (it ships for Atlas A2/A3 and Ascend 950 only)",
    "an operator that fails to load or its probe call",
)
"""Where a ``cann`` mode's bucket runs the exact path instead (:meth:`FlatAdamBucket._choose`)."""


def report(device_op: DeviceOp) -> list:
    """Lines for ``python -m multi_tensor.env``: the mode, the operator, where the exact path
    runs instead and why buckets of this process fell back."""
    mode = get_op_mode()
    lines = [f"NPU op mode {mode} (MULTI_TENSOR_NPU_OP: cann (default), cann_literal, exact; "
             f"exact gives the reference's bits)"]
    if mode != "exact":
        if device_op.source is not None:
            lines.append(f"CANN operator: {device_op.source}")
        elif device_op._error is not None:
            lines.append(f"CANN operator: did not load ({device_op._error}): exact path")
        else:
            lines.append("CANN operator: loaded with the first NPU bucket")
        lines.append("exact path instead for:")
        lines.extend(f"  {item}" for item in EXACT_PATH_FOR)
        for reason in fallback_reasons():
            lines.append(f"fell back in this process: {reason}")
    return lines


def _refuse_fp64(backend: str, op: str, lists) -> None:
    """The AI Core has no fp64 arithmetic: an fp64 bucket is refused when it is prepared."""
    for kind, tensors in lists.present():
        for i, t in enumerate(tensors):
            if t.dtype == torch.float64:
                raise TypeError(
                    f"{backend} backend ({op}): {kind}[{i}] of the bucket (shape "
                    f"{tuple(t.shape)}) is float64, and the Ascend AI Core has no fp64 "
                    f"arithmetic; use float32 params (or bf16/fp16 with fp32 master weights)")


def combine_norms(totals, device, sum_over_shards) -> torch.Tensor:
    """The global grad norm from the buckets' fp32 norms ``(norm, shard layout or None)``,
    without fp64 (:attr:`Backend.combine_norms`): one unsharded bucket's norm as it is (as the
    host path, whose ``sqrt(fsum([n * n]))`` is ``n``); else a sharded bucket's squared norm
    summed over its ranks in fp32 and its correctly rounded square root, and the norm of the
    buckets' norms by the blocked fp32 norm (scaled, so no square overflows)."""
    if len(totals) == 1 and totals[0][1] is None:
        return totals[0][0].to(dtype=torch.float32, device=device).reshape(())
    norms = []
    for total, layout in totals:
        total = total.to(dtype=torch.float32)
        if layout is not None:
            total = fp32_exact.sqrt([sum_over_shards(total.square(), layout)])[0]
        norms.append(total.to(device=device).reshape(1))
    return npu_ops.norm_flat(torch.cat(norms))


def make_backend(name: str = "npu", device_types=("npu",), priority: int = 20,
                 device_op: Optional[Callable] = None, description: Optional[str] = None) -> Backend:
    """A flat-bucket backend. The registered one serves ``"npu"`` and loads CANN's operator on
    first use; :mod:`multi_tensor.testing.npu_standin` makes CPU copies with another operator.
    """
    op_holder = DeviceOp(device_op)

    def prepare(op, lists, chunk_size, once=False):
        _refuse_fp64(name, op, lists)
        # once: an apex call on the caller's tensors, copied in and out rather than re-pointed
        return FlatAdamBucket(op, lists, chunk_size, op_holder, repoint=not once)

    def prepare_capturable(op, lists, chunk_size):
        _refuse_fp64(name, op, lists)
        return CapturableFlatAdamBucket(op, lists, chunk_size, op_holder)

    backend = Backend(
        name=name, device_types=tuple(device_types), priority=priority,
        ops={"scale": npu_ops.scale, "l2norm": npu_ops.l2norm}, fp64=False,
        combine_norms=combine_norms,
        prepare=prepare, prepare_capturable=prepare_capturable, adam_ops=schema.ADAM_OPS,
        description=description or ("flat buckets, one CANN aclnnApplyFusedEmaAdam launch per "
                                    "bucket (default) or the exact path "
                                    "(MULTI_TENSOR_NPU_OP=exact); torch_npu imported on first use"))
    backend.device_op = op_holder  # for diagnostics (tools/npu_check.py)
    backend.report = lambda: report(op_holder)  # python -m multi_tensor.env
    return backend


BACKEND = register_backend(make_backend())
