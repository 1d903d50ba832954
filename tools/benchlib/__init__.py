"""The parts of ``tools/bench.py``, one concern per module.

config      hyperparameters, byte models and default run lengths
targets     the issue's numeric targets as data, and how a result is scored against them
workloads   tensor shapes and the shared read-only grads of each workload
peers       the implementations compared: ours and the ways PyTorch, MindSpeed, DeepSpeed do it
measure     interleaved and back-to-back step timing (torch.utils.benchmark Timers and
            Measurements), the in-place streaming ceiling, the in-cache compute figure
memory      peak extra memory of one step
machine     machine description and load warnings
report      Compare tables of the step times, the derived figures (ratios, GB/s, % of the
            ceiling, targets) and the JSON document

Only ``peers`` and ``machine`` import the package under test, so the shapes and targets can be
inspected without a built engine.
"""
