r"""A simulated Ascend 910B: a ``TorchDispatchMode`` that counts what a step would cost there.

CPU CI has no NPU. The NPU backend runs on CPU tensors through
:func:`multi_tensor.testing.npu_standin.standin_backend`; :class:`DeviceModel` watches every aten
op of such a run and records what a 910B would do with it:

* **Launches.** Every aten op that computes on device tensors is one launch. Views and metadata
  ops (``view``, ``as_strided``, ``narrow``/``slice``, ``alias``, ``detach``, ``expand``, ``t``,
  ``permute``, ``_reshape_alias``, ``unsqueeze``, ``squeeze``, ``select``, ``split``, ``set_``,
  every op whose schema returns only non-writing aliases of its inputs) and allocations
  (``empty*``) are free; ``zeros``/``ones``/``full``/``fill_``/``zero_`` write memory and are a
  launch each. Tensors made from Python scalars on the device (``aten.lift_fresh``, what
  ``torch.tensor(x, device=d)`` dispatches) are host-to-device copies: one launch each. An op
  ATen decomposes but torch_npu runs as one kernel (``isfinite``: :data:`NATIVE_COMPOSITES`) is
  one launch, not its parts.
* **torch_npu's foreach grouping.** A ``_foreach_*`` op (and
  ``_amp_foreach_non_finite_check_and_unscale_``) over ``n`` tensors is ``ceil(n / group)``
  launches when every tensor of every list argument has one dtype, and ``n`` launches otherwise.
  What this follows, in Ascend's op-plugin (torch_npu's op library, ``op_plugin/ops/opapi``):
  each foreach op first asks ATen's ``at::native::can_use_fast_route`` (which requires the
  tensors of all lists to share one dtype, device and layout) and otherwise calls ATen's
  ``foreach_tensor_*_slow`` loop, one op (one launch) per tensor (``_foreach_copy_``,
  ``_foreach_zero_``: the check, then ``split_and_exec_npu_cmd_copy`` /
  ``_split_and_exec_npu_cmd_zero``); the fast route cuts the lists into groups of
  ``SINGLE_FOREACH_OP_TENSOR_COUNT = 48`` tensors, one ``aclnnForeach*`` launch per group
  (``op_plugin/utils/custom_functions/opapi/ForeachConstants.h``, which also defines 50 for
  scalar ops and 24/16/12 for ops with two, three and four list inputs: this model uses 48 for
  every foreach op, as the lead's device model does). ``_amp_foreach_non_finite_check_and_unscale_``
  (``AmpForeachNonFiniteCheckAndUnscaleKernelNpuOpApi.cpp``) cuts its list into groups of
  ``MAX_TENSOR_COUNT = 250``, one ``aclnnForeachNonFiniteCheckAndUnscale`` each
  (:data:`AMP_GROUP`). The fast route exists on 910B-class chips only (the ``GetSocVersion``
  checks): the model is of a 910B.
* **The CANN operator.** :meth:`DeviceModel.device_op` wraps the stand-in's device operator:
  each call is one launch that reads grad, var, m, v, s and writes var, m, v, s, and the torch
  ops the stand-in computes it with are not counted (on the device it is one kernel, whatever
  the stand-in does inside).
* **Bytes.** Per launch, the bytes of its tensor inputs (read) plus its outputs (written). An
  in-place output is counted once written, plus once read since it is an input, except for ops
  that only write their destination (``copy_``, ``fill_``, ``zero_``, ``_foreach_copy_``, ...,
  and ``out=`` arguments). Python scalars are not tensors and cost nothing.
* **Host syncs**, each with its call site (the first frame outside torch and this module):
  ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``),
  ``aten.is_nonzero``, ``aten.equal``, ``Tensor.tolist()`` and ``Tensor.numpy()`` each read a
  device value on the host. A copy to the host is one too: into a host tensor (``copy_``),
  ``Tensor.cpu()``, ``Tensor.to("cpu")`` (a device named by a string), ``Tensor.to(t)`` with
  ``t`` a host tensor; on the stand-in these dispatch nothing, so the model sees the call (and
  returns a copy that is a host tensor). A ``torch.device`` object is taken for the device
  itself: the backend names its device by the object its tensors report, which on the stand-in
  is the CPU. An op whose output size depends on the data (``nonzero``, boolean-mask indexing,
  ``masked_select``, ``unique``: :data:`DATA_SIZED_OPS`) is a launch and a sync (the host waits
  for the size before it can allocate). Which tensors are host ones:
  on the stand-in every tensor is a CPU tensor, so the model tells them apart by origin
  (``host_born``, the default): a tensor made inside the model by a ``torch`` factory called
  without ``device=`` (``torch.tensor(x)``: on an NPU machine it lives on the CPU, the default
  device), and whatever is computed from such tensors alone, is a host tensor; its ops are host
  work (no launch, no fp64 device op) and reading it is no sync. Every other tensor is a device
  tensor (``host=`` adds a predicate). ``host_born=False`` treats all tensors as device tensors:
  host reads are then only the scalar reads above, and a host-side scalar computation such as
  ``reference.rounded`` (``torch.tensor(x, dtype=float64).to(float32).item()``) counts as an
  H2D copy, an fp64 launch and a sync.
* **fp64 ops.** A launch with an fp64 tensor among its inputs or outputs (the AI Core has no
  fp64: ``aclnnForeachSqrt`` rejects it, other fp64 ops fall back to the slow AI CPU). Python
  floats passed to ops are host scalars, not tensors, and are fine.

Sections: records are attributed to the current section (``"step"`` by default;
:meth:`DeviceModel.track_optimizer` attributes an optimizer's own ``step()`` to ``"optimizer"``
and everything else, e.g. ``torch.amp.GradScaler``'s own ops, to the surrounding section).

:func:`scenario_table` runs the scenarios of :data:`SCENARIOS` (three steps of the optimizer class
it is given, ``FusedEmaAdamW``, on the stand-in, the third one measured) and :func:`format_table`
prints them. Nothing here is imported by the package itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import sys
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

FOREACH_GROUP = 48
"""Tensors per launch of a one-dtype torch_npu foreach op (op-plugin's
``SINGLE_FOREACH_OP_TENSOR_COUNT``)."""

AMP_GROUP = 250
"""Tensors per launch of torch_npu's ``_amp_foreach_non_finite_check_and_unscale_`` (op-plugin's
``MAX_TENSOR_COUNT`` in ``AmpForeachNonFiniteCheckAndUnscaleKernelNpuOpApi.cpp``)."""

CANN_OP = "aclnnApplyFusedEmaAdam"

FREE_OPS = frozenset((
    "view", "_unsafe_view", "as_strided", "narrow", "slice", "alias", "detach", "expand",
    "expand_as", "t", "transpose", "permute", "reshape", "_reshape_alias", "unsqueeze", "squeeze",
    "select", "split", "split_with_sizes", "unbind", "chunk", "view_as", "view_as_real",
    "view_as_complex", "unfold", "diagonal", "set_", "resize_", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "_has_compatible_shallow_copy_type",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_nested_tensor_size", "_record_function_enter", "_record_function_enter_new",
    "_record_function_exit",
))
"""Views, metadata, allocations and profiler markers: no kernel runs (``reshape`` reaches the dispatcher as
``view``/``_reshape_alias`` when it is a view, as ``clone`` + ``_unsafe_view`` otherwise)."""

SYNC_OPS = frozenset(("_local_scalar_dense", "is_nonzero", "equal", "item"))
"""aten ops that return a device value to the host."""

SYNC_METHODS = frozenset(("tolist", "numpy"))
"""Tensor methods that read device memory on the host without an aten op a mode sees."""

DATA_SIZED_OPS = frozenset((
    "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "argwhere", "nonzero_numpy",
))
"""aten ops whose output size the host learns from the device before allocating it (boolean
indexing, ``aten.index`` with a bool index, is one too)."""

_HERE = __file__.rsplit(".", 1)[0]


def call_site() -> str:
    """``path:line (function)`` of the first frame outside torch, contextlib, functools and this
    module: where a host read was written."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        skip = (path.rsplit(".", 1)[0] == _HERE or f"{os.sep}torch{os.sep}" in path
                or path.endswith(("contextlib.py", "functools.py")))
        if not skip:
            short = os.sep.join(path.split(os.sep)[-2:])
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"

