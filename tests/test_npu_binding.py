"""The NPU backend's registration and its CANN binding's contract, without an NPU.

* a subprocess: the backend resolves for "npu" (after ``rename_privateuse1_backend``) and
  ``torch_npu`` is never imported;
* a fake ``torch_npu`` and a fake compiled binding injected into ``sys.modules``: the real loader
  (no MindSpeed) finds the binding, and the binding sees what CANN's operator requires (one
  dtype, one shape, contiguous, an int64 ``[1]`` step on the device, doubles, an int mode, a
  bool bias_correction), once per bucket per step;
* MindSpeed's op is preferred when it imports; a chip without the operator falls back; a
  binding that does not load is logged once (debug) and the exact path runs;
* the builder's arguments (sources, include paths, libraries) without compiling anything;
* a source check of the C++ binding (it cannot be compiled without torch_npu and CANN);
* ``tools/npu_check.py --stand-in`` runs end to end.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import logging
import warnings

import pytest
import torch

from fused_optim import FusedEmaAdamW
from multi_tensor import forced_backend
from multi_tensor.backends import npu
from multi_tensor.backends.npu import builder as npu_builder
from multi_tensor.backends.npu import loader as npu_loader
from multi_tensor.testing import npu_standin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = "npu_standin"


def test_resolves_for_npu_without_importing_torch_npu():
    code = (
        "import json, sys, torch\n"
        "import multi_tensor, fused_optim\n"
        "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
        "fused_optim.FusedEmaAdamW([p]).step()\n"
        "before = multi_tensor.backend_for('fused_ema_adamw', 'npu').name\n"
        "torch.utils.rename_privateuse1_backend('npu')\n"
        "names = {op: multi_tensor.backend_for(op, torch.device('npu')).name\n"
        "         for op in ('fused_ema_adamw', 'adam', 'radam', 'radam_ema', 'scale', 'l2norm')}\n"
        "names['npu:1'] = multi_tensor.backend_for('fused_ema_adamw', 'npu:1').name\n"
        "print(json.dumps(dict(before=before, names=names,\n"
        "                      torch_npu='torch_npu' in sys.modules)))\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MULTI_TENSOR_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torch_npu"] is False
    assert out["before"] == "npu"
    assert out["names"] == {"fused_ema_adamw": "npu", "adam": "npu", "radam": "npu",
                            "radam_ema": "npu", "scale": "npu", "l2norm": "npu",
                            "npu:1": "npu"}


# --- a fake torch_npu and a fake compiled binding ---------------------------------------------------

class ContractBinding:
    """Stands for the compiled module: checks every launch against CANN's contract."""

    def __init__(self):
        self.calls = []

    def npu_apply_fused_ema_adamw(self, grad, var, m, v, s, step, lr, ema_decay, beta1, beta2,
                                  eps, mode, bias_correction, weight_decay):
        tensors = {"grad": grad, "var": var, "m": m, "v": v, "s": s}
        dtypes = {t.dtype for t in tensors.values()}
        assert len(dtypes) == 1 and var.dtype in (torch.float32, torch.float16, torch.bfloat16), dtypes
        for name, t in tensors.items():
            assert t.shape == var.shape and 1 <= t.dim() <= 8, (name, t.shape)
            assert t.is_contiguous(), name
            assert t.device == var.device, name
        assert step.dtype == torch.int64 and tuple(step.shape) == (1,), (step.dtype, step.shape)
        assert step.device == var.device
        for name, x in (("lr", lr), ("ema_decay", ema_decay), ("beta1", beta1), ("beta2", beta2),
                        ("eps", eps), ("weight_decay", weight_decay)):
            assert type(x) is float, (name, type(x))
        assert type(mode) is int and mode in (0, 1)
        assert type(bias_correction) is bool
        self.calls.append(dict(numel=var.numel(), dtype=var.dtype, lr=lr, mode=mode))
        return npu_standin.reference_device_op(grad, var, m, v, s, step, lr, ema_decay, beta1,
                                               beta2, eps, mode, bias_correction, weight_decay)


def fake_torch_npu(tmp_path, chip="Ascend910B2"):
    pkg = tmp_path / "torch_npu"
    (pkg / "include").mkdir(parents=True, exist_ok=True)
    (pkg / "lib").mkdir(exist_ok=True)
    module = types.ModuleType("torch_npu")
    module.__file__ = str(pkg / "__init__.py")
    module.__version__ = "0.0.fake"
    module.npu = types.SimpleNamespace(get_device_name=lambda index=0: chip,
                                       current_device=lambda: 0)
    return module


