"""Hyperparameters, byte models and default run lengths shared by every part of the benchmark.

The byte model is what the fused AdamW + EMA update must move per element, whoever runs it; it
turns each peer's median step time into an effective bandwidth comparable with the ceiling.
"""
from __future__ import annotations

LR = 1e-4  # small, so values stay finite over any number of steps
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
EMA_DECAY = 0.999

BYTES_PER_ELEMENT = 36
BYTE_MODELS = {
    "fp32": "36 B/element: grad 4r + param 4r4w + exp_avg 4r4w + exp_avg_sq 4r4w + ema 4r4w",
    "bf16+fp32 master": ("36 B/element: bf16 grad 2r + bf16 param 2w + fp32 master 4r4w "
                         "+ exp_avg 4r4w + exp_avg_sq 4r4w + ema 4r4w"),
}

MIN_ROUNDS = 3
DEFAULT_ROUNDS = {"W1": 12, "W2": 80, "W3": 10, "S": 150, "S3": 150}
DEFAULT_WARMUP = {"W1": 1, "W2": 3, "W3": 1, "S": 5, "S3": 5}
# Seconds of timed rounds per workload, per thread count and timing mode; the loop stops once
# over budget (after MIN_ROUNDS), so the default run stays near 5 minutes on 2 cores.
DEFAULT_BUDGET_S = {"W1": 12.0, "W2": 8.0, "W3": 12.0, "S": 3.0, "S3": 3.0}
# Back-to-back steps per peer per round in the "burst" timing mode, timed as one block by
# Timer.timeit(N) after its two warm-up steps (the same count for every peer, so every peer ends
# after the same steps); workloads listed here run it by default (their targets or their cache
# behaviour call for it), the others only with --burst.
DEFAULT_BURST = {"W2": 5, "S": 10, "S3": 10}
# min_run_time of the blocked_autorange of each in-place streaming op for the ceiling's fastest
# block, before and after the rounds.
CEILING_MIN_RUN_S = {"W1": 0.2, "W3": 0.2, "W2": 0.05, "S": 0.02, "S3": 0.02}
QUICK = {"rounds": 3, "warmup": 1, "ceiling_s": 0.0, "burst": 3, "incache_steps": 50}

INCACHE_STEPS = 2000
INCACHE_FALLBACK_NUMEL = 65536
INCACHE_BYTES_PER_ELEMENT = 20  # ours keeps param, grad, exp_avg, exp_avg_sq, ema in cache
