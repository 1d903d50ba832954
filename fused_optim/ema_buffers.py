"""The buffer EMA: an optimizer-kept EMA of a module's buffers (BatchNorm running statistics),
as timm's ``ModelEmaV3`` and ema-pytorch's ``EMA`` keep. :class:`EmaBufferMixin` is the base
of :class:`fused_optim.ema.EmaAccessMixin`, which swaps and exports the buffer EMA with the
param EMA (:mod:`fused_optim.ema`).

Buffer EMA
----------
``opt.register_ema_buffers(model)`` makes the optimizer keep, for every persistent buffer of
``model`` (those in ``model.state_dict()``), by its name in ``model``:

* floating-point buffers (``running_mean``, ``running_var``): an EMA, kept in fp32 (fp64 for fp64
  buffers) on the buffer's device, starting as the buffer's value at registration. After every
  ``step()`` that made an EMA update it is moved with the decay ``d`` of that step's param EMA by
  ``torch._foreach_lerp_(emas, buffers, w)``, ``w = 1 - d``: torch's lerp, ``s + w * (b - s)``
  (``b - (b - s) * (1 - w)`` where ``w >= 0.5``; ``d = 0.0``, e.g. up to ``ema_start_step``,
  gives exactly ``b``), in the EMA's dtype. That is the unbiased form of the kernel's param update,
  computed by torch's kernels, so not necessarily bit-identical to the fused kernel on the same
  values. ``d`` is the decay of the lowest-indexed param group that made an EMA update in that
  step (the smallest group index in ``last_ema_decays``) and, if that group's params were at
  different steps, the decay of its most advanced ones (the largest step). With one param group
  whose params step together, that is simply the step's decay;
* other buffers (``num_batches_tracked``): a copy, taken after every such step.

A ``step()`` that makes no EMA update leaves the buffer EMA alone: one without grads, one that
``torch.amp.GradScaler`` skips (``found_inf``; decided on the device, without a host sync, when
``found_inf`` is not on the CPU), or one skipped for a non-finite grad norm (``max_grad_norm``).
The update runs in a step post-hook
(``torch.optim.Optimizer.register_step_post_hook``), after the post-hooks registered before it.

``swap_ema_weights()``, ``copy_ema_to(None | module)`` and ``ema_state_dict(module)`` then include
the buffers (matched by name; non-floating buffers get the copy) unless given
``ema_buffers=False``; ``store()`` / ``restore()`` of ``None`` or a module save and restore the
buffers that ``copy_ema_to`` of the same argument writes.

The buffer EMA is saved by ``state_dict()`` under the top-level key ``"ema_buffers"``
(``{buffer name: tensor}``), next to ``"state"`` and ``"param_groups"``, and restored bit for bit
by ``load_state_dict()``. Not in ``"state"``: torch's convention is that ``"state"`` is keyed by
param index, and tools built on it (``torch.distributed.checkpoint``, FSDP's optimizer state-dict
helpers) map those keys to params. Not in ``defaults``: ``state_dict()`` does not save them, and
``add_param_group`` copies every default into each new group. ``torch.optim`` optimizers ignore
the extra top-level key when they load the dict. Loading a state dict without the key (torch's,
or one saved before ``register_ema_buffers``) restarts the buffer EMA from the registered module's
current buffers. A buffer EMA loaded before ``register_ema_buffers(model)`` is kept by it (names
and shapes must match). The registered module itself is not in the state dict; pickling or
deep-copying the optimizer takes it along (a deep copy updates the copied module).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

Params = Union[None, torch.nn.Module, Iterable[torch.Tensor]]

# The state_dict() key of the buffer EMA (top level, next to "state" and "param_groups").
BUFFERS_KEY = "ema_buffers"


def _buffer_ema_post_hook(optimizer, args, kwargs) -> None:
    """The step post-hook :meth:`EmaAccessMixin.register_ema_buffers` installs."""
    optimizer._update_ema_buffers()


def _persistent_buffers(module: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for the persistent buffers of ``module``, as ``named_buffers()`` names them."""
    result, seen = [], set()
    for prefix, sub in module.named_modules():
        for key, buf in sub._buffers.items():
            if buf is None or key in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            result.append((f"{prefix}.{key}" if prefix else key, buf))
    return result


def _new_buffer_ema(buf: torch.Tensor) -> torch.Tensor:
    """The initial buffer EMA: fp32 (fp64 for fp64) for floating buffers, else an exact copy."""
    if buf.is_floating_point():
        return buf.detach().to(dtype=torch.promote_types(buf.dtype, torch.float32), copy=True)
    return buf.detach().clone()


