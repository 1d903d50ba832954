"""Global grad-norm clipping and GradScaler's overflow flag, folded into the kernels.

``max_grad_norm`` clips the grads to a global L2 norm (of the unscaled grads, over every param
with a grad, as ``torch.nn.utils.clip_grad_norm_``): one multi-tensor l2norm launch per bucket,
the clip factor folded into the kernel's grad multiplier (no extra pass over the grads), a
non-finite norm skipping the step. For sharded params the squared local norms are summed over
the ranks holding the shards (an all-reduce per sharded bucket).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from multi_tensor import rules, validation
from multi_tensor.backends import registry


def _sum_over_shards(square: torch.Tensor, layout) -> torch.Tensor:
    """The sum of a local squared norm over the ranks holding the other shards: an all-reduce
    over each mesh dimension the grads are sharded along (replicated dimensions hold copies),
    as ``clip_grad_norm_`` reduces the norm of DTensor grads. Every rank runs the same buckets
    in the same order, so the collectives match."""
    import torch.distributed as dist

    mesh, placements = layout
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        elif not placement.is_replicate():
            raise NotImplementedError(
                f"max_grad_norm: grads with placement {placement} (only Shard and Replicate)")
    return square


class ClippingMixin:
    """The unscale factor and overflow of :class:`fused_optim.base.FusedOptimizerBase`'s step."""

    def _overflow(self, found_inf: Optional[torch.Tensor], work) -> tuple:
        """``(skip now, device flag)`` from GradScaler's ``found_inf`` on an accelerator.

        Read on the host, except when every bucket reads it on the device (device steps): then
        it is handed to the kernels and nothing syncs. (``step()`` reads a ``found_inf`` on the
        CPU before planning and passes None, unless device steps are planned: on the NPU's CPU
        stand-in, whose device is the CPU.) On devices without fp64 (the NPU) a clipped step
        reads only its norm's finiteness: the grads GradScaler found non-finite make that norm
        non-finite, so the one host read per step decides both.
        """
        if found_inf is None or not work:
            return False, None
        if all(b.device_steps for _, b in work):
            return False, found_inf
        if self.max_grad_norm is not None and not all(
                registry.backend_for("l2norm", b.device).fp64 for _, b in work):
            return False, None
        return bool(found_inf.item() != 0), None

    def _unscale_factor(self, work, skip_flag: Optional[torch.Tensor] = None) -> tuple:
        """``(skip, grad scale, skip flag)``: the scale the kernels divide the grads by is
        GradScaler's, with the clip factor folded in when clipping (``scale / clip`` in double,
        rounded once to fp32); a non-finite grad norm skips the step.

        When every bucket keeps its steps on the device (the Triton buckets), the skip stays on
        the device too, as GradScaler's ``found_inf`` does: the returned skip flag is
        ``skip_flag`` (``found_inf``, or None) or'ed with "the norm is not finite", the kernels
        read it, and nothing is read back to the host (no sync, and the clipped step can be
        captured). Otherwise the norm's finiteness is read on the host (one sync per step);
        where a device has no fp64 the norm itself is read and the factor computed there
        (:meth:`_clip_on_host`)."""
        grad_scale = getattr(self, "grad_scale", None)
        if self.max_grad_norm is None or not work:
            return False, grad_scale, skip_flag
        on_device = all(b.device_steps for _, b in work)
        if not on_device and not all(self._norm_backend(b).fp64 for _, b in work):
            return self._clip_on_host(work, grad_scale, skip_flag)
        norm = self._grad_norm(work)  # fp64, or fp32 where a device has no fp64
        # the device's own division, fp64 or fp32. In fp32 this is the NPU's capturable path:
        # its CANN operator divides with the same instruction (its tolerance assumes it correctly
        # rounded; tools/npu_check.py measures it), and a correctly rounded one made of fp32 ops
        # (fp32_exact.scalar_div) would cost 176 launches on a 0-dim tensor, three per step
        div = torch.div
        scale = (None if grad_scale is None
                 else grad_scale.to(device=norm.device, dtype=norm.dtype))
        if scale is not None:
            norm = div(norm, scale)
        self.last_grad_norm = norm
        if on_device:
            bad = torch.isfinite(norm).logical_not()
            if skip_flag is not None:
                bad = bad.logical_or(skip_flag.to(device=norm.device) != 0)
            skip_flag = bad.to(torch.int32).reshape(1)
        elif not bool(torch.isfinite(norm)):  # one host read per step when clipping
            return True, None, skip_flag
        # (a non-finite norm gives a NaN factor here: only on the device path, which skips)
        if norm.dtype == torch.float64:
            clip = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            return False, ((1.0 if scale is None else scale) / clip).to(torch.float32), skip_flag
        clip = div(torch.full_like(norm, self.max_grad_norm), norm + 1e-6).clamp(max=1.0)
        return False, div(torch.ones_like(norm) if scale is None else scale, clip), skip_flag

    def _norm_backend(self, bucket):
        """The backend that computes ``bucket``'s grad norm (the grads' storage kind decides)."""
        return registry.backend_for(
            "l2norm", bucket.device,
            tensor_subclasses=validation.storageless([bucket.grads], ("grads",)) is not None)

    def _bucket_square_or_norm(self, bucket, quick: bool) -> tuple:
        """``(fp32 device value, quick)``: the bucket's grad norm (``quick``: the one-read
        :func:`~multi_tensor.backends.npu.ops.quick_norm` of its flat grads, where the bucket
        offers it; never for a sharded bucket, whose ranks must all make the same collective
        calls), or for a sharded bucket the squared norm summed over its ranks."""
        total = None
        if quick and bucket.layout is None:  # sharded: every rank must make the same calls
            total = bucket.active.quick_grad_norm()
        quick = total is not None
        if total is None:
            # a flag of its own: l2norm sets it on a non-finite grad, and the step's noop flag
            # must stay clear
            flag = torch.zeros(1, dtype=torch.int32, device=bucket.device)
            total, _ = self._norm_backend(bucket).ops["l2norm"](self._chunk_size, flag,
                                                                [bucket.grads], False)
        total = total.to(dtype=torch.float32).reshape(())
        if bucket.layout is not None:
            total = _sum_over_shards(total.square(), bucket.layout)
        return total, quick

    def _clip_on_host(self, work, grad_scale, skip_flag) -> tuple:
        """:meth:`_unscale_factor` where a device has no fp64 (the NPU) and the step is decided
        on the host: each bucket's fp32 norm (one read of its flat grads where it offers
        ``quick_grad_norm``) and GradScaler's scale read on the host together, one device sync
        per step; the global norm and the clip factor are then host arithmetic, no device op.

        A quick norm that is not trusted (inf: a square overflowed or a grad is inf; below the
        bucket's ``quick_norm_min``: squares may have underflowed) is recomputed by the
        range-safe ``l2norm`` and read again: a second sync, on such steps only. A NaN skips at
        once.

        The clip factor is the fp32 one of :meth:`_unscale_factor` bit for bit: every operation
        there (``norm / scale``, ``norm + 1e-6``, ``max_grad_norm / that``, ``scale / clip``) is
        one correctly rounded fp32 operation on fp32 values, which the host computes in double
        and rounds once to fp32, the same value (a double has more than 2 * 24 + 2 bits, so the
        double rounding is innocuous for + and /). The global norm of several buckets is the
        fp32 rounding of the square root of the exact sum of their squares (``math.fsum``;
        the square of an fp32 is exact in double), independent of the bucket order."""
        device = work[0][1].device
        entries = [(bucket,) + self._bucket_square_or_norm(bucket, True) for _, bucket in work]
        values = [value.to(device=device) for _, value, _ in entries]
        if grad_scale is not None:
            values.append(grad_scale.reshape(()).to(device=device, dtype=torch.float32))
        read = ([float(values[0].item())] if len(values) == 1
                else torch.stack(values).tolist())  # the step's one host read
        terms = []
        for (bucket, _, quick), value in zip(entries, read):
            sharded = bucket.layout is not None
            if quick and not math.isnan(value) and not _trusted(value, sharded,
                                                                bucket.active.quick_norm_min):
                value = float(self._bucket_square_or_norm(bucket, False)[0].item())
            terms.append(value if sharded else value * value)  # both exact in double
        norm = _f32(math.sqrt(math.fsum(terms))) if all(map(math.isfinite, terms)) else (
            math.nan if any(map(math.isnan, terms)) else math.inf)
        norm, factor = host_clip_factor(norm, None if grad_scale is None else read[-1],
                                        self.max_grad_norm)
        self.last_grad_norm = torch.tensor(norm, dtype=torch.float32)
        if factor is None:
            return True, None, skip_flag
        return False, torch.tensor(factor, dtype=torch.float32), skip_flag

    def _grad_norm(self, work) -> torch.Tensor:
        """The global L2 norm of the bound grads (as they are, scaled or not), in fp64: one
        multi-tensor l2norm launch per bucket, from the bucket's own norm tables where its
        backend keeps them (the Triton buckets: ``grad_norm``), else by the l2norm op.

        The buckets' norms are combined by their backend's ``combine_norms``: in fp64, or, when
        a bucket's backend has no fp64 (``Backend.fp64``, the NPU), by that backend in fp32."""
        totals, combiner = [], None
        for _, bucket in work:
            # a flag of its own: l2norm sets it on a non-finite grad, and the step's noop flag
            # must stay clear
            flag = torch.zeros(1, dtype=torch.int32, device=bucket.device)
            total = bucket.active.grad_norm(flag)
            if total is None:
                backend = self._norm_backend(bucket)
                total, _ = backend.ops["l2norm"](self._chunk_size, flag, [bucket.grads], False)
            else:  # the bucket's backend, which bound these grads (no pass over them)
                backend = registry.backend_for("l2norm", bucket.device)
            if combiner is None or (combiner.fp64 and not backend.fp64):
                combiner = backend
            totals.append((total, bucket.layout))
        return combiner.combine_norms(totals, work[0][1].device, _sum_over_shards)


