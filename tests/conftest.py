"""Shared pytest configuration: import paths, the ``backend`` and ``standin`` fixtures.

Tests that take the ``backend`` fixture run once per multi-tensor backend, with the test body
inside ``multi_tensor.backends.forced_backend(name)``. ``native_cpu`` is skipped (with the reason
shown by ``pytest -rs``) when its extension did not load and the backend did not register.
"""
from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _path in (_ROOT, _TESTS):  # the package (no install needed) and tests/seed_reference.py
    if _path not in sys.path:
        sys.path.insert(0, _path)

import multi_tensor  # noqa: E402
from multi_tensor.backends import forced_backend  # noqa: E402

BACKENDS = ("reference", "native_cpu")
MODULES = {"native_cpu": "cpu"}  # registered name -> module under multi_tensor.backends


def registered_backend_names():
    return [b.name for b in multi_tensor.registered_backends()]


def _why_not_registered(name: str) -> str:
    module = getattr(multi_tensor.backends, MODULES.get(name, name), None)
    error = getattr(module, "load_error", None) if module is not None else None
    if module is None:
        why = f"multi_tensor.backends.{MODULES.get(name, name)} could not be imported"
    elif error:
        why = f"its extension did not load: {error}"
    else:
        why = "it did not register (the C++ CPU extension is not built?)"
    return (f"backend '{name}' is not registered: {why}; registered: "
            f"{registered_backend_names()}")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The name of the backend every op of the test resolves to (ops it lacks fall back to reference)."""
    name = request.param
    if name not in registered_backend_names():
        pytest.skip(_why_not_registered(name))
    with forced_backend(name):
        yield name


@pytest.fixture
def standin():
    """The NPU CPU stand-in (multi_tensor/testing/npu_standin.py) as the backend for "npu",
    running the exact path ("exact" mode, bitwise the reference); yields the registered backend."""
    from multi_tensor.testing import npu_standin
    with npu_standin.standin_backend(mode="exact") as backend:
        yield backend


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "npu_sim: the simulated Ascend 910B (multi_tensor/testing/npu_model.py)")
