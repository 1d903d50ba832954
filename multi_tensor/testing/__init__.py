"""Test-only models of devices this machine lacks: the Ascend NPU's CPU stand-in
(:mod:`.npu_standin`) and the simulated 910B that counts launches, bytes and host reads
(:mod:`.npu_model`). Nothing in the package imports them; the wheel leaves them out (setup.py)."""
