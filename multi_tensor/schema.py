"""The op table: every multi-tensor op's lists and dtype rules, declared once.

An op is an :class:`OpSpec`. The Adam family's lists travel by name, as an :class:`AdamLists`
(grads, params, exp_avgs, exp_avg_sqs, emas or None, masters or None, remainders or None), from the front ends to
every backend and into the C++: nothing infers a list's role from the number of lists (the apex
positional signatures are mapped to names once, in :mod:`multi_tensor.ops`). The front ends
(:mod:`multi_tensor.ops`, :mod:`multi_tensor.plan`, the optimizers) check a call's lists against
its spec with :func:`check_adam_lists` (:func:`check_lists` for ``scale``/``l2norm``) exactly
once, before any tensor is modified, and the backends trust what passed.

Adam-family ops (``rule`` set) update ``params`` from ``grads`` and keep ``exp_avgs`` and
``exp_avg_sqs``; ``emas`` is the EMA of the weights (present exactly when the op keeps one);
``masters`` are fp32 master weights of fp16/bf16/fp32 params (optional); ``remainders`` hold the
fp32 masters of bf16 params in half the memory (int16, the low halves: the encoding of
:mod:`multi_tensor.rules`; optional, never with ``masters``). Their dtype rules:

* params: fp16, bf16, fp32 or fp64; all of one list share one dtype;
* without masters, every state list has the params' dtype; with masters (fp16/bf16/fp32
  params, not fp64) state and masters are fp32; with remainders (bf16 params only) the
  remainders are int16 and the other state lists fp32, as with masters;
* the one exception: ``emas`` may be bf16 whatever the other state lists are, when the math is
  fp32 (params fp16/bf16/fp32; not fp64, whose buckets compute in fp64). The EMA is then loaded
  exactly into fp32, updated in fp32 and rounded once to bf16 (round to nearest even) on store;
* grads: fp16, bf16 or fp32 (fp64 for fp64 params).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from . import rules, validation

# The EMA storage dtype an fp32-math bucket may keep besides its state dtype.
REDUCED_EMA_DTYPE = torch.bfloat16


class AdamLists:
    """One Adam-family bucket's tensor lists, by name (read by name only: it is not a sequence).

    ``emas`` is None for ops without an EMA (or a step that skips it: :meth:`without_ema`),
    ``masters`` None without fp32 master weights, ``remainders`` None unless the fp32 masters
    are held as bf16 params plus int16 remainders (:func:`multi_tensor.rules.join_master`: the
    update runs on the joined masters and stores them split). ``grads`` is None in the lists a bucket is
    prepared with (:meth:`state`): grads are bound per step. Row ``i`` of every list belongs to
    param ``i``. The weights the update runs on are :attr:`weights`: the masters when present,
    else the params. The C++ and Triton backends read the same attributes.
    """

    FIELDS = ("grads", "params", "exp_avgs", "exp_avg_sqs", "emas", "masters", "remainders")
    __slots__ = FIELDS

    def __init__(self, grads: Optional[Sequence[torch.Tensor]], params: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                 emas: Optional[Sequence[torch.Tensor]] = None,
                 masters: Optional[Sequence[torch.Tensor]] = None,
                 remainders: Optional[Sequence[torch.Tensor]] = None):
        self.grads = grads
        self.params = params
        self.exp_avgs = exp_avgs
        self.exp_avg_sqs = exp_avg_sqs
        self.emas = emas
        self.masters = masters
        self.remainders = remainders

    @property
    def has_ema(self) -> bool:
        return self.emas is not None

    @property
    def has_master(self) -> bool:
        return self.masters is not None

    @property
    def has_remainder(self) -> bool:
        return self.remainders is not None

    @property
    def fp32_state(self) -> bool:
        """Moments (and a same-dtype EMA) are fp32 whatever the params: masters or remainders."""
        return self.masters is not None or self.remainders is not None

    @property
    def weights(self) -> Sequence[torch.Tensor]:
        return self.masters if self.masters is not None else self.params

    def present(self) -> Iterator[Tuple[str, Sequence[torch.Tensor]]]:
        """``(name, list)`` for every list that is there, in field order."""
        for name in self.FIELDS:
            tensors = getattr(self, name)
            if tensors is not None:
                yield name, tensors

    def replace(self, **changes) -> "AdamLists":
        values = {name: getattr(self, name) for name in self.FIELDS}
        values.update(changes)
        return AdamLists(**values)

    def state(self) -> "AdamLists":
        """The lists a bucket is prepared with: everything but the grads."""
        return self.replace(grads=None)

    def with_grads(self, grads: Sequence[torch.Tensor]) -> "AdamLists":
        return self.replace(grads=grads)

    def without_ema(self) -> "AdamLists":
        """The lists of the op without the EMA (``ema_update_every``'s in-between steps)."""
        return self.replace(emas=None)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "AdamLists":
        """Every tensor of every present list through ``fn`` (a local shard, a real view)."""
        return AdamLists(**{name: None if ts is None else [fn(t) for t in ts]
                            for name, ts in ((n, getattr(self, n)) for n in self.FIELDS)})

    def take(self, rows: Sequence[int]) -> "AdamLists":
        """The lists of rows ``rows`` only, in that order."""
        return AdamLists(**{name: None if ts is None else [ts[i] for i in rows]
                            for name, ts in ((n, getattr(self, n)) for n in self.FIELDS)})

    def __repr__(self) -> str:
        return "AdamLists(" + ", ".join(f"{name}=[{len(ts)}]" for name, ts in self.present()) + ")"


@dataclass(frozen=True)
class ListForm:
    """The lists of a non-Adam op (``scale``, ``l2norm``), by position."""

    names: Tuple[str, ...]


@dataclass(frozen=True)
class OpSpec:
    """An op: its engine name, the name its errors use, its rule (Adam family) and EMA, or the
    list form of a non-Adam op."""

    name: str
    api_name: str
    rule: Optional[str] = None     # rules.ADAM / rules.RADAM for the Adam family
    ema: bool = False              # an Adam-family op that keeps an EMA
    form: Optional[ListForm] = None  # scale / l2norm

    @property
    def has_ema(self) -> bool:
        return self.ema

    @property
    def adam_family(self) -> bool:
        return self.rule is not None


OPS: Dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec("fused_ema_adamw", "multi_tensor_fused_ema_adamw", rules.ADAM, ema=True),
    OpSpec("adam", "multi_tensor_adam", rules.ADAM),
    OpSpec("radam", "multi_tensor_radam", rules.RADAM),
    OpSpec("radam_ema", "multi_tensor_radam_ema", rules.RADAM, ema=True),
    OpSpec("scale", "multi_tensor_scale", form=ListForm(("srcs", "dsts"))),
    OpSpec("l2norm", "multi_tensor_l2norm", form=ListForm(("tensors",))),
)}
ADAM_OPS = tuple(name for name, spec in OPS.items() if spec.adam_family)