def host_clip_factor(norm: float, scale: Optional[float], max_grad_norm: float) -> tuple:
    """``(unscaled norm, grad scale)`` on the host from the fp32 grad norm and GradScaler's
    fp32 scale (or None): the fp32 formula of :meth:`ClippingMixin._unscale_factor`, each
    operation correctly rounded to fp32; the grad scale is None where the norm is not finite
    (the step is skipped)."""
    if scale is not None:
        norm = _f32_div(norm, scale)
    if not math.isfinite(norm):
        return norm, None
    clip = min(_f32_div(_f32(max_grad_norm), _f32(norm + _f32(1e-6))), 1.0)
    return norm, _f32_div(1.0 if scale is None else scale, clip)


def _f32(value: float) -> float:
    """``value`` rounded once to fp32 (nearest even; beyond the fp32 range: inf)."""
    return rules.rounded(value, torch.float32)


def _f32_div(a: float, b: float) -> float:
    """The correctly rounded fp32 quotient of fp32 values, with IEEE's special values."""
    if b == 0.0:
        return math.nan if a == 0.0 or math.isnan(a) else math.copysign(math.inf, a) * (
            math.copysign(1.0, b))
    return _f32(a / b)


def _trusted(value: float, squared: bool, low: float) -> bool:
    """Whether a quick norm (or its square summed over shards) is used as it is: finite and at
    least the bucket's ``quick_norm_min`` (squared with it)."""
    return math.isfinite(value) and value >= (low ** 2 if squared else low)
