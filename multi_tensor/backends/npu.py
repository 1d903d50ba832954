r"""The Ascend NPU backend: flat buckets, one ``aclnnApplyFusedEmaAdam`` launch per bucket.

Registered for device type ``"npu"`` (the name torch_npu gives PrivateUse1) at import, *without*
importing torch_npu: installing torch-npu without CANN breaks ``import torch`` itself, so
torch_npu is imported only when a bucket of tensors on an ``npu`` device is prepared (by then
the caller has imported it anyway) and when the CANN operator is loaded.

What a bucket is here (:class:`FlatAdamBucket`). The flat layout itself is an engine
capability, :mod:`multi_tensor.backends.flat` (device- and op-agnostic; its docstring says why it
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
  (:class:`~multi_tensor.backends.flat.FlatGrads`; the values copied in once) that backward
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
  :mod:`multi_tensor.backends.npu_builder`). Grad unscale and the inf/NaN check run on the flat
  grad buffer, one launch each (both in one: ``torch._amp_foreach_non_finite_check_and_unscale_``).

Numerics (the package's contract is bitwise equality with the reference backend):

* ``MULTI_TENSOR_NPU_OP=torch`` (**the default**): the flat buffers run the reference backend's
  own code (:func:`multi_tensor.backends.reference.adam_family` on one-element lists: one flat
  tensor per list *is* the bucket), i.e. ``multi_tensor/rules.py``'s operation order with one
  torch op per line, whatever the bucket's number of params. On the CPU stand-in this is
  bitwise equal to the unflattened reference (tested). No op runs in fp64 (the AI Core has
  none): sqrt and division are made correctly rounded from fp32 operations
  (:mod:`multi_tensor.backends.fp32_exact`, the device's own sqrt/div only a first guess;
  about 264 launches per bucket), so on an NPU it is bitwise if the device's fp32 multiply,
  add and subtract are IEEE, which ``tools/npu_check.py`` checks. Where ``tools/npu_check.py``
  has shown the device's own fp32 sqrt and division correctly rounded (its check 7, sqrt over
  every positive fp32 with ``--sqrt-exhaustive``), ``MULTI_TENSOR_NPU_IEEE_SQRT_DIV=1``
  (:func:`set_device_sqrt_div`) uses them as they are: one launch each, the same bits, about
  a tenth of the launches and bytes.
* ``MULTI_TENSOR_NPU_OP=cann``: the fast path, opt in. CANN's op updates var, m and v in one
  launch, then one ``lerp_`` takes the EMA in the package's unbiased form
  ``s + (1 - d) * (var' - s)`` (the op is called with ``ema_decay=1``, which leaves ``s``
  untouched). The op's step arguments are *folded*: it is called with ``bias_correction=False``
  and a constant step tensor ``[1]`` (int64, kept on the device: no per-step host-to-device
  copy), and with ``lr' = lr * sqrt(bc2) / bc1``, ``eps' = eps * sqrt(bc2)``,
  ``weight_decay' = lr * weight_decay / lr'`` (AdamW; Adam's L2 decay passes unchanged), which
  is the same update in exact arithmetic, from the engine's own per-step scalars
  (:func:`multi_tensor.rules.step_scalars`, EMA schedules included), so no engine hook for the
  step count is needed. Results differ from the reference by the kernel's fp32 complements
  (``1 - fp32(beta)``, formed on the device) and its roundings; tolerance: ``tools/npu_check.py``
  (``cann_bounds``: the error bound of each sum, allowances measured on the stand-in x2).
* ``MULTI_TENSOR_NPU_OP=cann_literal``: one launch, the op's own EMA ``d*s + (1-d)*var'``. The
  kernel forms ``1 - d`` in fp32 from the fp32 attribute (exact for d in [0.5, 1]), so the two
  coefficients sum to 1 and the EMA of a constant stays at it; its step differs from the
  unbiased lerp by the complement gap; ``tools/npu_check.py`` measures the drift.

Where the op cannot serve, the same flat buffers run the torch path (the default's code) for
that step: ``maximize``; the ``adam``, ``radam`` and ``radam_ema`` ops (no EMA in the op, or
RAdam's un-rectified steps); fp64; a bf16 EMA beside fp32 or fp16 state (``ema_dtype``: the op
takes its five tensors in one dtype; the flat EMA buffer is bf16 and the torch path rounds it
once per step, as the reference does); grads whose dtype does not convert exactly into the
update's dtype (fp32 grads of bf16 params without masters); a grad scale with fp16/bf16 state
(unscaled grads would be rounded to fp16/bf16); chips without the operator (CANN ships it for
Atlas A2/A3 and Ascend 950 only: :data:`SUPPORTED_CHIP_PREFIXES`); an operator that fails to
load (warned once). The optimizer's steps pass ``noop_flag=None`` (its flag is never set:
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
``fused_ema_adamw`` op) and a float lr, and is refused at planning otherwise.

Everything that touches CANN (the binding, its build, the op's rounding, the chip check, the
step times) is verified only on Ascend hardware with ``tools/npu_check.py``; the rest runs on
CPU CI through :mod:`multi_tensor.backends.npu_standin` (this backend registered for ``"cpu"``
with the device operator replaced).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .. import rules, schema, tensor_facts
from ..rules import StepScalars
from . import flat, fp32_exact, npu_ops, reference
from . import registry
from .registry import Backend, register_backend
from .npu_loader import (  # noqa: F401  (re-exported: the loader lives in npu_loader)
    SUPPORTED_CHIP_PREFIXES, DeviceOp, _device_name, _ensure_torch_npu, load_device_op)

OP_MODES = ("torch", "cann", "cann_literal")
CANN_OPS = ("fused_ema_adamw",)
CANN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_LAUNCH_NUMEL = 2 ** 30
"""Elements per operator launch; larger buckets take several launches over slices (a guard: CANN
documents no size limit, this keeps any 32-bit element index inside the kernel safe)."""

SKIP_SLICE = 2 ** 26
"""Elements per slice of a capturable step that may be cancelled (bounds its scratch: 16 bytes
per element of it, 1 GiB for fp32 state)."""

TORCH_PATH_SLICE = 2 ** 26
"""Elements per slice on the torch path (bounds its temporaries; elementwise, so exact)."""

FLAT_GRADS_ENV = "MULTI_TENSOR_NPU_FLAT_GRADS"
"""``0``: an optimizer's NPU buckets leave ``.grad`` alone (gathered per step, ``zero_grad`` as
torch's); ``1`` or unset (the default): grads become views of one flat buffer per bucket."""

