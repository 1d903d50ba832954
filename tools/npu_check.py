#!/usr/bin/env python3
"""Check the Ascend NPU backend on an Ascend machine: parity with the reference, and step time.

Run it on a machine with an Atlas A2/A3 (or Ascend 950) NPU, CANN and torch_npu (and, if you
use it, MindSpeed)::

    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    python tools/npu_check.py                       # parity + benchmark on npu:0 (a few minutes)
    python tools/npu_check.py --skip-bench --json npu_check.json
    python tools/npu_check.py --stand-in            # the same script on CPU, CANN emulated
    python tools/npu_check.py --derive-tolerances   # re-measure the cann rounding allowances

Exit status 0 when every check passes, 1 when one fails (each line says which and by how much).

What it checks (the reference backend runs on the CPU, on copies of the same tensors):

1. ``torch`` path (the default, ``MULTI_TENSOR_NPU_OP=torch``) against the reference over
   ``--parity-steps`` steps: **bitwise**. This is the package's contract; the path uses no fp64
   and builds sqrt and division correctly rounded from fp32 ops, so on the NPU it holds if the
   device's fp32 add, subtract, multiply and compare are IEEE.
   A mismatch is reported as FAIL with the largest distance in ulps.
2. ``cann`` and ``cann_literal`` paths, one step from the reference's state (after 0 and 5
   warm-up steps), element by element, within :func:`cann_bounds` (the error bound of each sum,
   with the kernel's complement gap and rounding allowances derived on the stand-in: the comment
   above ``ROUNDING``; ``--derive-tolerances`` re-measures them, also on hardware), and exactly
   one operator launch per step. bf16 params (masters run in fp32): within 1 bf16 ulp.
3. ``cann`` over ``--parity-steps`` steps: the largest deviation of the params (the fp32
   masters for bf16) relative to how far they moved (information: a few roundings per step, accumulated).
4. EMA of a constant. ``cann``: ``s = var = c`` stays exactly ``c`` (PASS/FAIL).
   ``cann_literal`` (the operator's own EMA ``d*s + (1-d)*var``): its effective coefficients,
   read off one launch (``s = [0, 1]``, ``var = [1, 0]``, ``lr = 0``), and where the EMA of a
   constant goes over ``--ema-steps`` launches from ``s = c`` and from ``s = 0.99 c`` for
   d in 0.99 .. 0.99999 (information; with the kernel's ``1 - fp32(d)`` the coefficients sum to
   exactly 1, so a constant is a fixed point up to one rounding).
6. fp64 foreach on the device: ``torch._foreach_sqrt`` on fp64 tensors works or raises
   (``aclnnForeachSqrt``: error 161002) (information).
7. fp32 ``sqrt`` and ``/`` on the device against an IEEE oracle (fp64 of fp32 operands rounded
   once, which is correctly rounded), over ``--rounding-samples`` random bit patterns plus near
   ties, 1 +- k ulp, powers of two and extremes; with ``--sqrt-exhaustive`` sqrt also on every
   positive finite fp32 (information, and the verdict on ``MULTI_TENSOR_NPU_IEEE_SQRT_DIV=1``:
   the ``torch`` path may take the device's own sqrt and division, a tenth of its launches and
   bytes, only where both are correctly rounded).
8. The built-in binding builds, links and runs its probe launch (hardware only).
9. The operator's complements, read off one launch (``grad = 1``, ``m = v = s = 0``, ``lr = 0``):
   ``1 - fp32(beta)`` as the kernel's source says, or ``fp32(1 - beta)`` (PASS if either, named).
10. The cost of a dtype-converting copy: bf16 -> fp32 ``copy_`` against fp32 -> fp32 (information).
11. One operator launch over more than 2^31 elements (skipped without 41 GiB free on the device):
    elements on both sides of 2^31 get the same update.
12. The clipped step's one-read grad norm (``npu_ops.quick_norm``): the same bits on a repeat
    run, within ``quick_bound`` of the fp64 norm, inf on overflow, NaN on a NaN.
13. ``capturable=True`` (the step counter on the device, the operator's own bias correction,
    nothing read on the host), fp32 and bf16 + masters, under a GradScaler-style ``found_inf``:
    a cancelled step (an inf grad, ``found_inf`` set) changes no bit of params, state or step
    (PASS/FAIL), and the updates stay within a few roundings per step of the plain ``cann`` path
    (the operator's ``1 - Power(beta, step)`` against the folded scalars; information).

Every check prints one ``[PASS]``/``[FAIL]``/``[info]`` line and a field of the ``--json`` file;
``--stand-in`` runs all that can run on CPU (8 and 11 report themselves skipped).

Benchmark (median ms per optimizer step, ``--steps`` steps after ``--warmup``, grads fixed): ours
(``torch``, ``cann``, ``cann_literal``), MindSpeed's per-tensor ``npu_apply_fused_ema_adamw``
loop (the way MindSpeed's FusedEmaAdamW steps; over this package's binding when MindSpeed is
absent), and torch's fused AdamW (``torch_npu``'s ``_fused_adamw_``) + ``torch._foreach_lerp_``
for the EMA. Also the effective bandwidth: 36 bytes per element (fp32) moved by a fused
AdamW + EMA update, over the step time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.dirname(os.path.abspath(__file__))
for _path in (ROOT, TOOLS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from fused_optim import FusedEmaAdamW  # noqa: E402
from multi_tensor.testing import npu_standin  # noqa: E402
from npucheck.checks import (  # noqa: E402
    check_binding_builds, check_cann_drift, check_cann_step, check_capturable, check_complements,
    check_convert_copy, check_fp64_foreach, check_huge_launch, check_literal_ema,
    check_quick_norm, check_sqrt_div_rounding, check_exact_path)
from npucheck.common import Report, environment, setup  # noqa: E402
# the tolerance code's names, used by tests/test_npu_standin.py as npu_check.<name>
from npucheck.tolerances import (  # noqa: E402,F401
    DERIVE_HYPERS, DERIVED, ROUNDING, U, cann_bounds, derive_tolerances, gap_units, one_cann_step,
    rounding_needed)
from npucheck.bench import benchmark  # noqa: E402


# --- main -----------------------------------------------------------------------------------------

def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="npu:0")
    ap.add_argument("--skip-model-table", action="store_true",
                    help="--stand-in: do not print the simulated 910B's scenario table")
    ap.add_argument("--stand-in", action="store_true",
                    help="run on CPU with the NPU backend's code and CANN's formula emulated")
    ap.add_argument("--numel", type=int, default=None, help="benchmark elements (default 100M; 200k stand-in)")
    ap.add_argument("--tensors", type=int, default=None, help="benchmark tensors (default 200; 20 stand-in)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 3 stand-in)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--parity-numel", type=int, default=None, help="default 2M (50k stand-in)")
    ap.add_argument("--parity-tensors", type=int, default=24)
    ap.add_argument("--parity-steps", type=int, default=None, help="default 50 (5 stand-in)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--derive-tolerances", action="store_true",
                    help="measure the rounding coefficients behind the cann tolerances and exit")
    ap.add_argument("--derive-seeds", type=int, default=3)
    ap.add_argument("--ema-steps", type=int, default=None,
                    help="launches per EMA-of-a-constant run (default 20000; 300 stand-in)")
    ap.add_argument("--rounding-samples", type=int, default=None,
                    help="random fp32 inputs of the sqrt/div check (default 4M; 200k stand-in)")
    ap.add_argument("--sqrt-exhaustive", action="store_true",
                    help="check 7 also runs the device's fp32 sqrt on every positive finite fp32 "
                         "(2,139,095,039 values; what MULTI_TENSOR_NPU_IEEE_SQRT_DIV=1 needs)")
    ap.add_argument("--copy-numel", type=int, default=None,
                    help="elements of the copy-cost check (default 64M; 1M stand-in)")
    ap.add_argument("--derive-numel", type=int, default=20_000)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    small = args.stand_in
    args.numel = args.numel or (200_000 if small else 100_000_000)
    args.tensors = args.tensors or (20 if small else 200)
    args.steps = args.steps or (3 if small else 20)
    args.parity_numel = args.parity_numel or (50_000 if small else 2_000_000)
    args.parity_steps = args.parity_steps or (5 if small else 50)
    args.ema_steps = args.ema_steps or (300 if small else 20_000)
    args.rounding_samples = args.rounding_samples or (200_000 if small else 4_000_000)
    args.copy_numel = args.copy_numel or (1 << 20 if small else 1 << 26)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    rep = Report()
    device, backend, sync = setup(args, rep)
    with contextlib.ExitStack() as stack:
        if args.stand_in:
            stack.enter_context(npu_standin.standin_backend(npu_standin.cann_device_op,
                                                            name=backend))
        environment(device, backend, rep)
        checks = [check_exact_path, check_cann_step, check_cann_drift, check_literal_ema,
                  check_fp64_foreach, check_sqrt_div_rounding, check_binding_builds,
                  check_complements, check_convert_copy, check_huge_launch, check_quick_norm,
                  check_capturable]
        if args.derive_tolerances:
            checks = [derive_tolerances]
        elif not args.skip_bench:
            checks.append(benchmark)
        for check in checks:
            try:
                check(args, device, backend, sync, rep)
            except Exception as exc:  # one broken part must not hide the others' results
                rep.check(check.__name__, False, f"raised {type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc())
    if args.stand_in and not args.skip_model_table:
        # the simulated 910B (multi_tensor/testing/npu_model.py): the scenarios of the
        # NPU backend's steady-state step, the table tests/test_npu_sim.py asserts
        from multi_tensor.testing import npu_model

        rep.say("simulated 910B, steady-state step (third), 20 -> 200 params:\n"
                + npu_model.format_table(npu_model.scenario_table(optimizer=FusedEmaAdamW)))
    rep.say("result: " + ("FAIL" if rep.failed else "PASS"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=rep.results, failed=rep.failed, args=vars(args)), f, indent=1,
                      default=str)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