@pytest.fixture
def fake_npu_env(tmp_path, monkeypatch):
    """A fake torch_npu and compiled binding; MindSpeed absent; CANN at a temporary path."""
    binding = ContractBinding()
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(tmp_path))
    monkeypatch.setitem(sys.modules, npu_builder.FusedEmaAdamBuilder.NAME, binding)
    monkeypatch.setitem(sys.modules, "mindspeed", None)  # import mindspeed... raises ImportError
    monkeypatch.delenv("MULTI_TENSOR_NPU_BINDING", raising=False)
    cann = tmp_path / "cann"
    (cann / "include").mkdir(parents=True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    return binding


def run_steps(params, steps=3, **kw):
    opt = FusedEmaAdamW(params, lr=1e-2, weight_decay=0.1, **kw)
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        with forced_backend(STANDIN):
            opt.step()
    return opt


def test_the_loader_finds_the_binding_and_the_launches_keep_the_contract(fake_npu_env):
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in ((4, 5), (0,), (33,))]
    with npu_standin.standin_backend(None, mode="cann") as backend:  # None: the real loader
        opt = run_steps(params, steps=3, master_weights=True)
        assert backend.device_op.source.startswith("multi_tensor")
    assert sys.modules["torch_npu"].__version__ == "0.0.fake"
    probe, *launches = fake_npu_env.calls  # the one-element probe, then the steps
    assert probe["numel"] == 1 and probe["dtype"] == torch.float32
    assert len(launches) == 3  # one bucket: one launch per step
    assert all(c["dtype"] == torch.float32 for c in launches)  # the fp32 masters
    (plan,) = opt._plans.values()
    (bucket,) = plan.buckets
    assert bucket.prepared.last_path == "cann"
    assert {c["numel"] for c in launches} == {bucket.prepared.layout.total}


def test_mindspeed_op_is_preferred(fake_npu_env, monkeypatch):
    calls = []

    def op(*args):
        calls.append("op")
        return fake_npu_env.npu_apply_fused_ema_adamw(*args)
    mindspeed_modules(monkeypatch, op, lambda: calls.append("load"))
    fn, source = npu.load_device_op()
    assert source == "mindspeed" and fn is op and calls == ["load"]
    monkeypatch.setenv("MULTI_TENSOR_NPU_BINDING", "builtin")
    fn, source = npu.load_device_op()
    assert source.startswith("multi_tensor")


CHIPS = [  # (torch_npu.npu.get_device_name(), has aclnnApplyFusedEmaAdam)
    ("Ascend910B1", True), ("Ascend910B2", True), ("Ascend910B2C", True), ("Ascend910B3", True),
    ("Ascend910B4", True), ("Ascend910B4-1", True),
    ("Ascend910_9391", True), ("Ascend910_9392", True), ("Ascend910_9381", True),
    ("Ascend910_9382", True), ("Ascend910_9372", True), ("Ascend910_9362", True),
    ("Ascend910_9361", True),
    ("Ascend910_950z", True), ("Ascend910_9579", True), ("Ascend910_957b", True),
    ("Ascend910_9581", True), ("Ascend910_958a", True), ("Ascend910_9599", True),
    ("Ascend950PR_9599", True),
    ("Ascend910B", False), ("Ascend910A", False), ("Ascend910ProA", False),
    ("Ascend910ProB", False), ("Ascend910PremiumA", False), ("Ascend310P3", False),
    ("Ascend310B1", False), ("", False),
]


@pytest.mark.parametrize("chip,has_op", CHIPS)
def test_chip_table(chip, has_op):
    assert npu_loader.chip_has_operator(chip) is has_op
    assert chip.startswith(npu_loader.SUPPORTED_CHIP_PREFIXES) is has_op


@pytest.mark.parametrize("chip,has_op", [("Ascend910A", False), ("Ascend910_9392", True),
                                         ("Ascend910_9599", True), ("Ascend910B", False)])
