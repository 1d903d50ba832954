"""The step plan every entry point shares: bucket keys, named lists, prepared buckets, scalars.

Four entry points run the Adam-family update: the optimizers' eager ``step()``
(:mod:`fused_optim.base`), the compiled custom op (:mod:`fused_optim.custom_ops`), the functional
API (:mod:`fused_optim.functional`) and the apex ops (:mod:`multi_tensor.ops`). They all

1. split rows into buckets by :func:`bucket_key` (:func:`split_buckets`: one device, one dtype
   per list, one step count, masters or not, one shard layout);
2. name each bucket's lists (:class:`multi_tensor.schema.AdamLists`) and check them once
   against the op table (:func:`multi_tensor.schema.check_adam_lists`), before anything is
   modified;
3. run a bucket prepared by its backend (``prepare → bind → run``, the one backend contract of
   :mod:`multi_tensor.backends.registry`) with the step's :class:`multi_tensor.rules.StepScalars`.

The optimizers keep their prepared buckets in their plans. The entry points that receive lists
per call (the apex ops, the compiled op, the functional API) reuse them through
:func:`prepared`: a small cache of buckets, each found by the op, the chunk size and the identity
of every state tensor, so a loop that calls an op on the same tensors each step prepares its
bucket once (the Triton backend's pointer tables, the NPU's flat buffers). A hit costs one
identity pass over the lists and, for the Triton buckets, one ``data_ptr`` per tensor (a tensor
re-pointed by ``t.data = new`` keeps its identity: its bucket is then bound or prepared
again). The cache holds the tensors of its last :data:`CACHE_SIZE` buckets; :func:`clear_cache`
lets them go.
"""
from __future__ import annotations

import collections
import threading
from typing import Dict, Hashable, List, Optional, Sequence

import torch

from . import rules, schema, tensor_facts, validation
from .bucketing import group_indices
from .backends import registry

CACHE_SIZE = 16

_cache: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_cache_lock = threading.Lock()
_noop_flags: Dict[torch.device, torch.Tensor] = {}


def noop_flag(device: torch.device) -> torch.Tensor:
    """The zero ``noop_flag`` of ``device`` for callers that never ask a kernel to set it (the
    optimizers, the functional API, the compiled op): one per device, made once."""
    flag = _noop_flags.get(device)
    if flag is None:
        flag = _noop_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def bucket_key(param: torch.Tensor, grad: torch.Tensor, *, master: bool, step: Optional[int] = None,
               layout: Optional[Hashable] = None) -> tuple:
    """The bucket a row goes to: one engine call runs rows of one key.

    ``step``: the param's step count (None where steps are read when the op runs, as in the
    compiled op, which splits by step itself); ``layout``: a DTensor's ``(mesh, placements)``,
    so that one bucket's local shards are cut alike.
    """
    return (param.device, param.dtype, grad.dtype, bool(master), step, layout)


def split_buckets(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  masters: Sequence[bool], steps: Optional[Sequence[int]] = None,
                  layouts: Optional[Sequence[Hashable]] = None) -> Dict[tuple, List[int]]:
    """Rows split into buckets, for every entry point: ``{bucket_key: [row indices]}``, keys in
    order of first appearance and rows in order (bucket order never changes a result: the
    update is elementwise). Row ``i`` is ``params[i]``, ``grads[i]``, whether it has master
    weights (``masters[i]``), its step count and shard layout (:func:`bucket_key`; None: the
    key leaves them out)."""
    n = len(params)
    steps = [None] * n if steps is None else steps
    layouts = [None] * n if layouts is None else layouts
    return group_indices(bucket_key(p, g, master=m, step=s, layout=lay)
                         for p, g, m, s, lay in zip(params, grads, masters, steps, layouts))


def _state_of(lists: schema.AdamLists) -> list:
    return [tensors for name, tensors in lists.present() if name != "grads"]


def _cached(backend, spec: schema.OpSpec, lists: schema.AdamLists, chunk_size: int,
            once: bool):
    """``(key, the cached bucket or None)``. The key is cheap (the backend, the op, the chunk
    size, the lists' form, the number of rows, the first and last params' ids); a hit is the entry
    made from these very state tensors, compared by identity, at C speed (one pass, no tensor
    compared by value). The entry holds its tensors, so no other object can take those
    ids while it is cached."""
    params = lists.params
    key = (backend.name, spec.name, chunk_size, once, lists.has_master, lists.has_remainder,
           len(params),
           id(params[0]) if params else None, id(params[-1]) if params else None)
    with _cache_lock:
        entry = _cache.get(key)
        if entry is not None:
            _cache.move_to_end(key)
    if entry is None:
        return key, None
    bucket, held = entry
    state = _state_of(lists)
    if len(state) != len(held) or not all(
            tensor_facts.same_objects(a, b) for a, b in zip(state, held)):
        return key, None
    return key, bucket


