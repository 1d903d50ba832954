"""EMA access for optimizers that keep an EMA shadow ``state[p]["ema"]`` of each param.

The EMA of a param that has not stepped yet is the param itself.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch


class EmaAccessMixin:
    """Swap, copy and export the EMA weights of a :class:`FusedOptimizerBase` subclass."""

    _ema_swapped = False

    def _ema_pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``[(param, ema)]`` for every param that has an EMA, in param-group order."""
        pairs = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and state.get("ema") is not None:
                    pairs.append((p, state["ema"]))
        return pairs

    def _check_not_swapped(self) -> None:
        if self._ema_swapped:
            raise RuntimeError(
                f"{type(self).__name__}.step() called inside swap_ema_weights(): the params hold "
                f"the EMA weights there; step after the block ends")

    @contextlib.contextmanager
    def swap_ema_weights(self, enabled: bool = True) -> Iterator[None]:
        """Within the block the params hold their EMA weights (rounded to the param dtype).

        On exit, also on an exception, every param gets back exactly the value it had. Masters,
        moments and the EMA itself are untouched. ``enabled=False`` makes it a no-op, for
        ``with opt.swap_ema_weights(enabled=use_ema):``.
        """
        if not enabled:
            yield
            return
        if self._ema_swapped:
            raise RuntimeError("swap_ema_weights() is already active")
        pairs = self._ema_pairs()
        with torch.no_grad():
            backup = [p.detach().clone() for p, _ in pairs]
            self._ema_swapped = True
            try:
                for p, ema in pairs:
                    p.copy_(ema)
                yield
            finally:
                for (p, _), saved in zip(pairs, backup):
                    p.copy_(saved)
                self._ema_swapped = False

    def _ema_of(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state.get(p)
        ema = state.get("ema") if state else None
        return p if ema is None else ema

    @torch.no_grad()
    def copy_ema_to(self, params: Union[None, torch.nn.Module, Iterable[torch.Tensor]] = None) -> None:
        """Copy the EMA weights into ``params`` (a module, or tensors in the optimizer's param order).

        ``None`` copies them into the optimizer's own params (which then stay EMA weights).
        """
        own = [p for group in self.param_groups for p in group["params"]]
        if params is None:
            targets = own
        else:
            targets = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
            if len(targets) != len(own):
                raise ValueError(
                    f"copy_ema_to: got {len(targets)} tensors but the optimizer has {len(own)} params")
        for i, (target, p) in enumerate(zip(targets, own)):
            if target.shape != p.shape:
                raise ValueError(
                    f"copy_ema_to: target[{i}] has shape {tuple(target.shape)} but param {i} has "
                    f"shape {tuple(p.shape)}")
        for target, p in zip(targets, own):
            ema = self._ema_of(p)
            if target is not ema:
                target.copy_(ema)

    @torch.no_grad()
    def ema_state_dict(self, module: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
        """``module.state_dict()`` with every optimized param replaced by a copy of its EMA.

        Values are in the param's dtype unless ``dtype`` is given (e.g. ``torch.float32`` to export
        the unrounded fp32 EMA of a bf16 model). Buffers and params this optimizer does not hold
        are copied as they are.
        """
        emas = {id(p): ema for p, ema in self._ema_pairs()}
        params = dict(module.named_parameters(remove_duplicate=False))
        result = OrderedDict()
        for name, value in module.state_dict(keep_vars=True).items():
            source = value
            if name in params and id(params[name]) in emas:
                source = emas[id(params[name])]
            target_dtype = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
            result[name] = source.detach().to(dtype=target_dtype, copy=True)
        return result
