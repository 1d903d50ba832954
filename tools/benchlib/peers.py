"""The implementations compared. Each peer owns its params and optimizer state; grads are the
workload's shared read-only set.

fp32 workloads (W1, W2, S)
  ours           fused_optim.FusedEmaAdamW: AdamW and the EMA in one pass over the tensors
  fused_ema      torch.optim.AdamW(fused=True), then torch._foreach_lerp_(emas, params, 1 - decay)
  foreach_ema    torch.optim.AdamW(foreach=True), then the same lerp
  npu_loop       a Python loop over fused_optim.npu_apply_fused_ema_adamw, one call per tensor
                 (how MindSpeed's optimizer runs; step is an int64 tensor of shape (1,))
  deepspeed_ema  deepspeed.ops.adam.DeepSpeedCPUAdam (its AVX C++ kernel), then the same lerp;
                 only when ``import deepspeed`` works and its CPU op builds
bf16 params + fp32 masters (W3, S3): ours is FusedEmaAdamW(master_weights=True) on the bf16
params, ours_remainder the same masters held as int16 remainders (master_weights="remainder":
34 B/element moved instead of 36, 14 B/param of optimizer state instead of 16); the others
are the composed mixed-precision recipe: _foreach_copy_ the bf16 grads into
fp32 master grads, the optimizer above on the masters, lerp the EMA from the masters,
_foreach_copy_ the masters back into the bf16 params.
  mp_fused_ema, mp_foreach_ema, mp_npu_loop, mp_deepspeed_ema

DeepSpeed is optional and never a dependency. It is imported with DS_ACCELERATOR=cpu; its CPU
Adam op is compiled with ninja on first use (about a minute, cached afterwards).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

import fused_optim

from .config import BETAS, EMA_DECAY, EPS, LR, WEIGHT_DECAY
from .workloads import MIXED_PRECISION, Workload

DESCRIPTIONS = {
    "ours": "fused_optim.FusedEmaAdamW",
    "ours_remainder": "fused_optim.FusedEmaAdamW(master_weights='remainder')",
    "fused_ema": "torch AdamW(fused=True) + _foreach_lerp_ EMA",
    "foreach_ema": "torch AdamW(foreach=True) + _foreach_lerp_ EMA",
    "npu_loop": "per-tensor loop over npu_apply_fused_ema_adamw",
    "deepspeed_ema": "DeepSpeedCPUAdam + _foreach_lerp_ EMA",
    "mp_fused_ema": "copy grads->fp32, AdamW(fused=True) on masters, lerp EMA, copy ->bf16",
    "mp_foreach_ema": "copy grads->fp32, AdamW(foreach=True) on masters, lerp EMA, copy ->bf16",
    "mp_npu_loop": "copy grads->fp32, npu_apply_fused_ema_adamw loop on masters, copy ->bf16",
    "mp_deepspeed_ema": "copy grads->fp32, DeepSpeedCPUAdam on masters, lerp EMA, copy ->bf16",
}
FP32_PEERS = ["ours", "fused_ema", "foreach_ema", "npu_loop", "deepspeed_ema"]
MIXED_PEERS = ["ours", "ours_remainder", "mp_fused_ema", "mp_foreach_ema", "mp_npu_loop", "mp_deepspeed_ema"]
DEEPSPEED_PEERS = {"deepspeed_ema", "mp_deepspeed_ema"}


def peers_for(workload: str) -> List[str]:
    return list(MIXED_PEERS if workload in MIXED_PRECISION else FP32_PEERS)


_DEEPSPEED: Optional[Tuple[Optional[type], str]] = None


def deepspeed_adam() -> Tuple[Optional[type], str]:
    """``(DeepSpeedCPUAdam, version)`` when DeepSpeed imports and its CPU op loads, else
    ``(None, why)``. Imported once, on first call."""
    global _DEEPSPEED
    if _DEEPSPEED is None:
        os.environ["DS_ACCELERATOR"] = "cpu"
        try:
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            probe = torch.zeros(8)
            probe.grad = torch.zeros(8)
            DeepSpeedCPUAdam([probe], lr=LR).step()
            _DEEPSPEED = (DeepSpeedCPUAdam, f"deepspeed {deepspeed.__version__}")
        except BaseException as exc:  # an ImportError, a failed ninja build, a SystemExit ...
            if isinstance(exc, KeyboardInterrupt):
                raise
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            _DEEPSPEED = (None, f"{type(exc).__name__}: {first_line}")
    return _DEEPSPEED


class Peer:
    name = ""

    def step(self) -> None:
        raise NotImplementedError

    def model_params(self) -> List[torch.Tensor]:
        raise NotImplementedError

    def emas(self) -> List[torch.Tensor]:
        raise NotImplementedError


class Ours(Peer):
    name = "ours"

    master_weights = True

    def __init__(self, wl: Workload):
        self.params = wl.new_params()
        for p, g in zip(self.params, wl.grads):
            p.grad = g
        self.opt = fused_optim.FusedEmaAdamW(
            self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
            ema_decay=EMA_DECAY, master_weights=self.master_weights)

    def step(self) -> None:
        self.opt.step()

    def model_params(self):
        return self.params

    def emas(self):
        return [self.opt.state[p]["ema"] for p in self.params]


class OursRemainder(Ours):
    """FusedEmaAdamW with the fp32 masters held as int16 remainders (bf16 workloads)."""

    name = "ours_remainder"
    master_weights = "remainder"


def _npu_loop(grads, weights, ms, vs, ss, step_tensor) -> None:
    for g, w, m, v, s in zip(grads, weights, ms, vs, ss):
        fused_optim.npu_apply_fused_ema_adamw(
            g, w, m, v, s, step_tensor, LR, EMA_DECAY, BETAS[0], BETAS[1], EPS, 1, True,
            WEIGHT_DECAY)
    step_tensor.add_(1)


class _Inner:
    """An AdamW variant over fp32 tensors whose ``.grad`` is set; the EMA is applied by the caller."""

    def __init__(self, impl: str, params: List[torch.Tensor], grads: List[torch.Tensor]):
        self.impl = impl
        self.params = params
        self.grads = grads
        self.opt = None
        if impl == "npu_loop":
            self.m = [torch.zeros_like(p) for p in params]
            self.v = [torch.zeros_like(p) for p in params]
            self.step_tensor = torch.ones(1, dtype=torch.int64)
            return
        for p, g in zip(params, grads):
            p.grad = g
        if impl == "deepspeed":
            adam, why = deepspeed_adam()
            if adam is None:
                raise RuntimeError(f"DeepSpeed is unavailable: {why}")
            self.opt = adam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            adamw_mode=True, bias_correction=True)
        else:
            self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS,
                                         weight_decay=WEIGHT_DECAY, **{impl: True})

    def step_with_ema(self, emas: List[torch.Tensor]) -> None:
        if self.opt is None:
            _npu_loop(self.grads, self.params, self.m, self.v, emas, self.step_tensor)
        else:
            self.opt.step()
            torch._foreach_lerp_(emas, self.params, 1.0 - EMA_DECAY)


class ComposedFp32(Peer):
    """An fp32 AdamW (fused, foreach, per-tensor loop or DeepSpeed) followed by the EMA."""

    def __init__(self, wl: Workload, name: str, impl: str):
        self.name = name
        self.params = wl.new_params()
        self._emas = [p.detach().clone() for p in self.params]
        self.inner = _Inner(impl, self.params, wl.grads)

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step_with_ema(self._emas)

    def model_params(self):
        return self.params

    def emas(self):
        return self._emas


class MixedPrecisionRecipe(Peer):
    """bf16 grads -> fp32 master grads, fp32 AdamW + EMA on the masters, masters -> bf16 params."""

    def __init__(self, wl: Workload, name: str, impl: str):
        self.name = name
        self.params = wl.new_params()
        self.grads = wl.grads
        self.masters = [p.float() for p in self.params]
        self.master_grads = [torch.empty_like(m) for m in self.masters]
        self._emas = [m.clone() for m in self.masters]
        self.inner = _Inner(impl, self.masters, self.master_grads)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_(self.master_grads, self.grads)
        self.inner.step_with_ema(self._emas)
        torch._foreach_copy_(self.params, self.masters)

    def model_params(self):
        return self.params

    def emas(self):
        return self._emas


_IMPLS = {"fused_ema": "fused", "foreach_ema": "foreach", "npu_loop": "npu_loop",
          "deepspeed_ema": "deepspeed"}


def make_peer(name: str, wl: Workload) -> Peer:
    if name == "ours":
        return Ours(wl)
    if name == "ours_remainder" and wl.mixed_precision:
        return OursRemainder(wl)
    if name in _IMPLS and not wl.mixed_precision:
        return ComposedFp32(wl, name, _IMPLS[name])
    if name.startswith("mp_") and name[3:] in _IMPLS and wl.mixed_precision:
        return MixedPrecisionRecipe(wl, name, _IMPLS[name[3:]])
    raise ValueError(f"peer {name!r} does not apply to workload {wl.name}")


@torch.no_grad()
def max_abs_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        worst = max(worst, float((x.float() - y.float()).abs().max()))
    return worst
