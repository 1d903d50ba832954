"""The contract between the optimizers and the backends: :class:`Backend` and :class:`Bucket`.

A backend (:class:`Backend`, registered in :mod:`multi_tensor.backends.registry`) turns an
Adam-family op and one bucket's state lists into a prepared :class:`Bucket`; every entry point
(the optimizers, the compiled op, the functional API, the apex ops) then drives it as
*prepare, bind, run*::

    bucket = backend.prepare_bucket(op, lists, chunk_size, once, capturable)
    bucket.bind(grads) -> bool     # cheap per-step check that the grads (and the state) still
                                   # fit; takes them for the next run; False: plan again
    bucket.run(noop_flag, scalars, grad_scale, check_finite)   # scalars: rules.StepScalars

Every bucket class derives from :class:`Bucket`, which lists everything else a caller may use
of a bucket, each with the default a backend that does not offer it gets: the callers use these
attributes as they are and never probe for them. The one backend-specific step of the
optimizers' clipping, combining the buckets' grad norms into the global one, is a
:class:`Backend` field (:attr:`Backend.combine_norms`), so ``fused_optim`` names no backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

ANY_DEVICE = "*"


class Bucket:
    """An Adam-family op bound to one bucket's state lists (``Backend.prepare``'s result).

    Required of every bucket:

    * ``bind(grads) -> bool``: take this step's grads when they (and the state the bucket
      bound) still fit: one grad per row, an allowed dtype, the rows' shapes, the device,
      dense. False binds nothing, and the caller prepares a new bucket.
    * ``run(noop_flag, scalars, grad_scale=None, check_finite=False)``: one update of the bound
      grads with the host's :class:`~multi_tensor.rules.StepScalars`; ``grad_scale`` divides the
      grads; a set ``noop_flag`` skips the update.

    Offered by some (the class attributes below give the defaults):

    * device steps (:attr:`device_steps`, :meth:`run_device_step`): the step counter and the
      step's scalars on the device, nothing read on the host (the Triton buckets, the NPU's
      capturable bucket), in the counter's dtype :attr:`device_step_dtype`;
      :meth:`capturable_refusal` says why a bucket cannot serve a capturable group, and
      :attr:`reads_tensor_lr` whether its device step reads a tensor lr;
    * how ``run`` takes its arguments: :attr:`noop_flag_optional`, :attr:`host_grad_scale`;
    * :meth:`bind_unchanged`: a bind that also vouches for the lists' checks (the Triton
      buckets);
    * the bound grads' norm from the bucket's own buffers (:meth:`grad_norm`,
      :meth:`quick_grad_norm` with :attr:`quick_norm_min`);
    * :attr:`grad_keeper`: a flat buffer that keeps the params' ``.grad`` as views (the NPU).
    """

    __slots__ = ()

    device_steps: bool = False
    """Whether the bucket offers :meth:`run_device_step`."""

    device_step_dtype: torch.dtype = torch.float64
    """The dtype of the device step counter :meth:`run_device_step` advances (float64 counts
    exactly to 2**53; the NPU, without fp64: int64)."""

    reads_tensor_lr: bool = True
    """Whether :meth:`run_device_step` reads an lr tensor on the device (else a capturable
    group needs a float lr)."""

    noop_flag_optional: bool = False
    """Whether ``run`` and :meth:`run_device_step` take ``noop_flag=None`` (nothing can cancel
    the step), so that a caller whose flag is never set makes the bucket read nothing."""

    host_grad_scale: bool = False
    """Whether ``run`` takes a ``grad_scale`` on the CPU as it is (a kernel scalar), rather
    than a copy on the bucket's device."""

    grad_keeper = None
    """The flat buffer that keeps the bucket's grads as views (``owns()``, ``zero(set_to_none)``:
    :class:`multi_tensor.backends.npu.flat.FlatGrads`), or None."""

    quick_norm_min: float = 0.0
    """The smallest :meth:`quick_grad_norm` the caller trusts (below it squares may have
    underflowed, and the caller recomputes with the ``l2norm`` op)."""

    def bind(self, grads) -> bool:
        raise NotImplementedError

    def run(self, noop_flag, scalars, grad_scale=None, check_finite=False) -> None:
        raise NotImplementedError

    def bind_unchanged(self, grads) -> bool:
        """``bind`` for the grads last bound, unchanged (the same objects at the same
        addresses), with the params and every state tensor where they were bound: True means
        the lists' checks still hold. False (nothing bound) by default: the bucket cannot tell."""
        return False

    def run_device_step(self, step: torch.Tensor, hyper, noop_flag=None, grad_scale=None,
                        lr: Optional[torch.Tensor] = None) -> None:
        """One update whose step counter ``step`` (a 0-dim :attr:`device_step_dtype` tensor on
        the device) and scalars live on the device; advanced unless ``noop_flag`` is set.
        ``hyper``: the step-independent :class:`~multi_tensor.rules.AdamHyper`; ``lr``: a device
        tensor read in place of ``hyper.lr``. Offered where :attr:`device_steps` is True."""
        raise NotImplementedError(f"{type(self).__name__} keeps its steps on the host")

    def capturable_refusal(self) -> Optional[str]:
        """Why this bucket's steps cannot be sync-free (checked when a capturable group is
        planned), or None."""
        return None

    def grad_norm(self, flag: torch.Tensor) -> Optional[torch.Tensor]:
        """The bound grads' L2 norm (an fp32 device tensor; sets ``flag`` on a non-finite grad)
        from the bucket's own buffers, or None: the caller runs the ``l2norm`` op."""
        return None

    def quick_grad_norm(self) -> Optional[torch.Tensor]:
        """The bound grads' fp32 norm in one read, trusted by the caller only when finite and at
        least :attr:`quick_norm_min`; None where the bucket has none."""
        return None


