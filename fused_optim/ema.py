"""EMA access and EMA schedules for optimizers that keep an EMA shadow ``state[p]["ema"]``.

The EMA of a param that has not stepped yet is the param itself.

:class:`EmaAccessMixin` gives every such optimizer (``FusedEmaAdamW``, ``FusedRAdam(ema_decay=...)``)

* the per-step decay through the ``_ema_decay(group, step)`` hook, from the group's schedule options
  (``ema_schedule``, ``ema_start_step``, ``ema_inv_gamma``, ``ema_power``, ``ema_min_decay``; see
  :mod:`fused_optim.ema_schedules`). Decays are computed for every bucket before any tensor is
  modified, so a bad schedule value raises with nothing changed; ``last_ema_decays`` maps
  ``(group index, step)`` to the decays the last step used;
* an opt-in EMA of a module's buffers (BatchNorm running statistics), as timm's ``ModelEmaV3``
  and ema-pytorch's ``EMA`` keep: ``register_ema_buffers(module)`` (:mod:`fused_optim.ema_buffers`);
* evaluation with EMA weights: ``swap_ema_weights()`` (a context manager), and MindSpeed's /
  diffusers' ``store()`` / ``copy_to()`` / ``restore()``;
* export: ``copy_ema_to(module_or_tensors)`` and ``ema_state_dict(module)``.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from multi_tensor import rules
from multi_tensor.bucketing import is_dtensor, local_shard

from . import ema_schedules
from .ema_buffers import BUFFERS_KEY  # noqa: F401  (re-exported: fused_optim.ema.BUFFERS_KEY)
from .ema_buffers import EmaBufferMixin, Params, _persistent_buffers

_KEEP = object()


def _reshard(module: Optional[torch.nn.Module]) -> None:
    """Release the gathered params of every FSDP2 module in ``module`` (FSDP2 gathers again from
    the shards at the next forward); nothing for other modules."""
    if module is None or not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


class EmaAccessMixin(EmaBufferMixin):
    """EMA schedules and EMA access for a :class:`FusedOptimizerBase` subclass (list it first)."""

    _ema_swapped = False
    _ema_stored: Optional[List[Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
    _ema_stored_buffers: Optional[Dict[str, torch.Tensor]] = None
    last_ema_decays: Dict[Tuple[int, int], float] = {}
    # carried by deepcopy/pickle (FusedOptimizerBase): the last decays, and a swap in progress
    # (a copy of a swapped optimizer must know its params hold the EMA)
    _instance_attrs = ("last_ema_decays", "_ema_swapped", "_ema_stored", "_ema_stored_buffers")

    # --- schedules ----------------------------------------------------------------------------
    def _ema_decay(self, group: Dict[str, Any], step: int) -> Optional[float]:
        """The EMA decay of ``group``'s update at step ``step`` (None: the group keeps no EMA).

        Called before any bucket runs, so a bad schedule value raises with nothing changed.
        """
        return ema_schedules.group_ema_decay(type(self).__name__, group, step, checked=True)

    def _note_hyper(self, index: int, step: int, hyper) -> None:
        """The decays each step uses are kept in ``last_ema_decays``."""
        if hyper.ema_decay is not None:
            self.last_ema_decays[(index, step)] = hyper.ema_decay
        super()._note_hyper(index, step, hyper)

    def _before_step(self) -> None:
        self._check_not_swapped()
        self.last_ema_decays = {}
        super()._before_step()

    def ema_decay_at(self, step: int, group: int = 0) -> Optional[float]:
        """The decay the EMA update at optimizer step ``step`` (>= 1) of ``param_groups[group]`` uses;
        ``None`` if that step does not update the EMA (``ema_update_every``)."""
        return ema_schedules.group_ema_decay(type(self).__name__, self.param_groups[group], int(step))

    def set_ema_schedule(self, ema_schedule=_KEEP, *, ema_start_step=_KEEP, ema_inv_gamma=_KEEP,
                         ema_power=_KEEP, ema_min_decay=_KEEP, ema_update_every=_KEEP) -> None:
        """Set EMA schedule options on every param group (and the defaults of groups added later).

        For optimizers whose constructor does not take them; options not given are left as they
        are. They are stored in the param groups, so ``state_dict()`` saves them.
        """
        given = {k: v for k, v in dict(ema_schedule=ema_schedule, ema_start_step=ema_start_step,
                                       ema_inv_gamma=ema_inv_gamma, ema_power=ema_power,
                                       ema_min_decay=ema_min_decay,
                                       ema_update_every=ema_update_every).items() if v is not _KEEP}
        for group in self.param_groups:
            ema_schedules.check_group(type(self).__name__, {**group, **given})
        for group in self.param_groups:
            group.update(given)
        self.defaults.update(given)

    # --- helpers ------------------------------------------------------------------------------
    def _own_params(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _ema_pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``[(param, ema)]`` for every param that has an EMA, in param-group order."""
        pairs = []
        for p in self._own_params():
            state = self.state.get(p)
            if state and state.get("ema") is not None:
                pairs.append((p, state["ema"]))
        return pairs

    def _ema_of(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state.get(p)
        ema = state.get("ema") if state else None
        return p if ema is None else ema

    def _master_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        state = self.state.get(p)
        return state.get("master_param") if state else None

    def _remainder_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The int16 master remainder of a bf16 param (``master_weights="remainder"``)."""
        state = self.state.get(p)
        return state.get("param_remainder") if state else None

    def _set_remainder_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Make ``value`` (fp32) the master of ``p``, which keeps a remainder: ``p`` becomes its
        high half (nearest, ties away from zero) and the remainder its low half."""
        high, low = rules.split_master(local_shard(value).detach().to(torch.float32))
        local_shard(p).copy_(high)
        local_shard(self._remainder_of(p)).copy_(low)

    def _check_not_swapped(self) -> None:
        if self._ema_swapped:
            raise RuntimeError(
                f"{type(self).__name__}.step() called inside swap_ema_weights(): the params hold "
                f"the EMA weights there; step after the block ends")

    @staticmethod
    def _as_tensors(parameters) -> List[torch.Tensor]:
        if isinstance(parameters, torch.nn.Module):
            return list(parameters.parameters())
        if isinstance(parameters, torch.Tensor):
            return [parameters]
        return list(parameters)

    @staticmethod
    def _check_matches(what: str, targets: List, refs: List[torch.Tensor], ref_label: str) -> None:
        """``targets`` are tensors matching ``refs`` one to one in count and shape."""
        if len(targets) != len(refs):
            raise ValueError(f"{what}: got {len(targets)} tensors but {ref_label} {len(refs)}")
        for i, (target, ref) in enumerate(zip(targets, refs)):
            if not isinstance(target, torch.Tensor):
                raise TypeError(f"{what}: parameters[{i}] is a {type(target).__name__}, not a tensor")
            if target.shape != ref.shape:
                raise ValueError(
                    f"{what}: parameters[{i}] has shape {tuple(target.shape)} but {ref_label} "
                    f"tensor {i} of shape {tuple(ref.shape)}")

    def _targets(self, what: str, parameters: Params) -> List[torch.Tensor]:
        """``parameters`` as tensors matching the optimizer's params one to one (None: its own)."""
        own = self._own_params()
        if parameters is None:
            return own
        targets = self._as_tensors(parameters)
        self._check_matches(what, targets, own, "the optimizer has")
        return targets

    def _snapshot(self, targets: List[torch.Tensor], with_masters: bool):
        """Exact copies of ``targets`` (and, if asked, of the fp32 masters of those that are ours)."""
        saved = []
        for t in targets:
            master = ((self._master_of(t) if self._remainder_of(t) is None
                       else self._remainder_of(t)) if with_masters else None)
            saved.append((t.detach().clone(),
                          None if master is None else master.detach().clone()))
        return saved

    def _write_back(self, targets: List[torch.Tensor], saved) -> None:
        """Put a :meth:`_snapshot` back: every target (and master, if one was saved) exactly."""
        for t, (value, master_value) in zip(targets, saved):
            t.copy_(value)
            remainder = self._remainder_of(t)
            if remainder is not None:
                # a saved remainder is restored; otherwise the master is the restored param
                if master_value is not None:
                    remainder.copy_(master_value)
                else:
                    remainder.zero_()
                continue
            master = self._master_of(t)
            if master is not None:
                # a master saved with it is restored; otherwise it follows the restored value
                master.copy_(master_value if master_value is not None else t)

    # --- swap ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def swap_ema_weights(self, enabled: bool = True, *, ema_buffers: Optional[bool] = None,
                         module: Optional[torch.nn.Module] = None) -> Iterator[None]:
        """Within the block the params hold their EMA weights (rounded to the param dtype).

        With a buffer EMA (:meth:`register_ema_buffers`) the registered module's buffers hold
        theirs too (floating buffers their EMA rounded to the buffer dtype, others the copy),
        unless ``ema_buffers=False``. On exit, also on an exception, every param and buffer gets
        back exactly the value it had. Masters, moments and the EMA itself are untouched.
        ``enabled=False`` makes it a no-op, for ``with opt.swap_ema_weights(enabled=use_ema):``.
        ``step()`` inside the block raises.

        Sharded models (FSDP2, DTensor params): the sharded params are swapped, and the model
        must be given (``module=model``, or registered with :meth:`register_ema_buffers`):
        FSDP2 keeps the root module's params gathered after a forward without backward, and a
        gathered copy would hide the swap (inside the block, and again after it), so every
        ``FSDPModule`` of it is resharded on entry and on exit (``FSDPModule.reshard()``).
        """
        if not enabled:
            yield
            return
        if self._ema_swapped:
            raise RuntimeError("swap_ema_weights() is already active")
        what = f"{type(self).__name__}.swap_ema_weights"
        buffer_module = self._buffer_module_for(what, None, ema_buffers)
        buffers = self._buffer_targets(what, buffer_module) if buffer_module is not None else []
        pairs = self._ema_pairs()
        params = [p for p, _ in pairs]
        sharded = module if module is not None else self._ema_buffer_module
        if sharded is None and any(is_dtensor(p) for p in params):
            raise ValueError(
                f"{what}: the params are sharded (DTensor, e.g. FSDP2): pass the model, "
                f"swap_ema_weights(module=model), so that its gathered params are released and "
                f"gathered again from the swapped shards")
        with torch.no_grad():
            _reshard(sharded)
            backup = self._snapshot(params, with_masters=False)
            buffer_backup = [buf.detach().clone() for _, buf in buffers]
            self._ema_swapped = True
            try:
                for p, ema in pairs:
                    p.copy_(ema)
                for key, buf in buffers:
                    buf.copy_(self._ema_buffer_avg[key])
                yield
            finally:
                for p, (value, _) in zip(params, backup):
                    p.copy_(value)
                for (_, buf), value in zip(buffers, buffer_backup):
                    buf.copy_(value)
                _reshard(sharded)
                self._ema_swapped = False

    # --- copy ---------------------------------------------------------------------------------
    @torch.no_grad()
    def copy_ema_to(self, params: Params = None, *, ema_buffers: Optional[bool] = None) -> None:
        """Copy the EMA weights into ``params`` (a module, or tensors in the optimizer's param order).

        ``None`` copies them into the optimizer's own params. A target that is one of the
        optimizer's own params then *becomes* the EMA weights: its fp32 master (if it has one) is
        set to the EMA too (exactly: a bf16 EMA, ``ema_dtype=torch.bfloat16``, widens exactly),
        so a later ``step()`` continues from the EMA weights, for fp16/bf16
        params with masters as for fp32 ones (MindSpeed's ``copy_to`` semantics). Moments and the
        EMA are untouched. Use :meth:`store` first and :meth:`restore` after to get the training
        weights (and masters) back exactly.

        Sharded params (FSDP2): a plain (unsharded) target module gets the full EMA, gathered
        (a collective: call it on every rank); a sharded target gets the shards. Copying into
        the optimizer's own sharded params (``None``) writes the shards: if a forward without
        backward ran since the last backward, FSDP2 still holds the root's gathered params, so
        call ``model.reshard()`` before the next forward.

        With a buffer EMA (:meth:`register_ema_buffers`), ``None`` also copies it into the
        registered module's buffers and a module target gets it in its buffers of the same names
        (``ema_buffers=False``: params only; ``True``: raise if there is no buffer EMA to copy).
        Every target is checked before anything is written.
        """
        what = f"{type(self).__name__}.copy_ema_to"
        own = self._own_params()
        targets = self._targets("copy_ema_to", params)
        module = self._buffer_module_for(what, params, ema_buffers)
        buffers = self._buffer_targets(what, module) if module is not None else []
        if self._ema_swapped:
            into_own = any(t is p for t, p in zip(targets, own))
            if not into_own and buffers and self._ema_buffer_module is not None:
                registered = {id(b) for _, b in _persistent_buffers(self._ema_buffer_module)}
                into_own = any(id(buf) in registered for _, buf in buffers)
            if into_own:
                raise RuntimeError(
                    f"{type(self).__name__}.copy_ema_to() into the optimizer's own params or "
                    f"registered buffers inside swap_ema_weights(): the block restores them on "
                    f"exit; copy after it ends")
        for target, p in zip(targets, own):
            ema = self._ema_of(p)
            if target is not ema:
                # a plain target of a sharded EMA (FSDP2) gets the full tensor (a collective:
                # every rank copies); a sharded target takes the shards
                target.copy_(ema.full_tensor() if is_dtensor(ema) and not is_dtensor(target)
                             else ema)
            master = self._master_of(p)
            if target is p and master is not None and ema is not p:
                master.copy_(ema)
            if target is p and self._remainder_of(p) is not None and ema is not p:
                self._set_remainder_master(p, ema)
        for key, buf in buffers:
            buf.copy_(self._ema_buffer_avg[key])

    def copy_to(self, parameters: Params = None) -> None:
        """MindSpeed / diffusers ``copy_to``: copy the EMA weights into ``parameters``.

        ``None``: the optimizer's own params (MindSpeed's ``copy_to()``). Same as :meth:`copy_ema_to`
        (buffer EMA included for ``None`` and modules).
        """
        self.copy_ema_to(parameters)

    # --- store / restore ----------------------------------------------------------------------
    @torch.no_grad()
    def store(self, parameters: Params = None) -> None:
        """Save exact copies of ``parameters`` (default: the optimizer's own params) for :meth:`restore`.

        As MindSpeed's / diffusers' ``store``. For the optimizer's own params the fp32 masters are
        saved too, so ``store(); copy_to(); ...; restore()`` gives back params *and* masters
        bit for bit. With a buffer EMA, the buffers :meth:`copy_ema_to` would write for the same
        argument (``None``: the registered module's; a module: its own) are saved too. A later
        ``store`` replaces the saved copies.
        """
        what = f"{type(self).__name__}.store"
        targets = self._own_params() if parameters is None else self._as_tensors(parameters)
        for i, t in enumerate(targets):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"store: parameters[{i}] is a {type(t).__name__}, not a tensor")
        module = self._buffer_module_for(what, parameters, None)
        buffers = self._buffer_targets(what, module) if module is not None else []
        self._ema_stored = self._snapshot(targets, with_masters=True)
        self._ema_stored_buffers = {key: buf.detach().clone() for key, buf in buffers}

    @torch.no_grad()
    def restore(self, parameters: Params = None) -> None:
        """Copy the values saved by :meth:`store` back into ``parameters`` (default: own params).

        Exact (the saved copies keep the dtype), and masters saved with the params are restored as
        well; the masters of own params restored without one follow the restored values. Buffers
        saved by ``store`` are written back by name into the registered module (``None``) or into
        the module given. The saved copies are released afterwards, as in diffusers (a second
        ``restore`` raises).
        """
        saved = self._ema_stored
        if saved is None:
            raise RuntimeError(
                f"{type(self).__name__}.restore(): nothing to restore; call store() first")
        what = f"{type(self).__name__}.restore"
        targets = self._own_params() if parameters is None else self._as_tensors(parameters)
        self._check_matches("restore", targets, [value for value, _ in saved], "store() saved")
        saved_buffers = self._ema_stored_buffers or {}
        module = self._ema_buffer_module if parameters is None else (
            parameters if isinstance(parameters, torch.nn.Module) else None)
        buffers = []
        if saved_buffers and module is not None:
            for key, value in saved_buffers.items():
                try:
                    buf = module.get_buffer(key)
                except AttributeError:
                    buf = None
                if buf is None or buf.shape != value.shape:
                    raise ValueError(f"{what}: the module has no buffer {key!r} of shape "
                                     f"{tuple(value.shape)}, which store() saved")
                buffers.append((buf, value))
        self._write_back(targets, saved)
        for buf, value in buffers:
            buf.copy_(value)
        self._ema_stored = None
        self._ema_stored_buffers = None

    # --- export -------------------------------------------------------------------------------
    @torch.no_grad()
    def ema_state_dict(self, module: torch.nn.Module, dtype: Optional[torch.dtype] = None, *,
                       ema_buffers: Optional[bool] = None,
                       full_state_dict: bool = False) -> Dict[str, torch.Tensor]:
        """``module.state_dict()`` with every optimized param replaced by a copy of its EMA.

        Values are in the param's dtype unless ``dtype`` is given (e.g. ``torch.float32`` to export
        the fp32 EMA of a bf16 model without rounding it to bf16; with ``ema_dtype=torch.bfloat16``
        the EMA itself is bf16, and a wider ``dtype`` holds its exact value). With a buffer EMA
        (:meth:`register_ema_buffers`;
        ``ema_buffers=None`` or ``True``) the module's buffers of the kept names are replaced by
        their EMA (floating buffers, in the buffer's dtype unless ``dtype`` is given) or the kept
        copy (others); ``ema_buffers=True`` raises if no buffer EMA is kept, ``False`` leaves the
        buffers out of it. Other buffers and params this optimizer does not hold are copied as
        they are.

        Sharded models (FSDP2: DTensor params): by default the values stay DTensors sharded like
        the params (each rank holds its shards: save them with ``torch.distributed.checkpoint``).
        ``full_state_dict=True`` gathers every DTensor into a full plain tensor **on every rank**
        (a collective: every rank must call it, in the same order), a dict that
        ``torch.save`` on one rank writes as a plain model checkpoint and a plain (unsharded)
        model loads with ``load_state_dict``.
        """
        what = f"{type(self).__name__}.ema_state_dict"
        emas = {id(p): ema for p, ema in self._ema_pairs()}
        params = dict(module.named_parameters(remove_duplicate=False))
        buffer_module = self._buffer_module_for(what, module, ema_buffers)
        buffer_emas: Dict[int, torch.Tensor] = {}
        if buffer_module is not None:
            for key, buf in self._buffer_targets(what, buffer_module):
                buffer_emas[id(buf)] = self._ema_buffer_avg[key]
        result = OrderedDict()
        for name, value in module.state_dict(keep_vars=True).items():
            source = value
            if name in params and id(params[name]) in emas:
                source = emas[id(params[name])]
            elif id(value) in buffer_emas:  # by identity: names aliasing one buffer all get it
                source = buffer_emas[id(value)]
            target_dtype = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
            result[name] = source.detach().to(dtype=target_dtype, copy=True)
            if full_state_dict and is_dtensor(result[name]):
                result[name] = result[name].full_tensor()
        return result