IEEE_ENV = "MULTI_TENSOR_NPU_IEEE_SQRT_DIV"
"""``1``: the ``torch`` path takes the device's own fp32 sqrt and division (set it only where
``tools/npu_check.py`` reports both correctly rounded on this CANN version); ``0`` or unset (the
default): both built correctly rounded from fp32 ops (:mod:`fp32_exact`)."""

_mode_lock = threading.Lock()
_mode: List[str] = [os.environ.get("MULTI_TENSOR_NPU_OP", "") or "torch"]
_warned: set = set()


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: choose 1 or 0")
    return value == "1"


_device_sqrt_div: List[bool] = [_env_flag(IEEE_ENV)]


def device_sqrt_div() -> bool:
    """Whether the ``torch`` path uses the device's own fp32 sqrt and division (:data:`IEEE_ENV`)."""
    return _device_sqrt_div[0]


def set_device_sqrt_div(trusted: bool) -> None:
    """Use the device's own fp32 sqrt and division on the ``torch`` path (``trusted``), or the
    correctly rounded ones built from fp32 ops (the default). Only where ``tools/npu_check.py``
    has shown the device's correctly rounded: otherwise the path is no longer bitwise."""
    with _mode_lock:
        _device_sqrt_div[0] = bool(trusted)


def _sqrt_div() -> tuple:
    """The ``torch`` path's sqrt and division (lists in, lists out)."""
    if _device_sqrt_div[0]:
        return npu_ops.device_sqrt, npu_ops.device_div
    return fp32_exact.sqrt, fp32_exact.div


def _check_mode(mode: str) -> str:
    if mode not in OP_MODES:
        raise ValueError(f"multi_tensor NPU backend: unknown op mode {mode!r} "
                         f"(MULTI_TENSOR_NPU_OP or set_op_mode); choose one of {OP_MODES}")
    return mode


def get_op_mode() -> str:
    """The current path: ``"torch"`` (default, exact), ``"cann"`` or ``"cann_literal"``."""
    return _check_mode(_mode[0])


def set_op_mode(mode: str) -> None:
    """Choose the path for every NPU bucket from the next step on (see the module docstring)."""
    with _mode_lock:
        _mode[0] = _check_mode(mode)


@contextlib.contextmanager
def op_mode(mode: str) -> Iterator[None]:
    """Within the block, use ``mode`` (``set_op_mode``), then restore the previous one."""
    with _mode_lock:
        previous = _mode[0]
        _mode[0] = _check_mode(mode)
    try:
        yield
    finally:
        with _mode_lock:
            _mode[0] = previous


def flat_grads_enabled() -> bool:
    """Whether optimizer buckets keep their grads in flat buffers (:data:`FLAT_GRADS_ENV`)."""
    value = os.environ.get(FLAT_GRADS_ENV, "") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{FLAT_GRADS_ENV}={value!r}: choose 1 (grads as views of one flat "
                         f"buffer per bucket, the default) or 0 (grads left as they are)")
    return value == "1"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# --- the per-step scalars, folded into the operator's arguments --------------------------------