WRITE_ONLY = frozenset((
    "copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_", "normal_", "uniform_",
    "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
    "_copy_from", "_copy_from_and_resize",
))
"""In-place ops that write their destination without reading it."""

HOST_FACTORIES = frozenset((
    "tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "full", "empty", "arange",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "from_numpy",
))
"""``torch`` factories that make a host tensor when called without ``device=`` (with
``host_born``)."""

H2D_OPS = frozenset(("lift_fresh", "lift_fresh_copy", "lift", "scalar_tensor"))
"""A tensor made from host values: one host-to-device copy each."""

NATIVE_COMPOSITES = frozenset(("isfinite",))
"""Ops ATen decomposes (CompositeImplicitAutograd: on the CPU a dispatch mode sees only their
parts: ``isfinite`` is ``eq``, ``abs``, ``ne``, ``mul``) that torch_npu runs as one kernel of
their own: op-plugin's ``op_plugin_functions.yaml`` registers them for the NPU (``isfinite``:
``aclnnIsFinite``), and a backend's own kernel takes precedence over a composite one. One
launch each, reading the input and writing the output."""


def _is_foreach(name: str) -> bool:
    return name.startswith("_foreach_") or name == "_amp_foreach_non_finite_check_and_unscale_"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


@dataclasses.dataclass
class Launch:
    """One recorded op: ``count`` device launches (a foreach op may be several)."""

    op: str
    count: int
    read: int
    written: int
    fp64: bool
    section: str


