"""The Triton backend's registration and its fallback, on CPU (each in a fresh interpreter).

* Importing the package registers backend "triton" for device type "cuda" above the reference
  and does not import triton.
* Without triton (``import triton`` raising ImportError) the backend's ops run the reference
  backend after ONE RuntimeWarning naming the reason and the install command; a prepared bucket
  is the reference's PreparedOp. This needs no triton, so it runs everywhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_registered_for_cuda_without_importing_triton():
    proc = run_python("""
        import sys
        import multi_tensor
        from multi_tensor.backends import backend_for, registered_backends
        names = {b.name: b for b in registered_backends()}
        t = names["triton"]
        assert t.device_types == ("cuda",), t.device_types
        assert t.priority > names["reference"].priority
        assert t.prepare is not None
        for op in ("fused_ema_adamw", "adam", "radam", "radam_ema", "scale", "l2norm"):
            assert backend_for(op, "cuda").name == "triton", op
            assert backend_for(op, "cpu").name != "triton", op
        assert "triton" not in sys.modules, "registering the backend imported triton"
        print("ok")
    """)
    assert proc.stdout.strip().endswith("ok")


def test_without_triton_the_reference_runs_after_one_warning():
    proc = run_python("""
        import sys, warnings
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        from multi_tensor import rules
        from multi_tensor.backends import reference, registry
        from multi_tensor.backends import triton as triton_gpu
        from multi_tensor.ops import named_lists

        def lists():
            g = torch.Generator().manual_seed(0)
            out = [[torch.randn(5, generator=g), torch.randn(3, 4, generator=g)] for _ in range(5)]
            out[3] = [t.abs() for t in out[3]]  # exp_avg_sqs
            return out

        h = rules.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            ema_decay=0.9)
        c = rules.step_scalars(h, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a, b = lists(), lists()
            na, nb = (named_lists("fused_ema_adamw", x) for x in (a, b))
            triton_gpu.BACKEND.ops["fused_ema_adamw"](64, torch.zeros(1, dtype=torch.int32), na, c)
            triton_gpu.BACKEND.ops["fused_ema_adamw"](64, torch.zeros(1, dtype=torch.int32), na, c)
            reference.adam_family(64, torch.zeros(1, dtype=torch.int32), nb, c)
            reference.adam_family(64, torch.zeros(1, dtype=torch.int32), nb, c)
            for x, y in zip(a, b):
                for s, t in zip(x, y):
                    assert torch.equal(s, t)
            dst = [torch.empty(5), torch.empty(3, 4)]
            triton_gpu.BACKEND.ops["scale"](64, torch.zeros(1, dtype=torch.int32), [a[1], dst], 0.5)
            assert torch.equal(dst[0], a[1][0] * 0.5)
            total, per = triton_gpu.BACKEND.ops["l2norm"](64, torch.zeros(1, dtype=torch.int32), [a[1]], True)
            assert per.shape == (2,)
            prepared = triton_gpu.prepare("fused_ema_adamw", na.state(), 64)
            assert isinstance(prepared, registry.PreparedOp)
            assert not hasattr(prepared, "run_device_step")
        ours = [w for w in caught if "triton" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        msg = str(ours[0].message)
        assert ours[0].category is RuntimeWarning
        assert "reference" in msg and "pip install triton==" in msg and "Reason: " in msg, msg
        assert triton_gpu.load_error and triton_gpu.host_module() is None
        print("ok")
    """)
    assert proc.stdout.strip().endswith("ok")