def adam_op(rule: str, ema: bool) -> OpSpec:
    """The Adam-family op for an update rule, with or without an EMA."""
    if rule == rules.RADAM:
        return OPS["radam_ema" if ema else "radam"]
    return OPS["fused_ema_adamw" if ema else "adam"]


def check_adam_lists(spec: OpSpec, lists: AdamLists) -> None:
    """Check an Adam-family bucket's named lists (grads included) against ``spec``; raises
    naming the tensor."""
    op = spec.api_name
    if not isinstance(lists, AdamLists):
        raise TypeError(f"{op}: expected AdamLists, got {type(lists).__name__}")
    if spec.ema != lists.has_ema:
        raise ValueError(f"{op}: this op {'keeps' if spec.ema else 'keeps no'} EMA, so emas must "
                         f"{'be a list' if spec.ema else 'be None'}")
    present = list(lists.present())
    names = tuple(name for name, _ in present)
    tensor_lists = [ts for _, ts in present]
    validation.check_list_of_lists(op, tensor_lists)
    n = validation.check_rows(op, tensor_lists, names, names.index("params"))
    if n:
        _check_adam_dtypes(op, dict(present), lists.has_master, lists.has_remainder)
        validation.check_no_overlap(op, dict(present))


def check_lists(spec: OpSpec, tensor_lists) -> ListForm:
    """Check a non-Adam op's positional lists (``scale``, ``l2norm``); returns its form."""
    op = spec.api_name
    validation.check_list_of_lists(op, tensor_lists)
    form = spec.form
    if len(tensor_lists) != len(form.names):
        raise ValueError(f"{op}: tensor_lists must be [{', '.join(form.names)}]; got "
                         f"{len(tensor_lists)} lists")
    validation.check_rows(op, tensor_lists, form.names, 0)
    return form


def grad_dtypes(param_dtype: Optional[torch.dtype]) -> tuple:
    """The grad dtypes a bucket of ``param_dtype`` params takes: fp16, bf16 or fp32, fp64 for
    fp64 params (the op table's rule, which every backend's bind applies too)."""
    if param_dtype == torch.float64:
        return (torch.float64,)
    return validation.GRAD_DTYPES


def _check_adam_dtypes(op: str, lists: Dict[str, Sequence[torch.Tensor]], has_master: bool,
                       has_remainder: bool = False) -> None:
    param_dtype = validation.check_list_dtype(op, "params", lists["params"],
                                              validation.PARAM_DTYPES)
    if has_master and has_remainder:
        raise ValueError(f"{op}: masters and remainders are two forms of the fp32 masters; pass "
                         f"one of them")
    if has_master and param_dtype == torch.float64:
        raise TypeError(f"{op}: params are float64; fp32 master weights are for fp16/bf16/fp32 params")
    if has_remainder:
        if param_dtype != torch.bfloat16:
            raise TypeError(f"{op}: params are {param_dtype}; master remainders are for bf16 params "
                            f"(the param is the master's high half)")
        validation.check_list_dtype(op, "remainders", lists["remainders"], (torch.int16,))
    state_dtype = torch.float32 if has_master or has_remainder else param_dtype
    for name, tensors in lists.items():
        if name in ("grads", "params", "remainders"):
            continue
        dtype = validation.check_list_dtype(op, name, tensors, validation.PARAM_DTYPES)
        if dtype == state_dtype:
            continue
        if name == "emas":
            if dtype == REDUCED_EMA_DTYPE and param_dtype != torch.float64:
                continue
            if param_dtype == torch.float64:
                raise TypeError(f"{op}: emas are {dtype} but must be torch.float64: params are "
                                f"float64, whose buckets compute in fp64 (a {REDUCED_EMA_DTYPE} "
                                f"EMA is for fp16/bf16/fp32 params)")
            raise TypeError(f"{op}: emas are {dtype} but must be {state_dtype} (the state dtype) "
                            f"or {REDUCED_EMA_DTYPE}")
        raise TypeError(
            f"{op}: {name} are {dtype} but must be {state_dtype} "
            + ("(optimizer state and masters are fp32 in the master-weights form)"
               if has_master else "(optimizer state is fp32 with master remainders)"
               if has_remainder else "(the same dtype as params)"))
    if "grads" in lists:
        validation.check_list_dtype(op, "grads", lists["grads"], grad_dtypes(param_dtype))
