"""State dicts (exact dtypes, torch's formats) and DCP's state initialisation.

``init_state()`` creates the state without stepping. ``torch.distributed.checkpoint``'s
``get/set_optimizer_state_dict`` initialise an optimizer without state by calling ``step()``
with every lr 0 and zero grads; a first ``step()`` that sees exactly that (no state, every lr
zero, every param that requires grad has a grad, all of them zero over all shards) runs
``init_state()`` instead of an update, so no step is counted and no EMA moves. Only a first
step can be such a call, so later steps pay nothing for the check.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from multi_tensor.bucketing import local_shard, shard_layout


def _is_zero(lr) -> bool:
    return bool(lr == 0) if isinstance(lr, torch.Tensor) else lr == 0


def _all_zero(grads: List[torch.Tensor]) -> bool:
    """Whether every element of every grad is zero, over all shards of sharded grads: ranks
    decide together (one all-reduce per device mesh), so no rank takes a step the others skip."""
    nonzero = bool(torch.stack([local_shard(g).ne(0).any().to(grads[0].device)
                                for g in grads]).any())  # one host read
    meshes = []
    for g in grads:
        layout = shard_layout(g)
        if layout is not None and all(m is not layout[0] for m in meshes):
            meshes.append(layout[0])
    if not meshes:
        return not nonzero
    import torch.distributed as dist

    flag = torch.tensor([int(nonzero)], dtype=torch.int32, device=grads[0].device)
    for mesh in meshes:
        for dim in range(mesh.ndim):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return not bool(flag.item())


class CheckpointMixin:
    """State dict and state initialisation of :class:`fused_optim.base.FusedOptimizerBase`."""

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every param that requires grad, without stepping.

        ``step`` is 0, moments are zero, the EMA (and fp32 master) equals the param: exactly the
        state a first ``step()`` starts from, so a step after it continues as if it had not
        run. Entries that exist are kept. Sharded params get sharded state (``zeros_like`` /
        ``clone`` of a DTensor are DTensors sharded alike).
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, group, self.state[p])

    def _is_state_init_call(self) -> bool:
        """Whether this first ``step()`` is a state-initialisation call, as
        ``torch.distributed.checkpoint.state_dict`` makes one (``_init_optim_state``: on an
        optimizer without state, every lr set to 0 and every param that requires grad given a
        zero grad) rather than an update. Asked only while ``state`` is empty. A first step with
        lr 0 and real grads (a linear warm-up from 0) is an update: it counts."""
        if any(not _is_zero(group.get("lr", 0.0)) for group in self.param_groups):
            return False
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad)
                elif p.requires_grad:
                    return False
        return bool(grads) and _all_zero(grads)

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``, with a step tensor of its own for every param.

        Params that step together share one step tensor here; a saved dict must not carry that
        sharing (a ``torch.optim`` optimizer loading it would advance the shared tensor once per
        param), so each param's entry gets its own copy of ``step``. Everything else is returned
        by reference, as torch does. Options kept on the instance (``max_grad_norm``,
        ``fused_unscale``, ...) are not in it: they stay those of the optimizer that loads it.
        """
        state_dict = super().state_dict()
        # entries that are not a param's (a state_dict pre-hook may add any) pass through, as torch's
        state_dict["state"] = {
            pid: ({**entry, "step": entry["step"].clone()}
                  if isinstance(entry, dict) and isinstance(entry.get("step"), torch.Tensor)
                  else entry)
            for pid, entry in state_dict["state"].items()
        }
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load state, keeping every saved state tensor's dtype.

        ``torch.optim.Optimizer`` casts state to the param's dtype; fp32 masters, moments and EMA
        of fp16/bf16 params must stay fp32 and master remainders int16, so they are restored from the saved copy
        (moved to the param's device) after the base class has loaded everything else.

        A ``torch.optim`` Adam/AdamW/RAdam state dict loads too (see :mod:`fused_optim.compat`):
        moments and steps are taken over, masters and EMA start from the params. Group options a
        saved dict lacks keep their current values.

        ``master_weights`` keeps the loading optimizer's value: it is how the state is stored, not
        part of the training state. Saved fp32 masters load into a ``"remainder"`` group and
        saved remainders into a ``True`` group (converted exactly when the group is next planned;
        the params must then hold the saved params).
        """
        from . import compat

        state_dict, from_torch = compat.adapt_state_dict(self, state_dict)
        saved_groups = state_dict.get("param_groups")
        if isinstance(saved_groups, list) and len(saved_groups) == len(self.param_groups):
            state_dict = dict(state_dict)
            state_dict["param_groups"] = [
                {**g, "master_weights": live["master_weights"]}
                if isinstance(g, dict) and "master_weights" in live else g
                for g, live in zip(saved_groups, self.param_groups)]
        saved_state = state_dict["state"]
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in saved_state.get(pid, {}).items():
                if isinstance(value, torch.Tensor) and key != "step" and (
                        value.is_floating_point() or key == "param_remainder"):
                    self.state[p][key] = value.to(device=p.device, copy=True)
                elif key == "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to(device="cpu", dtype=torch.float32, copy=True)
        if from_torch:
            compat.complete_loaded_state(self)
        self._plans.clear()

    def torch_state_dict(self, torch_cls=None) -> Dict[str, Any]:
        """A state dict the matching ``torch.optim`` optimizer (AdamW/Adam/RAdam) loads and continues.

        See :func:`fused_optim.compat.torch_state_dict` (EMA and masters are not part of it).
        """
        from . import compat

        return compat.torch_state_dict(self, torch_cls)
