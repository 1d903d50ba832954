"""The rows of ``tools/gpu_check.py`` that are more than a few lines, one module each.

timing  one timer for every row (CUDA events beside the wall clock; the wall clock on a CPU)
train   the GPT-2-small train step, ours against torch's recipe, fp32 and bf16 + masters
cold    the cold first step, in a fresh process with an empty Triton cache
ncu     a per-kernel Nsight Compute summary (achieved DRAM GB/s) of our W1 and W3 steps
The FSDP2 + DCP row runs tools/fsdp_example.py (``--device cuda``, one rank, NCCL).
"""