@dataclasses.dataclass
class Sync:
    op: str
    section: str
    site: str = ""


@dataclasses.dataclass
class Summary:
    """What one section of a run cost: launches, bytes moved, host syncs, fp64 launches."""

    launches: int
    bytes: int
    syncs: int
    fp64_ops: int
    fp64_names: List[str]
    ops: Dict[str, int]
    sync_ops: Dict[str, int]
    sync_sites: List[str] = dataclasses.field(default_factory=list)

    def bytes_per(self, elements: int) -> float:
        return self.bytes / elements if elements else 0.0


class _HostSide(TorchFunctionMode):
    """What a dispatch mode cannot see: host reads through Tensor methods that dispatch nothing
    on CPU tensors, and tensors made on the host (a factory called without a device)."""

    def __init__(self, model: "DeviceModel"):
        super().__init__()
        self.model = model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        model = self.model
        if name in NATIVE_COMPOSITES and args and isinstance(args[0], torch.Tensor):
            return model._native(name, func, args, kwargs)
        if name in SYNC_METHODS and args and isinstance(args[0], torch.Tensor):
            if not model._is_host(args[0]):
                model._sync(f"Tensor.{name}")
            return func(*args, **kwargs)
        if (name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor)
                and model._active and not model._suspended and not model._is_host(args[0])
                and (name == "cpu" or model._host_target(args, kwargs))):
            return model._to_host(name, func, args, kwargs)
        if (model.host_born and getattr(torch, name, None) is func and name in HOST_FACTORIES
                and kwargs.get("device") is None
                and not (name == "as_tensor" and args and isinstance(args[0], torch.Tensor))):
            model._host_depth += 1
            try:
                out = func(*args, **kwargs)
            finally:
                model._host_depth -= 1
            model._mark_host(out)
            return out
        return func(*args, **kwargs)