def test_chips_without_the_operator_run_the_exact_path(fake_npu_env, tmp_path, monkeypatch,
                                                       chip, has_op):
    probed = []
    monkeypatch.setattr(npu_loader, "probe", lambda fn, device: probed.append(device))
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(tmp_path, chip=chip))
    holder = npu.DeviceOp()  # the real loader: the fake binding, probed once
    fn, why = holder.get(types.SimpleNamespace(type="npu", index=0))
    assert (fn is not None) is has_op
    assert (why is None) is has_op and (has_op or chip in why)
    assert len(probed) == int(has_op)  # only a chip with the operator is probed


def reference_steps(params, steps=3, **kw):
    """run_steps' trajectory on the reference backend (copies of ``params``)."""
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedEmaAdamW(ref, lr=1e-2, weight_decay=0.1, **kw)
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        for p in ref:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        with forced_backend("reference"):
            opt.step()
    return ref, opt


class RaisingBinding(ContractBinding):
    """A binding that loads but whose launch fails (a missing kernel, a failing launch)."""

    def npu_apply_fused_ema_adamw(self, *args):
        self.calls.append(args)
        raise RuntimeError("aclnnApplyFusedEmaAdam failed (561003): kernel not found")


def fallback_messages(caught, caplog):
    """The NPU backend's fallback notes: none warned, each logged once at debug level."""
    assert not [w for w in caught if "NPU backend" in str(w.message)]
    return [r.getMessage() for r in caplog.records
            if r.name == "multi_tensor.backends.npu" and r.levelno == logging.DEBUG]


def test_a_binding_whose_first_call_raises_is_logged_once_and_the_exact_path_runs(
        fake_npu_env, monkeypatch, caplog):
    binding = RaisingBinding()
    monkeypatch.setitem(sys.modules, npu_builder.FusedEmaAdamBuilder.NAME, binding)
    monkeypatch.setattr(npu.modes, "_fallbacks", {})
    caplog.set_level(logging.DEBUG, logger="multi_tensor.backends.npu")
    params = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(3, 3))]
    ref, ref_opt = reference_steps(params, steps=3)
    with npu_standin.standin_backend(None, mode="cann") as backend:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = run_steps(params, steps=3)
        report = "\n".join(backend.report())
    messages = fallback_messages(caught, caplog)
    assert len(messages) == 1 and "probe" in messages[0] and "561003" in messages[0], messages
    assert "561003" in report and "fell back in this process" in report  # multi_tensor.env
    assert len(binding.calls) == 1  # the probe only: no step launched the operator
    (plan,) = opt._plans.values()
    assert plan.buckets[0].prepared.last_path == "exact"
    for p, q in zip(params, ref):  # the exact path: the reference's bits
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(opt.state[p]["ema"], ref_opt.state[q]["ema"])


def mindspeed_modules(monkeypatch, op, load):
    ops = types.ModuleType("mindspeed.ops.npu_apply_fused_ema_adamw")
    ops.fused_ema_adamw_op_builder = types.SimpleNamespace(load=load)
    ops.npu_apply_fused_ema_adamw = op
    mindspeed = types.ModuleType("mindspeed")
    mindspeed.__path__ = []
    mindspeed_ops = types.ModuleType("mindspeed.ops")
    mindspeed_ops.__path__ = []
    monkeypatch.setitem(sys.modules, "mindspeed", mindspeed)
    monkeypatch.setitem(sys.modules, "mindspeed.ops", mindspeed_ops)
    monkeypatch.setitem(sys.modules, "mindspeed.ops.npu_apply_fused_ema_adamw", ops)