def fold_scalars(c: StepScalars) -> Dict[str, float]:
    """The operator's ``lr, eps, weight_decay, mode`` for one step, bias correction folded in.

    The operator is called with ``bias_correction=False`` (so its step is irrelevant) and::

        lr' = step_size / isb2 = lr * sqrt(bc2) / bc1      eps' = eps / isb2 = eps * sqrt(bc2)
        weight_decay' = lr_wd / lr'   (AdamW)              weight_decay' = l2_wd   (Adam, L2)

    so that ``var - lr' * (m / (sqrt(v) + eps') + wd' * var)`` is, in exact arithmetic, the
    reference's ``var - lr_wd * var - step_size * m / (sqrt(v) * isb2 + eps)``.
    """
    lr = c.step_size / c.isb2
    if c.l2:
        wd, mode = c.l2_wd, 0
    else:
        wd, mode = (c.lr_wd / lr if c.decoupled and lr != 0.0 else 0.0), 1
    return {"lr": float(lr), "eps": float(c.eps / c.isb2), "weight_decay": float(wd),
            "mode": int(mode)}


# --- a bucket -------------------------------------------------------------------------------------

class FlatAdamBucket:
    """One bucket of an Adam-family op in flat buffers (see the module docstring).

    ``lists``: a :class:`~multi_tensor.schema.AdamLists` without grads. ``repoint``: re-point
    the state tensors, the params and their grads at views of flat buffers (the optimizer's
    plans); False copies the caller's tensors in and out per run (a one-shot functional call).

    Diagnostics: ``last_path`` ("torch"/"cann"/"cann_literal"/None when nothing ran),
    ``last_reason`` (why the torch path ran in a cann mode), ``stats`` (counters),
    ``grad_keeper`` (the :class:`~multi_tensor.backends.flat.FlatGrads` of the params' grads, or
    None).
    """

    noop_flag_optional = True
    """``run`` takes ``noop_flag=None`` (nothing can cancel the step): the optimizer, whose flag
    is never set, passes None, so that its steps read nothing on the host."""

    host_grad_scale = True
    """``run`` takes a ``grad_scale`` on the CPU as it is: a clip factor worked out on the host
    (fused_optim/clipping.py) then reaches the device as a kernel scalar, not as a copy (a
    host-to-device copy from pageable memory waits for the device)."""

    @torch.no_grad()
    def __init__(self, op: str, lists, chunk_size: int, device_op: DeviceOp, *,
                 repoint: bool = True):
        self.op = op
        self.chunk_size = chunk_size
        self.ema = lists.has_ema
        self.params: List[torch.Tensor] = list(lists.params)
        self.has_master = lists.has_master
        # the state lists, in AdamLists' field order: exp_avgs, exp_avg_sqs(, emas)(, masters)
        state_names = [name for name, _ in lists.present() if name not in ("grads", "params")]
        self.device_op = device_op
        params = self.params
        self.device = params[0].device if params else torch.device("cpu")
        if self.device.type == "npu":
            _ensure_torch_npu()
        self.param_dtype = params[0].dtype if params else torch.float32
        self.work_dtype = torch.float32 if self.has_master else self.param_dtype
        self.math_dtype = reference.math_dtype(self.work_dtype)
        self._grad_dtypes = registry.grad_dtypes(self.param_dtype)
        self.shapes = [p.shape for p in params]
        self._grads_check = registry.GradsCheck(self.shapes, self.device, self._grad_dtypes)
        # the EMA's storage: the state dtype, or bf16 (schema.REDUCED_EMA_DTYPE)
        emas = lists.emas or []
        self.ema_dtype = emas[0].dtype if emas else self.work_dtype
        dtypes = [self.work_dtype, self.param_dtype, self.ema_dtype]
        list_dtypes = [self.ema_dtype if name == "emas" else self.work_dtype
                       for name in state_names]

        adopted = flat.FlatLayout.of_views(params) if params else None
        self.layout = (adopted or flat.owned_layout(lists.exp_avgs) or flat.owned_layout(params)
                       or flat.FlatLayout.packed(self.shapes, flat.align_elements(dtypes)))
        # params that tile one buffer (Megatron's, or ours from an earlier plan): that buffer
        # (read and written in place / in one copy)
        self.param_region = (flat.alias(params, self.layout, self.param_dtype, self.device)
                             if params else None)
        self.stats = {"runs": 0, "skipped": 0, "torch": 0, "cann": 0, "launches": 0,
                      "grad_gathers": 0, "grad_alias": 0, "param_copies": 0, "prepare_copies": 0}
        if (self.param_region is None and repoint and params and flat._distinct(params)
                and all(flat.can_repoint_param(p) for p in params)):
            region = flat.allocate(self.layout, self.param_dtype, self.device)
            flat.repoint_params(params, self.layout.views(region))
            self.param_region = region
            self.stats["param_copies"] += 1
        # (one native pass at every bind: a param reallocated leaves the flat buffer)
        self._param_addr = (tensor_facts.addresses(params) if self.param_region is not None
                            else None)
        moments = [flat.FlatList.adopt(getattr(lists, name), self.layout, dt, self.device,
                                       repoint_ok=repoint)
                   for name, dt in zip(state_names, list_dtypes)]
        named = dict(zip(state_names, moments))
        self.exp_avg, self.exp_avg_sq = named["exp_avgs"], named["exp_avg_sqs"]
        self.ema_list = named.get("emas")
        self.masters = named.get("masters")
        self.state = moments
        if self.has_master:
            self.weights = self.masters
        elif self.param_region is not None:
            self.weights = flat.FlatList(params, self.param_region,
                                         self.layout.views(self.param_region), False, False)
        else:
            self.weights = flat.FlatList.adopt(params, self.layout, self.work_dtype, self.device,
                                               repoint_ok=False)
        self._grad_buffers: Dict[torch.dtype, Tuple[torch.Tensor, List[torch.Tensor]]] = {}
        # the grads' flat buffer, made (or found) at the first run; only for the optimizer's
        # buckets, whose params' .grad it may re-point
        self.grad_keeper: Optional[flat.FlatGrads] = None
        self._keeps_grads = repoint and flat_grads_enabled()
        self._step_one: Optional[torch.Tensor] = None
        self._op_step: Optional[torch.Tensor] = None
        self._scratch: Optional[List[torch.Tensor]] = None
        self._grads = None
        self.last_path: Optional[str] = None
        self.last_reason: Optional[str] = None
        self.stats["prepare_copies"] = sum(1 for fl in moments if fl.copied)

    # --- per step -----------------------------------------------------------------------------
    def bind(self, grads) -> bool:
        """Whether ``grads`` fit the bucket (count, one allowed dtype, shapes, device, dense)."""
        self._grads = None
        if not self._grads_check.fits(grads):
            return False
        if self._param_addr is not None and tensor_facts.addresses(self.params) != self._param_addr:
            return False  # a param was reallocated: it no longer lives in the flat buffer
        self._grads = list(grads)
        return True

    @torch.no_grad()
    def run(self, noop_flag, scalars: StepScalars, grad_scale=None, check_finite=False) -> None:
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("FlatAdamBucket.run() without a successful bind()")
        self.last_path = None
        if not grads or self.layout.total == 0:
            return
        path, reason = self._choose(scalars, grad_scale, self._grad_dtype(grads[0].dtype))
        # an apex call's noop_flag (the optimizer passes None): read on the host, once; the
        # CANN path's finite check reads it together with its own result instead
        if (noop_flag is not None and not (check_finite and path != "torch")
                and reference._noop_is_set(noop_flag)):
            self.stats["skipped"] += 1
            return
        g_flat, owned = self._gather(grads)
        if not self.has_master:  # masters are in self.state
            self.weights.stage_in()
        for fl in self.state:
            fl.stage_in()
        if path == "torch":
            ran = self._run_torch(g_flat, scalars, grad_scale, check_finite, noop_flag)
        else:
            ran = self._run_cann(g_flat, owned, scalars, grad_scale, check_finite, noop_flag,
                                 literal=path == "cann_literal")
        if not ran:
            self.stats["skipped"] += 1
            return
        self._write_back()
        self.stats["runs"] += 1
        self.stats["torch" if path == "torch" else "cann"] += 1
        self.last_path, self.last_reason = path, reason

    def _write_back(self) -> None:
        """The state out of staging, and the params from the update's weights."""
        for fl in self.state:
            fl.stage_out()
        if self.has_master:  # the param gets the master rounded once
            if self.param_region is not None:
                self.param_region.copy_(self.masters.flat)
            else:
                flat.copy_all(self.params, self.masters.views)
        else:
            self.weights.stage_out()

    def _grads_buffer(self, grads) -> Optional[torch.Tensor]:
        """One tensor whose norm is the grads' norm: our grad buffer (zero between the views:
        allocated zeroed, and backward, ``zero_grad`` and the grad hooks write only views) or a
        gap-free buffer the grads are views of; None otherwise (the first step, before the grad
        buffer exists, and grads assigned by hand)."""
        keeper = self.grad_keeper
        if keeper is not None and keeper.serves(grads):
            buf = keeper.buffer
        elif self.layout.gap_free:
            buf = flat.alias(grads, self.layout, grads[0].dtype, self.device, writable=False)
        else:
            return None
        return None if buf is None or buf.dtype == torch.float64 else buf

    def grad_norm(self, noop_flag: torch.Tensor) -> Optional[torch.Tensor]:
        """The bound grads' fp32 norm on the device, range-safe (``npu_ops.norm_flat`` over
        their flat buffer: no concatenation), setting ``noop_flag`` on a non-finite grad; None
        where the grads are not one buffer (the caller then runs the ``l2norm`` op)."""
        grads = self._grads
        if grads is None:
            raise RuntimeError("FlatAdamBucket.grad_norm() without a successful bind()")
        if not grads or self.layout.total == 0:
            return None
        buf = self._grads_buffer(grads)
        return None if buf is None else npu_ops.norm_flat(buf, noop_flag)

    def quick_grad_norm(self) -> Optional[torch.Tensor]:
        """The bound grads' fp32 norm in one read of their flat buffer
        (:func:`~multi_tensor.backends.npu_ops.quick_norm`: trusted only when finite and at least
        ``npu_ops.QUICK_MIN``; the caller reads it and recomputes with ``l2norm`` otherwise).
        None when the grads are not (yet) one buffer: the first step, before the grad buffer
        exists, and grads assigned by hand. The padding between views of our grad buffer is
        zero (allocated zeroed; backward, ``zero_grad`` and the grad hooks write only views),
        so the buffer's norm is the grads' norm."""
        grads = self._grads
        if grads is None:
            raise RuntimeError("FlatAdamBucket.quick_grad_norm() without a successful bind()")
        if not grads or self.layout.total == 0:
            return None
        buf = self._grads_buffer(grads)
        return None if buf is None else npu_ops.quick_norm(buf)

    # --- pieces -------------------------------------------------------------------------------
    def _host_scale(self, grad_scale) -> Optional[float]:
        """``grad_scale``'s value when it lives on the host and the bucket does not (a clip
        factor from fused_optim/clipping.py), else None: reading it is no device sync."""
        if grad_scale is None or grad_scale.device.type != "cpu" or self.device.type == "cpu":
            return None
        # in the math dtype first, as the device path's ``.to(dtype=dt)`` rounds it
        return float(grad_scale.reshape(()).to(self.math_dtype).item())

    def _grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.work_dtype if flat.converts_exactly(dtype, self.work_dtype) else dtype

    def _grad_buffer(self, dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        buf = self._grad_buffers.get(dtype)
        if buf is None:
            flat_g = flat.allocate(self.layout, dtype, self.device)
            buf = self._grad_buffers[dtype] = (flat_g, self.layout.views(flat_g))
        return buf

    def _gather(self, grads) -> Tuple[torch.Tensor, bool]:
        """The flat grads in the update's dtype: ``(tensor, owned)``; owned buffers may be written."""
        dtype = self._grad_dtype(grads[0].dtype)
        region = self._grad_region(grads)
        if region is not None:
            if region.dtype == dtype:
                self.stats["grad_alias"] += 1
                return region, False
            buf, _ = self._grad_buffer(dtype)  # one buffer, one converting copy
            buf.copy_(region)
            self.stats["grad_gathers"] += 1
            return buf, True
        buf, views = self._grad_buffer(dtype)
        flat.copy_all(views, grads)
        self.stats["grad_gathers"] += 1
        return buf, True

    def _grad_region(self, grads) -> Optional[torch.Tensor]:
        """One flat tensor holding ``grads`` without a copy per param, else None.

        The optimizer's buckets: the grads' :class:`~multi_tensor.backends.flat.FlatGrads`
        buffer, made at the first run (the grads' values copied in once, each ``.grad``
        re-pointed at its view) or found again (a re-built plan, the EMA-free twin of an
        ``ema_update_every`` bucket); grads a user assigned since are copied into it, one copy of
        one dtype. Otherwise a gap-free buffer the grads already are views of (Megatron's).
        """
        keeper = self.grad_keeper
        if keeper is None and self._keeps_grads:
            keeper = flat.FlatGrads.of(grads, self.layout)
            if keeper is None and flat.FlatGrads.eligible(self.params, grads):
                keeper = flat.FlatGrads(self.params, grads, self.layout)  # copies them in
                self.stats["grad_gathers"] += 1
                grads = keeper.views
            self._keeps_grads = keeper is not None
            self.grad_keeper = keeper
        if keeper is not None and keeper.dtype == grads[0].dtype:
            if not keeper.serves(grads):
                self.stats["grad_gathers"] += 1
            return keeper.take(grads)
        if self.layout.gap_free:
            return flat.alias(grads, self.layout, grads[0].dtype, self.device, writable=False)
        return None

    def _choose(self, c: StepScalars, grad_scale, grad_dtype) -> Tuple[str, Optional[str]]:
        mode = get_op_mode()
        if mode == "torch":
            return "torch", None
        reason = None
        if self.op not in CANN_OPS:
            reason = f"op {self.op} (the operator serves fused_ema_adamw only)"
        elif c.maximize:
            reason = "maximize"
        elif self.work_dtype not in CANN_DTYPES:
            reason = f"{self.work_dtype} (the operator takes fp16, bf16, fp32)"
        elif self.ema_dtype != self.work_dtype:
            reason = (f"a {self.ema_dtype} EMA beside {self.work_dtype} state (the operator takes "
                      f"its five tensors in one dtype)")
        elif grad_dtype != self.work_dtype:
            reason = f"{grad_dtype} grads do not convert exactly into {self.work_dtype}"
        elif grad_scale is not None and self.work_dtype != torch.float32:
            reason = f"a grad scale with {self.work_dtype} state (unscaled grads would round)"
        else:
            fn, why = self.device_op.get(self.device)
            if fn is None:
                reason = why
                _warn_once("load:" + str(why), f"multi_tensor NPU backend: {why}; NPU buckets run "
                           f"the exact torch path instead")
        if reason is not None:
            return "torch", reason
        return mode, None

    def _run_torch(self, g_flat, c, grad_scale, check_finite, noop_flag) -> bool:
        """The reference's own code on the flat buffers: bitwise what the reference computes."""
        if check_finite and not bool(torch.isfinite(g_flat).all()):
            noop_flag.fill_(1)
            return False
        # the weights (masters, or the params' region) are the params of the reference's call
        flat_lists = schema.AdamLists(
            grads=[g_flat], params=[self.weights.flat], exp_avgs=[self.exp_avg.flat],
            exp_avg_sqs=[self.exp_avg_sq.flat],
            emas=[self.ema_list.flat] if self.ema else None)
        total = self.layout.total
        if grad_scale is not None and grad_scale.device != self.device:
            grad_scale = grad_scale.to(self.device)  # once, not once per slice
        sqrt, div = _sqrt_div()
        for start in range(0, total, TORCH_PATH_SLICE):
            n = min(TORCH_PATH_SLICE, total - start)
            # no fp64 on the device: sqrt and division correctly rounded from fp32 ops
            reference.adam_family(self.chunk_size, None,
                                  flat_lists.map(lambda t: t.narrow(0, start, n)), c, grad_scale,
                                  False, sqrt=sqrt, div=div)
        return True

    def _run_cann(self, g_flat, owned, c, grad_scale, check_finite, noop_flag, *,
                  literal: bool) -> bool:
        fn, _ = self.device_op.get(self.device)
        g = g_flat
        if check_finite and not owned:
            buf, _ = self._grad_buffer(g_flat.dtype)  # never unscale the caller's grads in place
            buf.copy_(g_flat)
            g, owned = buf, True
        if grad_scale is not None or check_finite:
            dt = self.math_dtype
            host = self._host_scale(grad_scale)
            if host is not None:  # fp32(1) / scale on the host: IEEE, as the reference's
                inv = reference.rounded(1.0 / host, dt) if host != 0.0 else float("inf")
            else:
                inv = self._device_inverse(grad_scale)
            if check_finite:  # one launch: check and unscale; the one host read of the step
                if not isinstance(inv, torch.Tensor):
                    inv = torch.full((), inv, dtype=dt, device=self.device)
                found = torch.zeros(1, dtype=torch.float32, device=self.device)
                if noop_flag is not None and noop_flag.numel():  # the apex flag, read with it
                    found.copy_(noop_flag.reshape(-1)[:1])
                torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv.reshape(1))
                if bool(found.item() != 0):
                    if noop_flag is not None:
                        noop_flag.fill_(1)
                    return False
            else:
                g = self._scaled(g, owned, inv)
        if self._step_one is None:
            self._step_one = torch.ones(1, dtype=torch.int64, device=self.device)
        args = fold_scalars(c)
        self._launch(fn, g, self._step_one, args["lr"], args["eps"], args["weight_decay"],
                     args["mode"], False, c, literal)
        return True

    def _device_inverse(self, grad_scale) -> torch.Tensor:
        """``1 / grad_scale`` in the math dtype on the device (0-dim; None: 1)."""
        one = torch.ones((), dtype=self.math_dtype, device=self.device)
        if grad_scale is None:
            return one
        return one / grad_scale.reshape(()).to(device=self.device, dtype=self.math_dtype)

    def _scaled(self, g: torch.Tensor, owned: bool, factor) -> torch.Tensor:
        """``g * factor``: in place on our buffer, never on the caller's grads (the product
        goes into our buffer instead)."""
        if owned:
            return g.mul_(factor)
        buf, _ = self._grad_buffer(g.dtype)
        torch.mul(g, factor, out=buf)
        return buf

    def _launch(self, fn, g, step, lr, eps, weight_decay, mode, bias_correction, c, literal,
                skip: Optional[torch.Tensor] = None) -> None:
        """The operator over the bucket (slices of :data:`MAX_LAUNCH_NUMEL`), then the unbiased
        EMA's ``lerp_`` (``literal``: the operator's own EMA). ``skip`` (a 0-dim bool device
        tensor): the step is cancelled on the device when it is set. The operator has no skip
        input, so each slice's var, m, v and s are copied into scratch first (one
        ``_foreach_copy_``) and selected back afterwards (one ``where`` each): nothing is read
        on the host, at 80 bytes per element more; slices of :data:`SKIP_SLICE` elements bound
        the scratch."""
        ema_decay = float(1.0 - c.ema_w) if literal else 1.0
        w, m, v, s = (self.weights.flat, self.exp_avg.flat, self.exp_avg_sq.flat,
                      self.ema_list.flat)
        total = self.layout.total
        size = MAX_LAUNCH_NUMEL if skip is None else min(SKIP_SLICE, MAX_LAUNCH_NUMEL)
        scratch = None if skip is None else self._skip_scratch(min(size, total))
        for start in range(0, total, size):
            n = min(size, total - start)
            outs = (w.narrow(0, start, n), m.narrow(0, start, n), v.narrow(0, start, n),
                    s.narrow(0, start, n))
            if scratch is not None:
                saved = [t.narrow(0, 0, n) for t in scratch]
                torch._foreach_copy_(saved, outs)
            result = fn(g.narrow(0, start, n), *outs, step, lr, ema_decay, float(c.beta1),
                        float(c.beta2), eps, mode, bias_correction, weight_decay)
            _take_results(result, outs)
            self.stats["launches"] += 1
            if not literal and c.ema_w != 0.0:
                outs[3].lerp_(outs[0], float(c.ema_w))  # the unbiased EMA, one launch
            if scratch is not None:
                for dst, old in zip(outs, saved):
                    torch.where(skip, old, dst, out=dst)

    def _skip_scratch(self, n: int) -> List[torch.Tensor]:
        """Four buffers of ``n`` elements in the state dtype, kept (fixed addresses, so that a
        captured graph finds them again)."""
        scratch = self._scratch
        if scratch is None or scratch[0].numel() < n:
            scratch = self._scratch = [torch.empty(n, dtype=self.work_dtype, device=self.device)
                                       for _ in range(4)]
        return scratch