NormTotals = List[Tuple[torch.Tensor, object]]


def combine_norms(totals: NormTotals, device: torch.device,
                  sum_over_shards: Callable) -> torch.Tensor:
    """The global L2 norm of the buckets' norms ``(norm, shard layout or None)`` in fp64, on
    ``device``: the squares summed (a sharded bucket's over its ranks, by
    ``sum_over_shards(square, layout)``), then one square root."""
    squares = []
    for total, layout in totals:
        square = total.to(dtype=torch.float64).square()
        if layout is not None:
            square = sum_over_shards(square, layout)
        squares.append(square.to(device=device))
    return torch.stack(squares).sum().sqrt()


@dataclass
class Backend:
    """A named set of op implementations for some device types (registered in
    :mod:`multi_tensor.backends.registry`).

    ``ops``: ``scale`` and ``l2norm``, plain functions, and the Adam family's one-shot ops,
    derived here from ``prepare`` for the ops named in ``adam_ops``::

        scale        impl(chunk_size, noop_flag, [srcs, dsts], scale)
        l2norm       impl(chunk_size, noop_flag, [tensors], per_tensor)
        <adam op>    impl(chunk_size, noop_flag, lists, scalars, grad_scale, check_finite)

    ``prepare(op, lists, chunk_size, once) -> Bucket``: ``lists`` a
    :class:`multi_tensor.schema.AdamLists` without grads, checked against the op table (the
    backend trusts it); ``once``: the bucket serves one call on the caller's tensors, so it must
    not re-point them (the NPU's flat buckets otherwise move state into buffers of their own).
    """

    name: str
    device_types: tuple
    priority: int
    ops: Dict[str, Callable] = field(default_factory=dict)   # scale, l2norm (+ derived Adam ops)
    prepare: Optional[Callable] = None  # prepare(op, lists, chunk_size, once) -> Bucket
    adam_ops: tuple = ()
    tensor_subclasses: bool = False     # runs tensors without real storage (DTensor, meta, fake)
    description: str = ""
    # whether its devices compute in fp64; False (the Ascend AI Core): no fp64 tensor is made on
    # them, and the clipping and unscale scalars are computed in fp32 (fused_optim/clipping.py)
    fp64: bool = True
    # prepare_capturable(op, lists, chunk_size) -> a Bucket with device steps, for a capturable
    # group, where the backend's plain buckets keep their steps on the host because that is
    # cheaper there (the NPU: multi_tensor/backends/npu); None: ``prepare``
    prepare_capturable: Optional[Callable] = None
    # combine_norms(totals, device, sum_over_shards) -> the global grad norm of the buckets'
    # norms (see :func:`combine_norms`, the fp64 default); a backend without fp64 combines them
    # in fp32 its own way (the NPU)
    combine_norms: Callable = combine_norms

    def __post_init__(self):
        for op in self.adam_ops:
            self.ops[op] = _one_shot(self, op)

    def handles(self, device_type: str) -> bool:
        return ANY_DEVICE in self.device_types or device_type in self.device_types

    def prepare_bucket(self, op: str, lists, chunk_size: int, once: bool = False,
                       capturable: bool = False) -> Bucket:
        """The op bound to one bucket's state lists (a :class:`multi_tensor.schema.AdamLists`
        without grads); ``capturable``: for a capturable param group (``prepare_capturable``)."""
        if capturable and self.prepare_capturable is not None:
            return self.prepare_capturable(op, lists, chunk_size)
        return self.prepare(op, lists, chunk_size, once)


def _one_shot(backend: Backend, op: str) -> Callable:
    """``ops[op]`` of an Adam-family op: prepare (once), bind, run."""
    def impl(chunk_size, noop_flag, lists, scalars, grad_scale=None, check_finite=False):
        bucket = backend.prepare(op, lists.state(), chunk_size, True)
        if not bucket.bind(lists.grads):
            raise RuntimeError(f"{backend.name}: {op}: lists that passed the op check did not bind")
        bucket.run(noop_flag, scalars, grad_scale, check_finite)
    impl.__name__ = f"{backend.name}_{op}"
    return impl
