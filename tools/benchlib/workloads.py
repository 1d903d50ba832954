"""Workloads: tensor shapes, dtypes and one read-only grad set shared by every peer.

  W1  GPT-2-small shapes, fp32 params (148 tensors, 124,439,808 elements)
  W2  3000 small fp32 tensors, 64..1024 elements each from a seeded RNG (about 1.6M elements)
  W3  GPT-2-small shapes, bf16 params with fp32 master weights
  S   a small model: 6 tensors of 50,000 elements, fp32 params
  S3  the same shapes, bf16 params with fp32 master weights

Every peer builds its own params (same seed, so the same values) and state; the grads are one
set per workload, read by all peers and never written, so every peer sees the same inputs.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from . import config

Shape = Tuple[int, ...]
NAMES = ("W1", "W2", "W3", "S", "S3")
MIXED_PRECISION = ("W3", "S3")


def gpt2_small_shapes() -> List[Shape]:
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: List[Shape] = [(vocab, d), (ctx, d)]  # wte, wpe
    for _ in range(layers):
        shapes += [
            (d,), (d,),                  # ln_1 weight, bias
            (d, 3 * d), (3 * d,),        # attn.c_attn weight, bias
            (d, d), (d,),                # attn.c_proj weight, bias
            (d,), (d,),                  # ln_2 weight, bias
            (d, 4 * d), (4 * d,),        # mlp.c_fc weight, bias
            (4 * d, d), (d,),            # mlp.c_proj weight, bias
        ]
    shapes += [(d,), (d,)]  # ln_f weight, bias
    assert len(shapes) == 148, len(shapes)
    return shapes


def small_tensor_shapes(count: int, seed: int = 1234) -> List[Shape]:
    """``count`` tensors of 64..1024 elements (uniform, seeded); about 7% are 2-D, the rest 1-D."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(64, 1025, (count,), generator=gen).tolist()
    kinds = torch.randint(0, 3, (count,), generator=gen).tolist()
    shapes: List[Shape] = []
    for n, kind in zip(sizes, kinds):
        if kind == 0 and n % 8 == 0:
            shapes.append((n // 8, 8))
        elif kind == 0 and n % 4 == 0:
            shapes.append((4, n // 4))
        else:
            shapes.append((n,))
    return shapes


def small_model_shapes() -> List[Shape]:
    """Six tensors of 50,000 elements: four weight matrices and two flat vectors."""
    shapes: List[Shape] = [(250, 200), (200, 250), (500, 100), (100, 500), (50_000,), (50_000,)]
    assert all(math.prod(s) == 50_000 for s in shapes)
    return shapes


class Workload:
    def __init__(self, name: str, description: str, shapes: List[Shape], param_dtype: torch.dtype):
        self.name = name
        self.description = description
        self.shapes = shapes
        self.param_dtype = param_dtype
        self.numel = sum(math.prod(s) for s in shapes)
        self.mixed_precision = name in MIXED_PRECISION
        self.byte_model_key = "bf16+fp32 master" if self.mixed_precision else "fp32"
        self.bytes_per_step = config.BYTES_PER_ELEMENT * self.numel
        gen = torch.Generator().manual_seed(4321)
        self.grads = [torch.empty(s, dtype=torch.float32).normal_(0.0, 1e-3, generator=gen)
                      .to(param_dtype) for s in shapes]

    def new_params(self) -> List[torch.Tensor]:
        """A fresh param set in the param dtype; every call gives the same values."""
        return [p.to(self.param_dtype) for p in self.new_fp32_params()]

    def new_fp32_params(self) -> List[torch.Tensor]:
        gen = torch.Generator().manual_seed(1234)
        return [torch.empty(s, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                for s in self.shapes]

    def fp32_grads(self) -> List[torch.Tensor]:
        """The grads as fp32 tensors: the grads themselves for fp32 workloads, else fp32 copies."""
        return self.grads if not self.mixed_precision else [g.float() for g in self.grads]


def make_workload(name: str, w2_tensors: int = 3000) -> Workload:
    if name == "W1":
        return Workload("W1", "GPT-2-small shapes, fp32", gpt2_small_shapes(), torch.float32)
    if name == "W2":
        return Workload("W2", f"{w2_tensors} small fp32 tensors (64..1024 elements, seeded)",
                        small_tensor_shapes(w2_tensors), torch.float32)
    if name == "W3":
        return Workload("W3", "GPT-2-small shapes, bf16 params + fp32 masters",
                        gpt2_small_shapes(), torch.bfloat16)
    if name == "S":
        return Workload("S", "small model, 6 x 50,000 elements, fp32", small_model_shapes(),
                        torch.float32)
    if name == "S3":
        return Workload("S3", "small model, 6 x 50,000 elements, bf16 params + fp32 masters",
                        small_model_shapes(), torch.bfloat16)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")