class DeviceModel(TorchDispatchMode):
    """Records launches, bytes, host syncs and fp64 ops of the ops run inside it (see the module
    docstring). Use as a context manager; :meth:`reset` clears the records.

    ``host``: a predicate telling host tensors (``None``: none but the host-born ones).
    ``host_born``: a tensor made by a ``torch`` factory called without ``device=`` inside the
    model (``torch.tensor(x)``, ``torch.zeros(n)``; :data:`HOST_FACTORIES`), and whatever is
    computed from host tensors alone, is a host tensor: on an NPU machine such a tensor lives on
    the CPU (the default device), its ops run there and its ``.item()`` reads host memory.
    ``host_born=False`` counts them as device tensors too (every CPU tensor a device tensor).
    ``foreach_group``/``amp_group``: tensors per launch of torch_npu's one-dtype foreach route.
    """

    def __init__(self, *, host: Optional[Callable[[torch.Tensor], bool]] = None,
                 host_born: bool = True, foreach_group: int = FOREACH_GROUP,
                 amp_group: int = AMP_GROUP):
        super().__init__()
        self.host = host
        self.host_born = host_born
        self._host_depth = 0
        self._host_tensors = WeakIdKeyDictionary()
        self.foreach_group = foreach_group
        self.amp_group = amp_group
        self.launches: List[Launch] = []
        self.syncs: List[Sync] = []
        self.section = "step"
        self._suspended = 0
        self._active = 0
        self._methods = _HostSide(self)

    # --- use ----------------------------------------------------------------------------------
    def __enter__(self):
        self._methods.__enter__()
        try:
            out = super().__enter__()
        except BaseException:
            self._methods.__exit__(None, None, None)
            raise
        self._active += 1
        return out

    def __exit__(self, exc_type, exc, tb):
        self._active -= 1
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._methods.__exit__(exc_type, exc, tb)

    def reset(self) -> None:
        self.launches.clear()
        self.syncs.clear()

    @contextlib.contextmanager
    def in_section(self, name: str) -> Iterator[None]:
        previous, self.section = self.section, name
        try:
            yield
        finally:
            self.section = previous

    @contextlib.contextmanager
    def track_optimizer(self, optimizer: torch.optim.Optimizer,
                        name: str = "optimizer") -> Iterator[None]:
        """Attribute what ``optimizer.step()`` runs to section ``name`` (step hooks)."""
        saved: List[str] = []

        def pre(opt, args, kwargs):
            saved.append(self.section)
            self.section = name

        def post(opt, args, kwargs):
            self.section = saved.pop() if saved else "step"

        handles = (optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            if saved:  # a step that raised: its post hook did not run
                self.section = saved[0]

    def device_op(self, fn: Callable) -> Callable:
        """``fn`` (a device operator ``fn(grad, var, m, v, s, step, ...)``) counted as one CANN
        launch (reads grad, var, m, v, s; writes var, m, v, s), the ops inside it not counted."""

        @functools.wraps(fn)
        def op(grad, var, m, v, s, *args, **kwargs):
            if not self._active or self._suspended:
                return fn(grad, var, m, v, s, *args, **kwargs)
            self._add_launch(CANN_OP, 1, [grad, var, m, v, s], [var, m, v, s])
            return self._unrecorded(fn, grad, var, m, v, s, *args, **kwargs)

        return op

    # --- results ------------------------------------------------------------------------------
    def summary(self, section: Optional[str] = None) -> Summary:
        launches = [r for r in self.launches if section is None or r.section == section]
        syncs = [s for s in self.syncs if section is None or s.section == section]
        ops: Dict[str, int] = {}
        for r in launches:
            ops[r.op] = ops.get(r.op, 0) + r.count
        fp64 = [r for r in launches if r.fp64]
        sync_ops: Dict[str, int] = {}
        for r in syncs:
            sync_ops[r.op] = sync_ops.get(r.op, 0) + 1
        return Summary(
            launches=sum(r.count for r in launches),
            bytes=sum(r.read + r.written for r in launches),
            syncs=len(syncs),
            fp64_ops=sum(r.count for r in fp64),
            fp64_names=sorted({r.op for r in fp64}),
            ops=ops, sync_ops=sync_ops, sync_sites=[f"{r.op} at {r.site}" for r in syncs])

    # --- recording ----------------------------------------------------------------------------
    def _sync(self, op: str) -> None:
        if not self._suspended:
            self.syncs.append(Sync(op, self.section, call_site()))

    def _to_host(self, name: str, func, args, kwargs):
        """A copy of a device tensor to the host: a sync, and the copy a host tensor."""
        self._sync(f"Tensor.{name} (to host)")
        out = self._unrecorded(func, *args, **kwargs)
        if out is args[0]:  # on the stand-in the "copy" is the tensor itself
            out = self._unrecorded(torch.Tensor.clone, out)
        self._mark_host(out)
        return out

    def _host_target(self, args, kwargs) -> bool:
        """Whether ``Tensor.to(...)`` names the host: a device given as a string naming the
        CPU, or a host tensor (a ``torch.device`` object is taken for the device itself)."""
        target = kwargs.get("device")
        for value in args[1:2]:
            if isinstance(value, (str, torch.Tensor)):
                target = value
        if isinstance(value := target, torch.Tensor):
            return self._is_host(value)
        return isinstance(value, str) and value.split(":")[0] == "cpu"

    def _native(self, name: str, func, args, kwargs):
        """One of :data:`NATIVE_COMPOSITES`: one launch on device tensors, its parts not
        counted (on host tensors its parts are host work, as any op's)."""
        if self._suspended or not self._active or self._is_host(args[0]):
            return func(*args, **kwargs)
        out = self._unrecorded(func, *args, **kwargs)
        inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if not self._is_host(t)]
        self._add_launch(name, 1, inputs, list(_tensors([out])))
        return out

    def _unrecorded(self, fn: Callable, *args, **kwargs):
        """``fn`` run with recording suspended (a kernel's insides are not launches)."""
        self._suspended += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._suspended -= 1

    def _add_launch(self, name: str, count: int, inputs: List[torch.Tensor],
                    written: List[torch.Tensor]) -> None:
        """One record: ``count`` launches reading ``inputs`` and writing ``written``; fp64 if
        any of them is fp64."""
        self.launches.append(Launch(
            name, count, sum(_nbytes(t) for t in inputs), sum(_nbytes(t) for t in written),
            any(t.dtype == torch.float64 for t in inputs + written), self.section))

    def _is_host(self, t: torch.Tensor) -> bool:
        return t in self._host_tensors or (self.host is not None and bool(self.host(t)))

    def _mark_host(self, out) -> None:
        for t in _tensors([out]):
            self._host_tensors[t] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        operands = list(_tensors(list(args) + list(kwargs.values())))
        to_device = func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None
        if self._host_depth or (operands and not to_device
                                and all(self._is_host(t) for t in operands)):
            self._mark_host(out)  # host computation: no launch, no sync
        elif not self._suspended:
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            self._sync(name)
            return
        if name in DATA_SIZED_OPS or (name == "index" and any(
                t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2]))):
            self._sync(f"{name} (data-dependent size)")
        if name in FREE_OPS:
            return
        schema_args = func._schema.arguments
        mutated: List[torch.Tensor] = []
        out_args: List[torch.Tensor] = []
        inputs: List[torch.Tensor] = []
        for i, arg in enumerate(schema_args):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = list(_tensors([value]))
            if not tensors:
                continue
            writes = arg.alias_info is not None and arg.alias_info.is_write
            if writes and arg.is_out:
                out_args.extend(tensors)
            elif writes:
                mutated.extend(tensors)
                if name not in WRITE_ONLY:
                    inputs.extend(tensors)
            else:
                inputs.extend(tensors)
        returns = func._schema.returns
        if (name not in H2D_OPS and returns and not mutated and not out_args
                and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)):
            return  # returns views of its inputs: metadata only
        written = mutated + out_args
        if not written:
            written = list(_tensors([out] if isinstance(out, torch.Tensor) else
                                    (out if isinstance(out, (list, tuple)) else [])))
        if any(self._is_host(t) for t in written):
            self._sync(f"{name} (to host)")  # a device -> host copy
            return
        # host tensors among the inputs are host scalars handed to the kernel
        inputs = [t for t in inputs if not self._is_host(t)]
        count = 1
        if _is_foreach(name):
            lists = [v for v in list(args) + list(kwargs.values())
                     if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v)]
            n = max((len(v) for v in lists), default=0)
            dtypes = {t.dtype for v in lists for t in v if isinstance(t, torch.Tensor)}
            group = self.amp_group if name.startswith("_amp_") else self.foreach_group
            count = math.ceil(n / group) if len(dtypes) <= 1 else n
            if count == 0:
                return
        self._add_launch(name, count, inputs, written)