class CapturableFlatAdamBucket(FlatAdamBucket):
    """A capturable group's NPU bucket: the step counter on the device, nothing read on the
    host (``run_device_step``), so the step can be captured in an NPU graph.

    The plain bucket folds the bias corrections into the operator's host attributes from the
    host's step count and reads GradScaler's ``found_inf`` (or a clipped step's non-finite norm)
    on the host once per step: the cheapest sequence, since the operator has no skip input.
    Here the operator computes the corrections itself from the int64 device step
    (``bias_correction=True``: its fp32 ``1 - Power(beta, step)``; on the stand-in's CANN
    emulation the params are as far from the reference as the plain bucket's, 2.3e-4 of their
    movement after one step and 1.7e-4 after 20 for both, dominated by the complements'
    gap; ``tools/npu_check.py`` check 13 compares the two on hardware), lr, eps and weight
    decay are the group's own, and a step that may be cancelled (a skip flag is given) saves
    and restores the state on the device (:meth:`FlatAdamBucket._launch`): 80 bytes per
    element and 16 bytes per element of scratch (at most :data:`SKIP_SLICE` elements) more than
    the plain bucket.
    A step that nothing can cancel (no GradScaler, no clipping) costs what the plain one does.

    Where the operator cannot serve a step (the ``torch`` op mode, maximize, an op it does not
    implement, a failed load: :meth:`FlatAdamBucket._choose`), the step runs the exact torch
    path and reads the flag and the step on the host (warned once): correct, not sync-free.
    """

    device_step_dtype = torch.int64
    """The engine's device step counter: the operator's int64 step tensor (the AI Core has no
    fp64)."""

    reads_tensor_lr = False
    """The operator takes lr as a host attribute: a capturable group needs a float lr."""

    def capturable_refusal(self) -> Optional[str]:
        """Why this bucket's steps cannot be sync-free (checked when the group is planned), or
        None."""
        if get_op_mode() == "torch":
            return ("the NPU backend's exact torch path computes the step's scalars on the host "
                    "(no fp64 on the AI Core to compute them on the device): choose the CANN "
                    "operator (MULTI_TENSOR_NPU_OP=cann or npu.set_op_mode('cann'))")
        if self.op not in CANN_OPS:
            return f"op {self.op} (the CANN operator serves fused_ema_adamw only)"
        return None

    @torch.no_grad()
    def run_device_step(self, step: torch.Tensor, hyper, noop_flag=None, grad_scale=None,
                        lr=None) -> None:
        """One update with the step counter ``step`` (0-dim int64 on the device), advanced
        unless ``noop_flag`` (a device flag: GradScaler's ``found_inf``, or a non-finite clip
        norm; None: nothing can cancel the step) is set."""
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("CapturableFlatAdamBucket.run_device_step() without a "
                               "successful bind()")
        self.last_path = None
        c = rules.step_scalars(hyper, 1)  # the step-independent fields (the EMA weight, mode)
        skip = None if noop_flag is None else noop_flag.reshape(-1)[0] != 0
        if not grads or self.layout.total == 0:
            self._advance(step, skip)
            return
        grad_dtype = self._grad_dtype(grads[0].dtype)
        path, reason = self._choose(c, grad_scale, grad_dtype)
        if path == "torch":
            self._grads = grads
            self._host_step(step, hyper, noop_flag, grad_scale, lr, reason)
            return
        fn, _ = self.device_op.get(self.device)
        g, owned = self._gather(grads)
        if not self.has_master:
            self.weights.stage_in()
        for fl in self.state:
            fl.stage_in()
        if grad_scale is not None:
            g = self._scaled(g, owned, self._device_inverse(grad_scale))
        if self._op_step is None:
            self._op_step = torch.zeros(1, dtype=torch.int64, device=self.device)
        # the operator sees this attempt's number (never 0, even on a cancelled first step);
        # the counter advances unless the step is cancelled
        torch.add(step.reshape(1), 1, out=self._op_step)
        self._advance(step, skip)
        wd, mode = ((c.l2_wd, 0) if c.l2 else
                    (float(hyper.weight_decay) if c.decoupled else 0.0, 1))
        self._launch(fn, g, self._op_step, float(hyper.lr), float(hyper.eps), wd, mode,
                     bool(hyper.bias_correction), c, path == "cann_literal", skip)
        self._write_back()
        self.stats["runs"] += 1
        self.stats["cann"] += 1
        self.last_path, self.last_reason = path, reason

    @staticmethod
    def _advance(step: torch.Tensor, skip: Optional[torch.Tensor]) -> None:
        """The counter advanced by one unless ``skip`` is set (an int64 addend: no mixed-dtype
        in-place add on the device)."""
        step.add_(1 if skip is None else skip.logical_not().to(step.dtype))

    def _host_step(self, step, hyper, noop_flag, grad_scale, lr, reason) -> None:
        """The torch path for a step the operator cannot serve: the flag, the step count and a
        tensor lr read on the host (warned once)."""
        _warn_once("capturable:" + str(reason),
                   f"multi_tensor NPU backend: a capturable step reads the host ({reason}); "
                   f"it runs the exact torch path instead")
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
            self._grads = None
            self.stats["skipped"] += 1
            return
        if lr is not None:
            hyper = dataclasses.replace(hyper, lr=float(lr))
        t = int(step.item()) + 1
        self.run(None, rules.step_scalars(hyper, t), grad_scale, False)
        step.add_(1)