def test_a_mindspeed_build_failure_tries_the_builtin_binding(fake_npu_env, monkeypatch):
    def failing_build():
        raise RuntimeError("ninja: build stopped: subcommand failed")
    mindspeed_modules(monkeypatch, lambda *a: pytest.fail("MindSpeed's op must not run"),
                      failing_build)
    monkeypatch.setattr(npu_loader, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, source = npu.load_device_op()
        fn2, _ = npu.load_device_op()
    assert source.startswith("multi_tensor") and fn == fake_npu_env.npu_apply_fused_ema_adamw
    messages = [str(w.message) for w in caught if "MindSpeed" in str(w.message)]
    assert len(messages) == 1 and "subcommand failed" in messages[0]
    monkeypatch.setenv("MULTI_TENSOR_NPU_BINDING", "mindspeed")  # insisting on MindSpeed raises
    with pytest.raises(RuntimeError, match="subcommand failed"):
        npu.load_device_op()


def test_a_mindspeed_import_failure_tries_the_builtin_binding(fake_npu_env, monkeypatch):
    # importing MindSpeed's op registers torch ops (and may import torchair): any error there,
    # not only ImportError, falls back in auto mode
    import importlib
    real = importlib.import_module

    def failing_import(name, *args):
        if name.startswith("mindspeed.ops"):
            raise RuntimeError("Library mindspeed already defined")
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", failing_import)
    monkeypatch.setattr(npu_loader, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, source = npu.load_device_op()
    assert source.startswith("multi_tensor") and fn == fake_npu_env.npu_apply_fused_ema_adamw
    assert any("already defined" in str(w.message) for w in caught)
    monkeypatch.setenv("MULTI_TENSOR_NPU_BINDING", "mindspeed")
    with pytest.raises(RuntimeError, match="already defined"):
        npu.load_device_op()


def test_a_binding_that_does_not_load_is_logged_once_and_the_exact_path_runs(
        fake_npu_env, monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, npu_builder.FusedEmaAdamBuilder.NAME)

    def broken_load(self, verbose=False):
        raise RuntimeError("no CANN headers")
    monkeypatch.setattr(npu_builder.FusedEmaAdamBuilder, "load", broken_load)
    monkeypatch.setattr(npu.modes, "_fallbacks", {})
    caplog.set_level(logging.DEBUG, logger="multi_tensor.backends.npu")
    params = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(3, 3))]
    with npu_standin.standin_backend(None, mode="cann"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = run_steps(params, steps=3)
    messages = fallback_messages(caught, caplog)
    assert len(messages) == 1 and "no CANN headers" in messages[0]
    (plan,) = opt._plans.values()
    assert plan.buckets[0].prepared.last_path == "exact"


def test_builder_arguments_without_building(fake_npu_env, tmp_path):
    builder = npu_builder.FusedEmaAdamBuilder()
    args = builder.build_args()
    assert args["name"] == "multi_tensor_npu_fused_ema_adam"
    (source,) = args["sources"]
    assert source.endswith(os.path.join("csrc", "npu", "fused_ema_adam.cpp")) and os.path.isfile(source)
    assert os.path.join(str(tmp_path), "cann", "include") in args["extra_include_paths"]
    assert "-lascendcl" in args["extra_ldflags"] and "-ltorch_npu" in args["extra_ldflags"]
    assert "-L" + os.path.join(str(tmp_path), "cann", "lib64") in args["extra_ldflags"]
    assert builder.load() is fake_npu_env  # an already loaded module is reused, never rebuilt
    with pytest.raises(FileNotFoundError, match="MULTI_TENSOR_NPU_SOURCE_ROOT"):
        npu_builder.FusedEmaAdamBuilder(source_root=str(tmp_path)).sources()


def test_builder_puts_torch_npu_headers_before_canns(fake_npu_env, tmp_path):
    paths = npu_builder.FusedEmaAdamBuilder().include_paths()
    npu_inc = os.path.join(str(tmp_path), "torch_npu", "include")
    cann_inc = os.path.join(str(tmp_path), "cann", "include")
    acl_inc = os.path.join(npu_inc, "third_party", "acl", "inc")
    assert paths.index(npu_inc) < paths.index(acl_inc) < paths.index(cann_inc)  # MindSpeed's order


SEARCH_PROGRAM = r"""
#include <cstdio>
#include "opapi_libs.h"
int main() {
  for (const std::string &lib : multi_tensor_npu::OpApiLibraryCandidates()) std::puts(lib.c_str());
  return 0;
}
"""


def test_library_search_order_follows_torch_npu(tmp_path):
    """csrc/npu/opapi_libs.h compiled and run against a fake CANN layout (no CANN needed)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "search.cpp"
    src.write_text(SEARCH_PROGRAM)
    exe = tmp_path / "search"
    build = subprocess.run([cxx, "-std=c++17", "-O0", "-I", os.path.join(REPO, "csrc", "npu"),
                            str(src), "-o", str(exe), "-ldl"], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]

    def touch(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        return str(path)
    custom_a = touch(tmp_path / "custom_a" / "op_api" / "lib" / "libcust_opapi.so")
    (tmp_path / "custom_b").mkdir()  # an entry without the library is skipped
    opp = tmp_path / "opp"
    vendor_y = touch(opp / "vendors" / "vendor_y" / "op_api" / "lib" / "libcust_opapi.so")
    vendor_x = touch(opp / "vendors" / "vendor_x" / "op_api" / "lib" / "libcust_opapi.so")
    (opp / "vendors" / "config.ini").write_text("# vendors\nload_priority=vendor_y,vendor_x\n")
    home = tmp_path / "home"
    for name in ("libopapi_nn.so", "libopapi_math.so", "libopapi.so", "libopapi_cv.so.1",
                 "libascendcl.so"):
        touch(home / "lib64" / name)
    custom = f"{tmp_path / 'custom_a'}:{tmp_path / 'custom_b'}"
    if os.getuid() == 0:  # root never loads another user's library (op-plugin's checkOwner)
        foreign = touch(tmp_path / "custom_c" / "op_api" / "lib" / "libcust_opapi.so")
        os.chown(foreign, 54321, 54321)
        custom += f":{tmp_path / 'custom_c'}"
    env = dict(os.environ, ASCEND_CUSTOM_OPP_PATH=custom,
               ASCEND_OPP_PATH=str(opp), ASCEND_HOME_PATH=str(home))
    out = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        custom_a, vendor_y, vendor_x,                     # custom op packages first
        "libopapi_math.so", "libopapi_nn.so",             # CANN's split op API libraries
        "libopapi.so",
        "libaclnn_ops_infer.so", "libaclnn_ops_train.so", "libaclnn_math.so",
        "libaclnn_sparse.so", "libaclnn_fft.so", "libaclnn_rand.so"]  # the feature libraries
    bare = {k: v for k, v in os.environ.items()
            if k not in ("ASCEND_CUSTOM_OPP_PATH", "ASCEND_OPP_PATH", "ASCEND_HOME_PATH")}
    out = subprocess.run([str(exe)], capture_output=True, text=True, env=bare, timeout=60)
    assert out.stdout.split()[0] == "libopapi.so" and len(out.stdout.split()) == 7


def test_source_check_binding_cpp_names_the_contract():
    """A SOURCE CHECK, not a behavioural test: csrc/npu/fused_ema_adam.cpp needs torch_npu's and
    CANN's headers to compile, which no CPU machine has, so here it is only read for the
    symbols and checks it must contain (the operator and its workspace query through
    opapi_libs.h, the int64 step, the contiguity and base-format checks, the double and bool
    arguments). It passes for any file that keeps these strings; the compiled binding's
    behaviour is checked on a device by tools/npu_check.py ("built-in binding"), and the
    Python side of its contract by the fake binding above."""
    with open(os.path.join(REPO, "csrc", "npu", "fused_ema_adam.cpp")) as f:
        text = f.read()
    for needle in ("aclnnApplyFusedEmaAdamGetWorkspaceSize", "aclnnApplyFusedEmaAdam\"",
                   "opapi_libs.h", "OpApiSymbol", "OpCommand", "SetCustomHandler", "at::kLong",
                   "is_contiguous", "IsBaseFormatType", "PYBIND11_MODULE", "double lr",
                   "bool bias_correction"):
        assert needle in text, needle


def test_npu_check_stand_in_runs(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import npu_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "check.json"
    rc = npu_check.main(["--stand-in", "--numel", "20000", "--tensors", "6", "--steps", "1",
                         "--warmup", "0", "--parity-numel", "5000", "--parity-tensors", "5",
                         "--parity-steps", "3", "--ema-steps", "20", "--rounding-samples", "4000",
                         "--copy-numel", "4096", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert not result["failed"]
    res = result["results"]
    # the kernel's 1 - fp32(d): d_eff + (1-d)_eff == 1, so a constant is the EMA's fixed point
    assert res["cann_literal EMA coefficients"]["d"] + res["cann_literal EMA coefficients"]["omd"] == 1.0
    assert res["cann_literal EMA coefficients"]["steady"] == 0.0
    assert res["operator complements"]["ok"] and res["operator complements"]["model"].startswith("fp32")
    for name in ("fp64 foreach", "fp32 sqrt correctly rounded", "fp32 div correctly rounded",
                 "built-in binding", "converting copy", "launch over 2^31 elements"):
        assert name in res, name
    assert any(k.startswith("ours cann") for k in result["results"]["bench_ms"])
