"""What many test files make alike: seeded random params (and their grads)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def make_params(shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                seed: int = 0) -> List[torch.nn.Parameter]:
    """One ``nn.Parameter`` per shape: standard normal values drawn in fp32 from ``seed``, in
    order, then rounded to ``dtype`` (so the same seed gives the same values at every dtype)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def random_grads(params: Sequence[torch.Tensor], seed: int, dtype: Optional[torch.dtype] = None,
                 scale: float = 1.0) -> List[torch.Tensor]:
    """A grad per param (its shape), standard normal times ``scale`` drawn in fp32 from
    ``seed``, rounded to ``dtype`` (default: the param's)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * scale).to(dtype or p.dtype) for p in params]
