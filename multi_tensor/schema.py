"""The op table: every multi-tensor op's list forms and dtype rules, declared once.

An op is an :class:`OpSpec`. Its list forms are told apart by the number of lists alone; the
front ends (:mod:`multi_tensor.ops`, the optimizers' plans) check a call's lists against its
spec with :func:`check_lists` exactly once, before any tensor is modified, and the backends
trust what passed.

Adam-family ops (``rule`` set) update ``params`` from ``grads`` and keep ``exp_avgs`` and
``exp_avg_sqs``; ``emas`` is the EMA of the weights; ``masters`` are fp32 master weights of
fp16/bf16 params. Their dtype rules:

* params: fp16, bf16, fp32 or fp64; all of one list share one dtype;
* without masters, every state list has the params' dtype; with masters (fp16/bf16/fp32
  params, not fp64) state and masters are fp32;
* the one exception: ``emas`` may be bf16 whatever the other state lists are, when the math is
  fp32 (params fp16/bf16/fp32; not fp64, whose buckets compute in fp64). The EMA is then loaded
  exactly into fp32, updated in fp32 and rounded once to bf16 (round to nearest even) on store;
* grads: fp16, bf16 or fp32 (fp64 for fp64 params).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from . import rules, validation
from .backends import registry

ADAM_LISTS = ("grads", "params", "exp_avgs", "exp_avg_sqs")
# The EMA storage dtype an fp32-math bucket may keep besides its state dtype.
REDUCED_EMA_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ListForm:
    """One accepted list layout of an op."""

    names: Tuple[str, ...]

    @property
    def has_master(self) -> bool:
        return self.names[-1] == "masters"

    @property
    def has_ema(self) -> bool:
        return "emas" in self.names

    def index(self, name: str) -> Optional[int]:
        return self.names.index(name) if name in self.names else None


@dataclass(frozen=True)
class OpSpec:
    """An op: its engine name, the name its errors use, its list forms (by count), its rule."""

    name: str
    api_name: str
    forms: Tuple[ListForm, ...]
    rule: Optional[str] = None     # rules.ADAM / rules.RADAM for the Adam family
    ref_list: int = 1              # the list whose tensors fix each row's shape and device

    def form(self, n_lists: int) -> Optional[ListForm]:
        for form in self.forms:
            if len(form.names) == n_lists:
                return form
        return None

    @property
    def has_ema(self) -> bool:
        return self.rule is not None and self.forms[0].has_ema

    def describe_forms(self) -> str:
        return " or ".join(f"[{', '.join(f.names)}]" for f in self.forms)


def _adam_spec(name: str, api: str, rule: str, ema: bool) -> OpSpec:
    base = ADAM_LISTS + (("emas",) if ema else ())
    return OpSpec(name, api, (ListForm(base), ListForm(base + ("masters",))), rule)


OPS: Dict[str, OpSpec] = {spec.name: spec for spec in (
    _adam_spec("fused_ema_adamw", "multi_tensor_fused_ema_adamw", rules.ADAM, ema=True),
    _adam_spec("adam", "multi_tensor_adam", rules.ADAM, ema=False),
    _adam_spec("radam", "multi_tensor_radam", rules.RADAM, ema=False),
    _adam_spec("radam_ema", "multi_tensor_radam_ema", rules.RADAM, ema=True),
    OpSpec("scale", "multi_tensor_scale", (ListForm(("srcs", "dsts")),), ref_list=0),
    OpSpec("l2norm", "multi_tensor_l2norm", (ListForm(("tensors",)),), ref_list=0),
)}


def adam_op(rule: str, ema: bool) -> OpSpec:
    """The Adam-family op for an update rule, with or without an EMA."""
    if rule == rules.RADAM:
        return OPS["radam_ema" if ema else "radam"]
    return OPS["fused_ema_adamw" if ema else "adam"]


def check_lists(spec: OpSpec, tensor_lists) -> ListForm:
    """Check ``tensor_lists`` against ``spec``; returns the form. Raises naming the tensor."""
    op = spec.api_name
    validation.check_list_of_lists(op, tensor_lists)
    form = spec.form(len(tensor_lists))
    if form is None:
        raise ValueError(f"{op}: tensor_lists must be {spec.describe_forms()}; got "
                         f"{len(tensor_lists)} lists")
    n = validation.check_rows(op, tensor_lists, form.names, spec.ref_list)
    if n and spec.rule is not None:
        _check_adam_dtypes(op, tensor_lists, form)
        validation.check_no_overlap(op, dict(zip(form.names, tensor_lists)))
    return form


def backend_for_lists(spec: OpSpec, tensor_lists, form: ListForm) -> Optional[registry.Backend]:
    """The backend that runs checked ``tensor_lists`` (None when there are no rows).

    Tensors without real storage (DTensor, meta, fake) only go to a backend that declares it
    runs them; when none does, ``TypeError`` names the tensor.
    """
    if not tensor_lists[spec.ref_list]:
        return None
    device = tensor_lists[spec.ref_list][0].device
    which = validation.storageless(tensor_lists, form.names)
    try:
        return registry.backend_for(spec.name, device, tensor_subclasses=which is not None)
    except NotImplementedError:
        if which is None:
            raise
        raise TypeError(
            f"{spec.api_name}: {which} has no real storage (a DTensor, meta or fake tensor) and "
            f"no registered backend for {device.type} runs such tensors (for a DTensor, pass its "
            f"local shard: t.to_local())") from None


def _check_adam_dtypes(op: str, tensor_lists, form: ListForm) -> None:
    names = form.names
    param_dtype = validation.check_list_dtype(op, "params", tensor_lists[1],
                                              validation.PARAM_DTYPES)
    if form.has_master and param_dtype == torch.float64:
        raise TypeError(f"{op}: params are float64; fp32 master weights are for fp16/bf16/fp32 params")
    state_dtype = torch.float32 if form.has_master else param_dtype
    for li in range(2, len(names)):
        dtype = validation.check_list_dtype(op, names[li], tensor_lists[li], validation.PARAM_DTYPES)
        if dtype == state_dtype:
            continue
        if names[li] == "emas":
            if dtype == REDUCED_EMA_DTYPE and param_dtype != torch.float64:
                continue
            if param_dtype == torch.float64:
                raise TypeError(f"{op}: emas are {dtype} but must be torch.float64: params are "
                                f"float64, whose buckets compute in fp64 (a {REDUCED_EMA_DTYPE} "
                                f"EMA is for fp16/bf16/fp32 params)")
            raise TypeError(f"{op}: emas are {dtype} but must be {state_dtype} (the state dtype) "
                            f"or {REDUCED_EMA_DTYPE}")
        raise TypeError(
            f"{op}: {names[li]} are {dtype} but must be {state_dtype} "
            + ("(optimizer state and masters are fp32 in the master-weights form)"
               if form.has_master else "(the same dtype as params)"))
    grad_allowed = (torch.float64,) if param_dtype == torch.float64 else validation.GRAD_DTYPES
    validation.check_list_dtype(op, "grads", tensor_lists[0], grad_allowed)
