"""multi_tensor.tensor_facts: the native pass over a list of tensors against its Python twin.

The device backends' binds trust these facts to decide that a list is unchanged (the same
addresses, shapes, dtype, device); a native answer that differs from Python's would bind stale
tables, so every case is compared field by field, including the lists that must give None.
"""
import pytest
import torch

from multi_tensor import tensor_facts
from multi_tensor.backends import cpu as native_cpu

native = pytest.mark.skipif(tensor_facts._mod() is None,
                            reason=f"the native extension did not load: {native_cpu.load_error}")


def _cases():
    base = torch.randn(6, 4)
    with torch.inference_mode():
        inference = torch.randn(3)
    return {
        "one dtype": [torch.randn(3), torch.randn(2, 5), torch.randn(())],
        "mixed dtypes": [torch.randn(3), torch.randn(3).to(torch.bfloat16)],
        "views and strides": [base[1], base[:, 1], base.t(), base[::2], base.view(-1)],
        "channels_last": [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)],
        "empty tensors": [torch.empty(0), torch.empty(3, 0)],
        "params": [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(1, 2))],
        "meta": [torch.empty(3, device="meta"), torch.empty(2, device="meta")],
        "cpu and meta": [torch.randn(3), torch.empty(3, device="meta")],
        "inference": [inference],
        "empty list": [],
        "a non-tensor": [torch.randn(2), 3.0],
        "None": [torch.randn(2), None],
        "sparse": [torch.randn(3).to_sparse()],
        "fake": _fake(),
        "copy-on-write": [torch._lazy_clone(base), base],
    }


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        return [torch.empty(5), torch.empty(2, 3)]


CASES = _cases()


@native
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("container", [list, tuple])
def test_native_matches_python(name, container):
    tensors = container(CASES[name])
    assert tensor_facts.addresses(tensors) == tensor_facts.py_addresses(tensors)
    assert tensor_facts.describe(tensors) == tensor_facts.py_describe(tensors)
    assert tensor_facts.versions(tensors) == tensor_facts.py_versions(tensors)
    packed = tensor_facts.py_addresses(tensors)
    if packed is not None:
        assert tensor_facts.addresses_match(tensors, packed)
        assert not tensor_facts.addresses_match(tensors, packed + bytes(8))
        if tensors:  # the last address moved
            moved = tensor_facts.as_array(packed).copy()
            moved[-1] += 16
            assert not tensor_facts.addresses_match(tensors, moved.tobytes())
    else:  # no address to match: never a match
        assert not tensor_facts.addresses_match(tensors, bytes(8 * len(tensors)))


def test_facts_say_what_a_bind_needs():
    a, b = torch.randn(4, 2), torch.randn(3)
    facts = tensor_facts.describe([a, b])
    assert list(tensor_facts.as_array(facts.addresses)) == [a.data_ptr(), b.data_ptr()]
    assert list(tensor_facts.as_array(facts.shapes)) == [2, 4, 2, 1, 3]
    assert (facts.dtype, facts.device, facts.contiguous) == (torch.float32, a.device, b"\1\1")
    # equal bytes iff the same addresses: a tensor re-pointed in place changes them
    before = tensor_facts.addresses([a, b])
    b.data = b.data.clone()
    assert tensor_facts.addresses([a, b]) != before
    # a write in place bumps the version counter
    versions = tensor_facts.versions([a, b])
    a.add_(1)
    assert tensor_facts.versions([a, b]) != versions
    # what a bind must refuse gives None, never a partial answer: a nonempty tensor without
    # data (meta, fake; DTensor's wrapper reports address 0 as well) has no address
    fake = _fake()
    for bad in ([a, None], [a, a.to_sparse()], [a, "x"], [a, torch.empty(3, device="meta")],
                [a] + fake):
        assert tensor_facts.describe(bad) is None and tensor_facts.addresses(bad) is None
    assert tensor_facts.addresses([torch.empty(0, device="meta")]) is not None
    with torch.inference_mode():
        assert tensor_facts.versions([torch.randn(2)]) is None


@native
def test_non_sequences_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="list of tensors"):
        tensor_facts._mod().describe(torch.randn(3))
    # the Python wrappers take any iterable (as the Python twins do)
    a = torch.randn(2)
    assert tensor_facts.addresses(iter([a])) == tensor_facts.py_addresses([a])
    # and so do the twins, in one pass
    assert tensor_facts.py_describe(iter([a])) == tensor_facts.describe([a])
    assert tensor_facts.py_versions(iter([a])) == tensor_facts.versions([a])


def test_packed_shapes_compare_with_described_ones():
    tensors = [torch.randn(2, 3), torch.randn(()), torch.randn(0, 4)]
    packed = tensor_facts.pack_shapes([t.shape for t in tensors])
    assert packed == tensor_facts.describe(tensors).shapes == tensor_facts.py_describe(
        tensors).shapes
    assert tensor_facts.pack_shapes([]) == tensor_facts.describe([]).shapes == b""


def test_same_objects_is_identity_never_equality():
    a, b = torch.ones(3), torch.ones(3)
    cases = [([a, b], [a, b], True), ([a, b], [a, b.clone()], False), ([a], [a, b], False),
             ([], [], True), ((a, b), [a, b], True), ([a, None], [a, None], True)]
    for x, y, want in cases:
        assert tensor_facts.same_objects(x, y) is want, (x, y)
        assert tensor_facts.py_same_objects(x, y) is want, (x, y)
    assert tensor_facts.same_objects(iter([a]), [a])


class _GradInPython(torch.nn.Parameter):
    """A param subclass whose .grad is a Python property (grads_of must read it in Python)."""

    @property
    def grad(self):
        return self.seen

    @grad.setter
    def grad(self, value):
        self.seen = value


def _params_with_grads():
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)] + [torch.randn(2)]
    ps[0].grad, ps[2].grad = torch.randn(3), torch.randn(3)
    return ps


@pytest.mark.parametrize("grads_of", [tensor_facts.grads_of, tensor_facts.py_grads_of],
                         ids=["wrapper", "python"])
def test_grads_of_gives_the_last_list_back_only_for_the_same_grads(grads_of):
    ps = _params_with_grads()
    first = grads_of(ps)
    assert len(first) == len(ps) and all(g is p.grad for g, p in zip(first, ps))
    assert grads_of(ps, first) is first  # the same grads: the same list object
    changes = [
        ("a new grad tensor", lambda: setattr(ps[0], "grad", torch.randn(3))),
        ("a grad appears", lambda: setattr(ps[1], "grad", torch.randn(3))),
        ("a grad goes", lambda: setattr(ps[2], "grad", None)),
    ]
    last = first
    for what, change in changes:
        change()
        now = grads_of(ps, last)
        assert now is not last, what
        assert all(g is p.grad for g, p in zip(now, ps)), what
        assert grads_of(ps, now) is now, what
        last = now
    assert grads_of(ps[:-1], last) is not last  # another count
    odd = _GradInPython(torch.randn(3))
    odd.grad = torch.randn(3)
    assert grads_of([odd] + ps, None)[0] is odd.seen
