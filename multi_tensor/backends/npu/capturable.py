"""The NPU backend's capturable bucket: the step counter on the device, nothing read on the host."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import rules
from .bucket import FlatAdamBucket
from .modes import CANN_OPS, get_op_mode, note_fallback


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

    Where the operator cannot serve a step (the ``exact`` op mode, maximize, an op it does not
    implement, a failed load: :meth:`FlatAdamBucket._choose`), the step runs the exact path and
    reads the flag and the step on the host (the reason logged once at debug level): correct,
    not sync-free.
    """

    device_steps = True

    device_step_dtype = torch.int64
    """The engine's device step counter: the operator's int64 step tensor (the AI Core has no
    fp64)."""

    reads_tensor_lr = False
    """The operator takes lr as a host attribute: a capturable group needs a float lr."""

    def capturable_refusal(self) -> Optional[str]:
        """Why this bucket's steps cannot be sync-free (checked when the group is planned), or
        None."""
        if get_op_mode() == "exact":
            return ("the NPU backend's exact path computes the step's scalars on the host "
                    "(no fp64 on the AI Core to compute them on the device): choose the CANN "
                    "operator (MULTI_TENSOR_NPU_OP=cann, the default, or npu.set_op_mode('cann'))")
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
        if path == "exact":
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
        """The exact path for a step the operator cannot serve: the flag, the step count and a
        tensor lr read on the host (the reason logged once at debug level)."""
        note_fallback(f"a capturable step reads the host: {reason or 'the exact mode'}")
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
            self._grads = None
            self.stats["skipped"] += 1
            return
        if lr is not None:
            hyper = dataclasses.replace(hyper, lr=float(lr))
        t = int(step.item()) + 1
        self.run(None, rules.step_scalars(hyper, t), grad_scale, False)
        step.add_(1)