def _take_results(result, outs) -> None:
    """The operator works in place; if a binding returned new tensors, copy them back."""
    if not isinstance(result, (tuple, list)):
        return
    for got, want in zip(result, outs):
        if isinstance(got, torch.Tensor) and got.data_ptr() != want.data_ptr():
            want.copy_(got)


# --- the backend ----------------------------------------------------------------------------------



def _refuse_fp64(backend: str, op: str, lists) -> None:
    """The AI Core has no fp64 arithmetic: an fp64 bucket is refused when it is prepared."""
    for kind, tensors in lists.present():
        for i, t in enumerate(tensors):
            if t.dtype == torch.float64:
                raise TypeError(
                    f"{backend} backend ({op}): {kind}[{i}] of the bucket (shape "
                    f"{tuple(t.shape)}) is float64, and the Ascend AI Core has no fp64 "
                    f"arithmetic; use float32 params (or bf16/fp16 with fp32 master weights)")


def make_backend(name: str = "npu", device_types=("npu",), priority: int = 20,
                 device_op: Optional[Callable] = None, description: Optional[str] = None) -> Backend:
    """A flat-bucket backend. The registered one serves ``"npu"`` and loads CANN's operator on
    first use; :mod:`multi_tensor.backends.npu_standin` makes CPU copies with another operator.
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
        prepare=prepare, prepare_capturable=prepare_capturable, adam_ops=schema.ADAM_OPS,
        description=description or ("flat buckets, one CANN aclnnApplyFusedEmaAdam launch per "
                                    "bucket (MULTI_TENSOR_NPU_OP=cann) or the exact torch path "
                                    "(default); torch_npu imported on first use"))
    backend.device_op = op_holder  # for diagnostics (tools/npu_check.py)
    return backend


BACKEND = register_backend(make_backend())
