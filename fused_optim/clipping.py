"""Global grad-norm clipping and GradScaler's overflow flag, folded into the kernels.

``max_grad_norm`` clips the grads to a global L2 norm (of the unscaled grads, over every param
with a grad, as ``torch.nn.utils.clip_grad_norm_``): one multi-tensor l2norm launch per bucket,
the clip factor folded into the kernel's grad multiplier (no extra pass over the grads), a
non-finite norm skipping the step. For sharded params the squared local norms are summed over
the ranks holding the shards (an all-reduce per sharded bucket).
"""
from __future__ import annotations

from typing import Optional

import torch

from multi_tensor import validation
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
        it is handed to the kernels and nothing syncs. On devices without fp64 (the NPU) a
        clipped step reads only its norm's finiteness: the grads GradScaler found non-finite
        make that norm non-finite, so the one host read per step decides both.
        """
        if found_inf is None or found_inf.device.type == "cpu" or not work:
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
        captured). Otherwise the norm's finiteness is read on the host (one sync per step)."""
        grad_scale = getattr(self, "grad_scale", None)
        if self.max_grad_norm is None or not work:
            return False, grad_scale, skip_flag
        norm = self._grad_norm(work)  # fp64, or fp32 where a device has no fp64
        div = _div_for(norm.dtype)
        scale = (None if grad_scale is None
                 else grad_scale.to(device=norm.device, dtype=norm.dtype))
        if scale is not None:
            norm = div(norm, scale)
        self.last_grad_norm = norm
        if all(b.device_steps for _, b in work):
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

    def _grad_norm(self, work) -> torch.Tensor:
        """The global L2 norm of the bound grads (as they are, scaled or not), in fp64: one
        multi-tensor l2norm launch per bucket, from the bucket's own norm tables where its
        backend keeps them (the Triton buckets: ``grad_norm``), else by the l2norm op.

        In fp32 when a bucket's backend has no fp64 (``Backend.fp64``, the NPU): the norm of
        the buckets' norms by the NPU's blocked fp32 norm (scaled, so no square overflows), a
        sharded bucket's squared norm summed over its ranks in fp32."""
        totals, squares, fp64 = [], [], True
        for _, bucket in work:
            # a flag of its own: l2norm sets it on a non-finite grad, and the step's noop flag
            # must stay clear
            flag = torch.zeros(1, dtype=torch.int32, device=bucket.device)
            own = getattr(bucket.active, "grad_norm", None)
            total = None if own is None else own(flag)
            if total is None:
                backend = registry.backend_for(
                    "l2norm", bucket.device,
                    tensor_subclasses=validation.storageless([bucket.grads],
                                                             ("grads",)) is not None)
                total, _ = backend.ops["l2norm"](self._chunk_size, flag, [bucket.grads], False)
                fp64 = fp64 and backend.fp64
            totals.append((total, bucket.layout))
        if not fp64:
            return _fp32_norm(totals, work[0][1].device)
        for total, layout in totals:
            square = total.to(dtype=torch.float64).square()
            if layout is not None:
                square = _sum_over_shards(square, layout)
            squares.append(square.to(device=work[0][1].device))
        return torch.stack(squares).sum().sqrt()


def _div_for(dtype: torch.dtype):
    """Division of the clip scalars: correctly rounded from fp32 ops in fp32 (the device's own
    division need not be), torch's in fp64 (the fp64 formulas keep torch's ``float / tensor``,
    a reciprocal and a product, as they are)."""
    if dtype == torch.float32:
        from multi_tensor.backends import fp32_exact
        return fp32_exact.scalar_div
    return torch.div


def _fp32_norm(totals, device) -> torch.Tensor:
    """The global norm from the buckets' fp32 norms, without fp64 (see ``_grad_norm``)."""
    from multi_tensor.backends import fp32_exact, npu_ops

    norms = []
    for total, layout in totals:
        total = total.to(dtype=torch.float32)
        if layout is not None:
            total = fp32_exact.sqrt([_sum_over_shards(total.square(), layout)])[0]
        norms.append(total.to(device=device).reshape(1))
    return npu_ops.norm_flat(torch.cat(norms))