# --- the scenarios ------------------------------------------------------------------------------

SCENARIOS = {
    # the package's default mode (``mode`` None: the process's op mode, unset MULTI_TENSOR_NPU_OP:
    # the operator with one lerp for the unbiased EMA)
    "fp32": dict(dtype=torch.float32, mode=None),
    "bf16 + fp32 masters": dict(dtype=torch.bfloat16, mode=None),
    "fp32 + max_grad_norm": dict(dtype=torch.float32, mode=None, max_grad_norm=1.0),
    "fp16 + masters + GradScaler": dict(dtype=torch.float16, mode=None, scaler=True),
    # capturable=True: the step counter on the device and no host read at all; a step that may
    # be cancelled saves and restores the state on the device (the operator has no skip input)
    "fp32, capturable": dict(dtype=torch.float32, mode=None, capturable=True),
    "fp32 + max_grad_norm, capturable": dict(dtype=torch.float32, mode=None, max_grad_norm=1.0,
                                             capturable=True),
    "fp16 + masters + GradScaler, capturable": dict(dtype=torch.float16, mode=None, scaler=True,
                                                    capturable=True),
    # the operator's own (biased) EMA: one launch
    "fp32, cann_literal": dict(dtype=torch.float32, mode="cann_literal"),
    # the exact path (bitwise the reference), with sqrt and division correctly rounded from fp32
    # ops, and where the device's own are known to be correctly rounded
    # (multi_tensor.backends.npu.IEEE_ENV)
    "fp32, exact": dict(dtype=torch.float32, mode="exact"),
    "bf16 + masters, exact": dict(dtype=torch.bfloat16, mode="exact"),
    "fp32, exact, device sqrt/div": dict(dtype=torch.float32, mode="exact",
                                         device_sqrt_div=True),
}
"""Name -> options: the param dtype (fp16/bf16 params keep fp32 masters), the NPU op mode
(:data:`multi_tensor.backends.npu.OP_MODES`; None: the default), clipping,
``torch.amp.GradScaler``, the device's own sqrt and division on the exact path
(:func:`multi_tensor.backends.npu.set_device_sqrt_div`; off unless named), ``capturable`` (the
optimizer's option)."""