def prepared(spec: schema.OpSpec, lists: schema.AdamLists, backend, chunk_size: int,
             once: bool = True):
    """A prepared bucket of checked ``lists`` (grads bound), reused across calls on the same
    state tensors. ``once``: the caller's tensors must stay where they are (see
    :meth:`Backend.prepare_bucket`)."""
    key, bucket = _cached(backend, spec, lists, chunk_size, once)
    # the steady state: the cached bucket binds (its state where it was bound, the grads fit),
    # nothing rebuilt
    if bucket is None or not bucket.bind(lists.grads):
        bucket = backend.prepare_bucket(spec.name, lists.state(), chunk_size, once)
        if not bucket.bind(lists.grads):
            raise RuntimeError(f"{backend.name}: {spec.name}: lists that passed the op check "
                               f"did not bind")
        with _cache_lock:
            _cache[key] = (bucket, [list(tensors) for tensors in _state_of(lists)])
            _cache.move_to_end(key)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
    return bucket


def backend_for_lists(spec: schema.OpSpec, named) -> Optional[registry.Backend]:
    """The backend that runs checked lists (None when there are no rows).

    ``named``: ``(name, list)`` pairs, the first one fixing the device (the params for the Adam
    family: ``AdamLists.present()`` after the grads; the sources for ``scale``). Tensors without
    real storage (DTensor, meta, fake) only go to a backend that declares it runs them; when
    none does, ``TypeError`` names the tensor.
    """
    named = list(named)
    ref = next((ts for name, ts in named if name == "params"), named[0][1])
    if not ref:
        return None
    device = ref[0].device
    which = validation.storageless([ts for _, ts in named], [name for name, _ in named])
    try:
        return registry.backend_for(spec.name, device, tensor_subclasses=which is not None)
    except NotImplementedError:
        if which is None:
            raise
        raise TypeError(
            f"{spec.api_name}: {which} has no real storage (a DTensor, meta or fake tensor) and "
            f"no registered backend for {device.type} runs such tensors (for a DTensor, pass its "
            f"local shard: t.to_local())") from None


def _device_backend(spec: schema.OpSpec, lists: schema.AdamLists):
    """The backend registered for the params' device (no pass over the tensors), or None."""
    params = lists.params
    if not params or not isinstance(params[0], torch.Tensor):  # (not checked yet)
        return None
    try:
        return registry.backend_for(spec.name, params[0].device)
    except NotImplementedError:
        return None


def unchanged(spec: schema.OpSpec, lists: schema.AdamLists, chunk_size: int, once: bool = True):
    """The cached prepared bucket of ``lists`` when it was made from exactly these tensors and
    they are unchanged (the same grad objects at the same addresses, the params and state
    tensors at the addresses the bucket bound; the bucket keeps the storage it bound alive, so
    an equal address is the same storage), bound to the grads; else None. The checks that made
    it (:func:`multi_tensor.schema.check_adam_lists`) still hold then, so a caller may skip them.
    Only buckets that can tell (``Bucket.bind_unchanged``: the Triton backend's) are found here."""
    backend = _device_backend(spec, lists)
    if backend is None:
        return None
    _, bucket = _cached(backend, spec, lists, chunk_size, once)
    if bucket is None or not bucket.bind_unchanged(lists.grads):
        return None
    return bucket


def bound(spec: schema.OpSpec, lists: schema.AdamLists, chunk_size: int, once: bool = True):
    """The prepared bucket of checked ``lists`` (with rows), grads bound: the cached one when
    it binds them (its bind checks that the params and state are where it bound them and that
    the grads fit), found on the params' device's backend without a pass over every tensor's
    storage kind; else one from :func:`prepared` on the backend that runs them."""
    backend = _device_backend(spec, lists)
    if backend is not None:
        _, bucket = _cached(backend, spec, lists, chunk_size, once)
        if bucket is not None and bucket.bind(lists.grads):
            return bucket
    return prepared(spec, lists, backend_for_lists(spec, lists.present()), chunk_size,
                    once)


def clear_cache() -> None:
    """Drop every cached prepared bucket (and with them the references to their tensors)."""
    with _cache_lock:
        _cache.clear()


def run_adam(spec: schema.OpSpec, lists: schema.AdamLists, hyper: rules.AdamHyper, step: int,
             noop_flag: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
             check_finite: bool = False, chunk_size: int = 2048 * 32,
             checked: bool = False, bucket=None) -> None:
    """One Adam-family call on one bucket's named lists: checked (unless ``checked``: the caller
    checked them already), its backend resolved, a prepared bucket reused or made, run with
    the scalars of update number ``step``. ``bucket``: the bound bucket :func:`unchanged` found
    for these lists."""
    if bucket is None:
        if not checked:
            schema.check_adam_lists(spec, lists)
        if not lists.params:
            return
        bucket = bound(spec, lists, chunk_size)
    bucket.run(noop_flag, rules.step_scalars(hyper, step), grad_scale, bool(check_finite))