class EmaBufferMixin:
    """The buffer EMA of an optimizer that keeps an EMA shadow (the base of
    :class:`~fused_optim.ema.EmaAccessMixin`, whose ``last_ema_decays`` and swap state it reads).
    """

    _ema_buffer_module: Optional[torch.nn.Module] = None
    _ema_buffer_avg: Optional[Dict[str, torch.Tensor]] = None  # name -> EMA (float) / copy

    # --- buffer EMA -------------------------------------------------------------------------------
    def register_ema_buffers(self, module: torch.nn.Module, *, reset: bool = False) -> None:
        """Keep an EMA of ``module``'s floating-point buffers and a copy of its other buffers.

        See "Buffer EMA" in the module docstring: updated after every step that makes an EMA
        update, with that step's param decay (of the first param group that made one); skipped
        steps (``GradScaler``) leave it alone; saved by ``state_dict()`` under ``"ema_buffers"``.

        Registering again (e.g. the same model after ``load_state_dict``) keeps the EMA of every
        buffer already kept under the same name and shape, and starts the others from the
        module's current values. A kept name the module lacks raises ``ValueError``, as does a
        shape mismatch; ``reset=True`` discards the kept buffer EMA and starts afresh.
        """
        name = type(self).__name__
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{name}.register_ema_buffers: expected a torch.nn.Module, "
                            f"got {type(module).__name__}")
        if not any(g.get("ema_decay") is not None for g in self.param_groups):
            raise ValueError(f"{name}.register_ema_buffers: no param group keeps an EMA "
                             f"(ema_decay is None everywhere), so no step would update the buffers")
        if self._ema_swapped:
            raise RuntimeError(f"{name}.register_ema_buffers() inside swap_ema_weights()")
        buffers = _persistent_buffers(module)
        kept = {} if reset or self._ema_buffer_avg is None else self._ema_buffer_avg
        missing = sorted(set(kept) - {n for n, _ in buffers})
        if missing:
            raise ValueError(
                f"{name}.register_ema_buffers: the optimizer keeps a buffer EMA for {missing} but "
                f"the module has no such persistent buffer; register the module it was kept for, "
                f"or pass reset=True to start the buffer EMA afresh")
        averages = {}
        for key, buf in buffers:
            old = kept.get(key)
            if old is None:
                averages[key] = _new_buffer_ema(buf)
                continue
            self._check_buffer_match(f"{name}.register_ema_buffers", key, buf, old)
            averages[key] = old if old.device == buf.device else old.to(device=buf.device)
        self._ema_buffer_module = module
        self._ema_buffer_avg = averages
        self._ensure_buffer_hook()

    def unregister_ema_buffers(self) -> None:
        """Drop the buffer EMA and the module registered by :meth:`register_ema_buffers`."""
        self._ema_buffer_module = None
        self._ema_buffer_avg = None
        self._ema_stored_buffers = None
        hooks = self._optimizer_step_post_hooks
        for key in [k for k, h in hooks.items() if h is _buffer_ema_post_hook]:
            del hooks[key]

    @property
    def ema_buffers(self) -> Dict[str, torch.Tensor]:
        """``{buffer name: EMA (floating buffers) or copy (others)}``, by reference; ``{}`` if none."""
        return dict(self._ema_buffer_avg or {})

    def _ensure_buffer_hook(self) -> None:
        if not any(h is _buffer_ema_post_hook for h in self._optimizer_step_post_hooks.values()):
            self.register_step_post_hook(_buffer_ema_post_hook)

    @staticmethod
    def _check_buffer_match(what: str, key: str, buf: torch.Tensor, kept: torch.Tensor) -> None:
        if buf.shape != kept.shape or buf.is_floating_point() != kept.is_floating_point():
            raise ValueError(
                f"{what}: buffer {key!r} is {buf.dtype} of shape {tuple(buf.shape)} but its kept "
                f"EMA is {kept.dtype} of shape {tuple(kept.shape)}")

    def _ema_buffer_decay(self) -> Optional[float]:
        """The decay of this step's buffer EMA update (see the module docstring); None: no update."""
        decays = self.last_ema_decays
        if not decays:
            return None
        group = min(g for g, _ in decays)
        step = max(t for g, t in decays if g == group)
        return decays[(group, step)]

    @torch.no_grad()
    def _update_ema_buffers(self) -> None:
        """The step post-hook: move the buffer EMA by this step's decay (nothing if none)."""
        averages, module = self._ema_buffer_avg, self._ema_buffer_module
        if not averages or module is None:
            return
        decay = self._ema_buffer_decay()
        if decay is None:
            return
        skip = None
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            if found_inf.device.type == "cpu":
                if bool((found_inf != 0).any()):
                    return
            else:  # decided on the device, without a host sync
                skip = (found_inf != 0).any()
        norm = getattr(self, "last_grad_norm", None)
        if getattr(self, "max_grad_norm", None) is not None and isinstance(norm, torch.Tensor):
            # a non-finite grad norm skips the step after its decays were taken; it joins the
            # skip where the norm lives (no sync: the step itself may have decided on the
            # device, and the buffers are small)
            bad = torch.isfinite(norm).all().logical_not()
            skip = bad if skip is None else skip.logical_or(bad.to(skip.device))
        self._lerp_ema_buffers(decay, skip)

    @torch.no_grad()
    def _lerp_ema_buffers(self, decay: float, skip: Optional[torch.Tensor] = None) -> None:
        """``ema = lerp(ema, buffer, 1 - decay)``, copies for the others; ``skip``: a bool tensor
        that, when true, leaves everything as it is (decided where ``skip`` lives, no sync)."""
        averages, module = self._ema_buffer_avg, self._ema_buffer_module
        targets = self._buffer_targets(f"{type(self).__name__}.step (buffer EMA)", module)
        lerp: Dict[Tuple[torch.device, torch.dtype], Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
        for key, buf in targets:
            avg = averages[key]
            if avg.device != buf.device:  # the module was moved: the EMA follows it
                avg = averages[key] = avg.to(device=buf.device)
            if not avg.is_floating_point():
                avg.copy_(buf if skip is None
                          else torch.where(skip.to(avg.device), avg, buf.to(avg.dtype)))
                continue
            src = buf.detach()
            if src.dtype != avg.dtype:
                src = src.to(avg.dtype)
            avgs, srcs = lerp.setdefault((avg.device, avg.dtype), ([], []))
            avgs.append(avg)
            srcs.append(src)
        weight = 1.0 - decay
        for avgs, srcs in lerp.values():
            if skip is None:
                torch._foreach_lerp_(avgs, srcs, weight)
                continue
            new = [a.clone() for a in avgs]
            torch._foreach_lerp_(new, srcs, weight)
            for avg, value in zip(avgs, new):
                avg.copy_(torch.where(skip.to(avg.device), avg, value))

    def _buffer_targets(self, what: str, module: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
        """``(name, buffer of module)`` for every kept buffer EMA, checked (raises before any write)."""
        result = []
        for key, avg in (self._ema_buffer_avg or {}).items():
            try:
                buf = module.get_buffer(key)
            except AttributeError:
                buf = None
            if buf is None:
                raise ValueError(f"{what}: the module has no buffer {key!r}, which the optimizer "
                                 f"keeps a buffer EMA for (register_ema_buffers)")
            self._check_buffer_match(what, key, buf, avg)
            result.append((key, buf))
        return result

    def _buffer_module_for(self, what: str, target: Params, ema_buffers: Optional[bool]
                           ) -> Optional[torch.nn.Module]:
        """The module whose buffers an EMA call on ``target`` includes (None: no buffers)."""
        if ema_buffers is False:
            return None
        registered = self._ema_buffer_avg is not None and (
            target is not None or self._ema_buffer_module is not None)
        if not registered:
            if ema_buffers:
                raise ValueError(f"{what}: ema_buffers=True but no buffer EMA is kept for this "
                                 f"target; call register_ema_buffers(module) first")
            return None
        if target is None:
            return self._ema_buffer_module
        if isinstance(target, torch.nn.Module):
            return target
        if ema_buffers:
            raise TypeError(f"{what}: ema_buffers=True needs a module (buffers are matched by "
                            f"name), got {type(target).__name__}")
        return None

    # --- state dict (the buffer EMA) ------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state dict, plus the buffer EMA under ``"ema_buffers"`` when one is kept.

        Buffer EMA tensors are returned by reference, as torch returns state.
        """
        state_dict = super().state_dict()
        if self._ema_buffer_avg is not None:
            state_dict[BUFFERS_KEY] = dict(self._ema_buffer_avg)
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict; its ``"ema_buffers"`` (if any) becomes the buffer EMA, bit for bit.

        Without that key (torch's state dicts, or saved without a buffer EMA) the buffer EMA of a
        registered module restarts from its current buffers. With a registered module the saved
        names and shapes must match its buffers; a mismatch raises before anything is loaded.
        """
        name = type(self).__name__
        saved = state_dict.get(BUFFERS_KEY) if isinstance(state_dict, Mapping) else None
        module = self._ema_buffer_module
        if saved is not None:
            if not isinstance(saved, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in saved.items()):
                raise TypeError(f"{name}.load_state_dict: {BUFFERS_KEY!r} must map buffer names "
                                f"to tensors")
            if module is not None:
                buffers = dict(_persistent_buffers(module))
                if set(buffers) != set(saved):
                    raise ValueError(
                        f"{name}.load_state_dict: the saved buffer EMA has buffers "
                        f"{sorted(saved)} but the registered module has {sorted(buffers)}")
                for key, value in saved.items():
                    self._check_buffer_match(f"{name}.load_state_dict", key, buffers[key], value)
        super().load_state_dict(state_dict)
        if saved is not None:
            devices = dict(_persistent_buffers(module)) if module is not None else {}
            self._ema_buffer_avg = {
                key: value.detach().to(device=devices[key].device if key in devices else value.device,
                                       copy=True)
                for key, value in saved.items()}
        elif module is not None:
            self._ema_buffer_avg = {key: _new_buffer_ema(buf) for key, buf in _persistent_buffers(module)}
        else:
            self._ema_buffer_avg = None

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        if self._ema_buffer_avg is not None:
            state["_ema_buffer_avg"] = self._ema_buffer_avg
            state["_ema_buffer_module"] = self._ema_buffer_module
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        if self._ema_buffer_module is not None:  # hooks are not pickled: install it again
            self._ensure_buffer_hook()