def param_shapes(count: int, seed: int = 0, low: int = 1000, high: int = 5000) -> List[tuple]:
    """``count`` seeded shapes of ``low..high`` elements (1-D and 2-D)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = []
    for i in range(count):
        numel = int(torch.randint(low, high + 1, (1,), generator=gen))
        if i % 3 == 1:  # some matrices: (rows, cols) with rows * cols in range
            rows = int(torch.randint(2, 9, (1,), generator=gen))
            shapes.append((rows, max(numel // rows, math.ceil(low / rows))))
        else:
            shapes.append((numel,))
    return shapes


@dataclasses.dataclass
class Measure:
    """One scenario at one number of params: the optimizer's step, and GradScaler's own ops."""

    scenario: str
    params: int
    elements: int
    ours: Summary
    scaler: Optional[Summary]

    @property
    def bytes_per_element(self) -> float:
        return self.ours.bytes_per(self.elements)


def run_scenario(name: str, params: int, *, optimizer: Callable, steps: int = 3, seed: int = 0,
                 host_born: bool = True) -> Measure:
    """``steps`` steps of ``optimizer`` (the class, ``fused_optim.FusedEmaAdamW``: this module
    is part of the engine, which never imports the optimizers) on the NPU stand-in; the last
    one measured.

    Grads are produced by autograd's backward (of ``sum(p * g)``) after the optimizer's
    ``zero_grad()``, both outside the measurement (they are the user's), so the grads land
    wherever backward accumulates them. With GradScaler the measured region is
    ``scaler.step(opt)`` + ``scaler.update()``, the optimizer's own step reported apart.
    """
    from ..backends import npu
    from . import npu_standin
    from ..backends import forced_backend

    options = SCENARIOS[name]
    dtype = options["dtype"]
    shapes = param_shapes(params, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype))
               for s in shapes]
    opt = optimizer(weights, lr=1e-3, weight_decay=0.01,
                        max_grad_norm=options.get("max_grad_norm"),
                        capturable=options.get("capturable", False))
    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
              if options.get("scaler") else None)
    model = DeviceModel(host_born=host_born)
    ours: Optional[Summary] = None
    own: Optional[Summary] = None
    # the stand-in's own default operator, whatever it computes the operator with
    device_op = inspect.signature(npu_standin.standin_backend).parameters["device_op"].default
    if not callable(device_op):  # None: the real loader, which needs torch_npu
        device_op = npu_standin.reference_device_op
    with contextlib.ExitStack() as scope:
        scope.callback(npu.set_device_sqrt_div, npu.device_sqrt_div())
        npu.set_device_sqrt_div(options.get("device_sqrt_div", False))
        backend = scope.enter_context(npu_standin.standin_backend(
            device_op=model.device_op(device_op), mode=options["mode"]))
        for k in range(steps):
            opt.zero_grad()
            scale = 2.0 ** 10 if scaler is not None else 1.0
            grads = [(torch.randn(p.shape, generator=gen) * 1e-2 * scale).to(dtype)
                     for p in weights]
            with torch.enable_grad():  # backward: d/dp sum(p * g) = g, accumulated by autograd
                torch.autograd.backward([(p * g).sum() for p, g in zip(weights, grads)])
            if scaler is not None:
                scaler.scale(torch.ones(()))  # the user's forward: GradScaler's scale exists
            last = k == steps - 1
            with forced_backend(backend.name), contextlib.ExitStack() as stack:
                if last:
                    stack.enter_context(model.track_optimizer(opt))
                    stack.enter_context(model)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
        ours = model.summary("optimizer")
        own = model.summary("step") if scaler is not None else None
    return Measure(name, params, sum(math.prod(s) for s in shapes), ours, own)


@dataclasses.dataclass
class Row:
    scenario: str
    measures: List[Measure]


def scenario_table(params: Sequence[int] = (20, 200), *, optimizer: Callable, seed: int = 0,
                   scenarios: Optional[Sequence[str]] = None, host_born: bool = True) -> List[Row]:
    """Every scenario (or those named) at each number of params, stepped by ``optimizer`` (see
    :func:`run_scenario`; ``host_born``: see :class:`DeviceModel`)."""
    names = list(SCENARIOS) if scenarios is None else list(scenarios)
    return [Row(name, [run_scenario(name, n, optimizer=optimizer, seed=seed, host_born=host_born)
                       for n in params])
            for name in names]


def _arrow(values) -> str:
    values = list(values)
    return str(values[0]) if len(set(values)) == 1 else " → ".join(str(v) for v in values)


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: scenario, launches, host syncs, fp64 ops, bytes/element, GradScaler's own."""
    if not rows:
        return ""
    counts = " → ".join(str(m.params) for m in rows[0].measures)
    lines = [f"| scenario | launches {counts} params | host syncs | fp64 ops | bytes/element "
             f"| GradScaler's own launches |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ms = row.measures
        fp64 = _arrow(m.ours.fp64_ops for m in ms)
        names = sorted({n for m in ms for n in m.ours.fp64_names})
        if names:
            fp64 += " (" + ", ".join(f"`{n}`" for n in names) + ")"
        scaler = (_arrow(m.scaler.launches for m in ms) if ms[0].scaler is not None else "-")
        lines.append(
            f"| {row.scenario} | {_arrow(m.ours.launches for m in ms)} "
            f"| {_arrow(m.ours.syncs for m in ms)} | {fp64} "
            f"| {_arrow(f'{m.bytes_per_element:.1f}' for m in ms)} | {scaler} |")
    return "\n".join(lines)

