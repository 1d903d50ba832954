"""The host work of a steady-state ``step()`` does not grow with the number of tensors.

A guard that times nothing: one ``FusedEmaAdamW.step()`` after warm-up steps is run under
``sys.setprofile`` (every Python and C function call) and ``sys.settrace`` with opcode events
(every bytecode executed, comprehensions and loops included), at 300 and at 3000 fp32 tensors;
the two counts must be equal. Whatever work a step does per tensor must run in native code (one
call over a list: :mod:`multi_tensor.tensor_facts`, the backends' binds), so a per-tensor Python
loop, comprehension or call anywhere in the step makes the 3000-tensor count larger.

Scenarios: the native CPU backend, and the Triton backend's host side on CPU tensors with its
launches stubbed (as ``tools/host_cost.py`` runs it: everything but the kernels); each with the
same grads at every step, and with new grad tensors at every step (what follows
``zero_grad(set_to_none=True)``: the grads' row of the table rewritten), and the Triton bucket
with ``max_grad_norm``. The ``planted`` scenario adds a loop over the grads to every bucket's run
and must be seen to grow (the guard catches what it is for).

The counts run in one subprocess (``TRITON_INTERPRET=1`` must be set before triton loads; the
stub backend stays out of this process's registry). Without the native CPU extension the CPU
scenarios have no backend to run on and skip; the Triton ones still run, on the Python twins of
:mod:`multi_tensor.tensor_facts` (their per-tensor work is C-level iteration, ``map`` over a
list, which neither counter sees as Python work: a count, not a time).
"""
import collections
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (300, 3000)
# (name, backend: "cpu" or "triton" (stubbed), optimizer options, new grads at every step)
SCENARIOS = [
    ("cpu", "cpu", {}, False),
    ("cpu moved grads", "cpu", {}, True),
    ("triton", "triton", {}, False),
    ("triton moved grads", "triton", {}, True),
    ("triton clipped", "triton", {"max_grad_norm": 1.0}, False),
]
PLANTED = ("planted", "cpu", {}, False)


# ---------------------------------------------------------------------------------------------
# the subprocess

def _count(fn) -> dict:
    """Python-level calls (``call`` and ``c_call`` events) and bytecodes executed by ``fn()``,
    and the functions that made the most."""
    calls = collections.Counter()
    opcodes = collections.Counter()

    def where(frame):
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"

    def profile(frame, event, arg):
        if event == "call":
            calls[where(frame)] += 1
        elif event == "c_call":
            calls[f"C:{getattr(arg, '__qualname__', repr(arg))}"] += 1

    def local(frame, event, arg):
        if event == "opcode":
            opcodes[where(frame)] += 1
        return local

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return {"calls": sum(calls.values()), "opcodes": sum(opcodes.values()),
            "by_function": dict((opcodes + calls).most_common(12))}


def _stub_triton():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import host_cost
    return host_cost.stub_backend()


def _run(name, backend, options, moved, count) -> dict:
    import torch

    import fused_optim
    import multi_tensor
    from fused_optim import planning

    gen = torch.Generator().manual_seed(count)
    shapes = [(int(n),) for n in torch.randint(64, 257, (count,), generator=gen)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    for p, g in zip(params, grads[0]):
        p.grad = g
    forced = multi_tensor.backends.forced_backend(_stub_triton() if backend == "triton"
                                                  else "native_cpu")
    if name == "planted":
        run = planning._Bucket.run

        def planted(self, *args, **kw):
            for g in self.grads:  # a per-tensor Python loop in the step
                g.numel()
            return run(self, *args, **kw)
        planning._Bucket.run = planted
    with forced:
        opt = fused_optim.FusedEmaAdamW(params, lr=1e-3, ema_decay=0.999, **options)
        state = {"i": 0}

        def step():
            if moved:  # new grad tensors, as after zero_grad(set_to_none=True) (not counted)
                state["i"] += 1
                for p, g in zip(params, grads[state["i"] % 2]):
                    p.grad = g
            opt.step()
        for _ in range(3):
            step()
        if moved:
            state["i"] += 1
            for p, g in zip(params, grads[state["i"] % 2]):
                p.grad = g
            out = _count(opt.step)
        else:
            out = _count(step)
        backends = {type(b.prepared).__name__ for plan in opt._plans.values()
                    for b in plan.buckets}
    out["buckets"] = sorted(backends)
    return out


def _main(path: str) -> None:
    from multi_tensor import tensor_facts
    results = {"native": tensor_facts.native_module() is not None, "counts": {}}
    for name, backend, options, moved in SCENARIOS + [PLANTED]:
        if backend == "cpu" and not results["native"]:
            continue  # no native CPU backend to run
        results["counts"][name] = {str(n): _run(name, backend, options, moved, n) for n in SIZES}
    with open(path, "w") as f:
        json.dump(results, f)


# ---------------------------------------------------------------------------------------------
# the tests

@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_work") / "counts.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"the counting subprocess failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _entry(counts, name):
    if name not in counts["counts"]:
        pytest.skip(f"{name!r} runs on the native CPU backend, which is not built here "
                    f"(python -m multi_tensor.build)")
    return counts["counts"][name]


def _describe(entry) -> str:
    return "\n".join(f"  {n} tensors: {c['calls']} calls, {c['opcodes']} opcodes; busiest: "
                     f"{c['by_function']}" for n, c in entry.items())


@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_step_host_work_does_not_grow_with_tensors(counts, name):
    entry = _entry(counts, name)
    small, large = (entry[str(n)] for n in SIZES)
    assert small["calls"] > 0 and small["opcodes"] > 0, entry
    # the native backend's bucket (the extension's AdamBucket under the bucket contract), and
    # the Triton host side's
    expected = {"cpu": ["CpuBucket"], "triton": ["AdamBucket"]}
    assert small["buckets"] == expected[name.split()[0]], small["buckets"]
    assert (large["calls"], large["opcodes"]) == (small["calls"], small["opcodes"]), (
        f"{name}: one steady-state step does more Python work at {SIZES[1]} tensors than at "
        f"{SIZES[0]}:\n{_describe(entry)}")


def test_guard_sees_a_planted_per_tensor_loop(counts):
    entry = _entry(counts, "planted")
    small, large = (entry[str(n)] for n in SIZES)
    assert large["opcodes"] - small["opcodes"] >= SIZES[1] - SIZES[0], entry
    assert large["calls"] - small["calls"] >= SIZES[1] - SIZES[0], entry


def test_a_step_keeps_no_grad_alive():
    """Collecting the grads natively keeps none of them past the step: grads the user sets to
    None (``zero_grad(set_to_none=True)``, ``model.zero_grad()``) are freed at once."""
    import gc
    import weakref

    import torch

    import fused_optim
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(8)
    opt = fused_optim.FusedEmaAdamW(params, lr=1e-3, ema_decay=0.999)
    for _ in range(2):
        opt.step()
    refs = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


if __name__ == "__main__":
    _main(sys.argv[1])
