"""The parts of ``tools/npu_check.py``, one concern per module.

common      the report, the device setup and environment, the workloads and state comparisons
tolerances  the cann paths' error bounds (``cann_bounds``) and their derivation on the stand-in
checks      checks 1-4 and 6-13
bench       check 5, the step time against MindSpeed's per-tensor loop and torch's recipe
"""
