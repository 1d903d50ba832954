"""torch.compile: a compiled step has no graph break and gives an eager step's bits.

The step reaches the compiler as one custom op per bucket (``torch.ops.fused_optim.adam_step_``,
fused_optim/custom_ops.py) with the state prepared by ``_init_group`` (fused_optim/compiled.py).
Most tests compile with backend="eager" (dynamo only: the traced graph is what is under test);
one compiles with inductor. Features the traced step cannot take fall back to the eager step
behind one graph break, which ``fullgraph=True`` reports naming the feature.
"""
from __future__ import annotations

import pytest
import torch

from fused_optim import FusedAdam, FusedAdamW, FusedEmaAdamW, FusedRAdam

STEPS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles afresh (the step's code object is shared by every optimizer, and
    leftover cache entries would count against dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16).to(dtype)
        self.b = torch.nn.Linear(16, 4).to(dtype)
        self.frozen_grad_at = None   # a step at which b.bias gets no grad

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Graphs:
    """A dynamo backend that keeps every graph it is given and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_calls(self):
        op = torch.ops.fused_optim.adam_step_
        return sum(node.target in (op, op.default) for gm in self.graphs for node in gm.graph.nodes)


def batch(t):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(t))


def backward(model, opt, t, autocast=False):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(batch(t).to(next(model.parameters()).dtype))
    out.float().square().mean().backward()
    if model.frozen_grad_at == t:
        model.b.bias.grad = None


def step_both(eager_model, eager_opt, model, opt, step, t, autocast=False):
    """Step ``t`` of the eager pair with ``eager_opt.step()`` and of the other with ``step``."""
    backward(eager_model, eager_opt, t, autocast)
    eager_opt.step()
    backward(model, opt, t, autocast)
    step()


def assert_same(opt_a, model_a, opt_b, model_b):
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sorted(sa) == sorted(sb), name
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, (name, key)
            assert torch.equal(sa[key], sb[key]), (name, key)


# (id, optimizer factory, param dtype, autocast forward)
CASES = [
    ("ema_adamw_fp32", lambda ps: FusedEmaAdamW(ps, lr=1e-2, ema_decay=0.9), torch.float32, False),
    ("ema_adamw_bf16_masters", lambda ps: FusedEmaAdamW(ps, lr=1e-2, ema_decay=0.9),
     torch.bfloat16, False),
    ("ema_adamw_autocast", lambda ps: FusedEmaAdamW(ps, lr=1e-2, weight_decay=0.1, ema_decay=0.9,
                                                    ema_schedule="warmup", ema_start_step=2),
     torch.float32, True),
    ("ema_adam_l2_maximize", lambda ps: FusedEmaAdamW(ps, lr=1e-2, adam_w_mode=False,
                                                      weight_decay=0.1, maximize=True,
                                                      ema_schedule="diffusers"),
     torch.float32, False),
    ("adamw_bf16_masters", lambda ps: FusedAdamW(ps, lr=1e-2), torch.bfloat16, False),
    ("adam_bf16_no_masters", lambda ps: FusedAdam(ps, lr=1e-2, bias_correction=False),
     torch.bfloat16, False),
    ("ema_every_3_bf16_ema", lambda ps: FusedEmaAdamW(ps, lr=1e-2, ema_decay=0.5,
                                                      ema_update_every=3,
                                                      ema_dtype=torch.bfloat16),
     torch.float32, False),
    ("radam_ema", lambda ps: FusedRAdam(ps, lr=1e-2, ema_decay=0.9,
                                        decoupled_weight_decay=True, weight_decay=0.1),
     torch.float32, False),
]


@pytest.mark.parametrize("make,dtype,autocast", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_compiled_steps_equal_eager_steps(make, dtype, autocast):
    """N compiled steps (fullgraph, compiled once) give the eager steps' params, state and EMA."""
    eager_model, model = Net(dtype), Net(dtype)
    eager_opt, opt = make(eager_model.parameters()), make(model.parameters())
    graphs = Graphs()
    compiled = torch.compile(opt.step, backend=graphs, fullgraph=True)
    for t in range(1, STEPS + 1):
        step_both(eager_model, eager_opt, model, opt, compiled, t, autocast)
    assert_same(eager_opt, eager_model, opt, model)
    assert len(graphs.graphs) == 1 and graphs.op_calls() == 1  # one bucket: one op; compiled once


def test_no_graph_break_and_one_op_per_bucket():
    model = Net()
    model.b.to(torch.bfloat16)  # two buckets: fp32 and bf16 (with masters)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    explained = torch._dynamo.explain(opt.step)()
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert explained.graphs[0].code.count("torch.ops.fused_optim.adam_step_(") == 2


def test_compiled_train_step():
    """A compiled function that runs forward, backward and step (dynamo breaks the graph at
    backward(), as for any optimizer; the step is traced)."""
    eager_model, model = Net(), Net()
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=1e-2)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    graphs = Graphs()

    @torch.compile(backend=graphs)
    def train(x):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for t in range(1, STEPS + 1):
        backward(eager_model, eager_opt, t)
        eager_opt.step()
        train(batch(t))
    assert_same(eager_opt, eager_model, opt, model)
    assert graphs.op_calls() == 1


def test_inductor_fullgraph():
    eager_model, model = Net(torch.bfloat16), Net(torch.bfloat16)
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=1e-2)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(opt.step, fullgraph=True)
    for t in range(1, 3):
        step_both(eager_model, eager_opt, model, opt, compiled, t)
    assert_same(eager_opt, eager_model, opt, model)


def test_missed_steps_mixed_eager_and_changed_lr():
    """A param that misses a step (its step count differs inside the bucket), eager steps in
    between, and a new lr (a recompile) all keep the eager bits."""
    eager_model, model = Net(), Net()
    eager_model.frozen_grad_at = model.frozen_grad_at = 2
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=1e-2, ema_schedule="warmup")
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, ema_schedule="warmup")
    compiled = torch.compile(opt.step, backend="eager", fullgraph=True)
    for t, how in enumerate(("compiled", "compiled", "compiled", "eager", "compiled", "lr",
                             "eager"), 1):
        if how == "lr":
            for o in (eager_opt, opt):
                o.param_groups[0]["lr"] = 3e-3
        backward(eager_model, eager_opt, t)
        eager_opt.step()
        backward(model, opt, t)
        opt.step() if how == "eager" else compiled()
    assert_same(eager_opt, eager_model, opt, model)
    assert int(opt.state[model.b.bias]["step"]) == 6
    assert int(opt.state[model.a.bias]["step"]) == 7


def test_tensor_lr_changes_without_recompiling():
    eager_model, model = Net(), Net()
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=torch.tensor(1e-2))
    opt = FusedEmaAdamW(model.parameters(), lr=torch.tensor(1e-2))
    graphs = Graphs()
    compiled = torch.compile(opt.step, backend=graphs, fullgraph=True)
    for t in range(1, STEPS + 1):
        for o in (eager_opt, opt):   # as an LR scheduler updates a tensor lr: in place
            o.param_groups[0]["lr"].fill_(1e-2 / t)
        step_both(eager_model, eager_opt, model, opt, compiled, t)
    assert_same(eager_opt, eager_model, opt, model)
    assert len(graphs.graphs) == 1


def test_grad_scaler_attributes():
    """GradScaler's grad_scale (unscale in the kernel) and found_inf (skip) as an eager step."""
    eager_model, model = Net(torch.bfloat16), Net(torch.bfloat16)
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=1e-2)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(opt.step, backend="eager", fullgraph=True)
    for t, inf in ((1, 0.0), (2, 1.0), (3, 0.0)):
        for m, o, run in ((eager_model, eager_opt, eager_opt.step), (model, opt, compiled)):
            backward(m, o, t)
            for p in m.parameters():
                p.grad.mul_(1024)
            o.grad_scale = torch.tensor(1024.0)
            o.found_inf = torch.tensor(inf)
            run()
    assert_same(eager_opt, eager_model, opt, model)
    assert int(opt.state[model.a.weight]["step"]) == 2


def test_compiled_model_with_eager_optimizer():
    """torch.compile(model) trains with the optimizer as the eager model does; EMA swap works."""
    eager_model, model = Net(), Net()
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=1e-2, ema_decay=0.9)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, ema_decay=0.9)
    compiled_model = torch.compile(model, backend="aot_eager")
    for t in range(1, STEPS + 1):
        backward(eager_model, eager_opt, t)
        eager_opt.step()
        backward(compiled_model, opt, t)
        opt.step()
    assert_same(eager_opt, eager_model, opt, model)   # aot_eager: the eager model's grads
    x = batch(99)
    with torch.no_grad(), opt.swap_ema_weights():
        ema_out = compiled_model(x)
        assert torch.equal(model.a.weight, opt.state[model.a.weight]["ema"])
    with torch.no_grad():
        assert not torch.equal(compiled_model(x), ema_out)   # the raw weights are back
        opt.copy_ema_to(model)
        assert torch.equal(compiled_model(x), ema_out)


class BNNet(Net):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


# (the feature's name in the fallback's message, optimizer options, model, optimizer setup)
FALLBACKS = [
    ("max_grad_norm", dict(max_grad_norm=0.01), Net, None),
    ("ema_schedule", dict(ema_schedule=lambda n: 0.5), Net, None),
    ("buffer EMA", {}, BNNet, lambda opt, model: opt.register_ema_buffers(model)),
]


@pytest.mark.parametrize("feature,options,net,setup", FALLBACKS, ids=[f[0] for f in FALLBACKS])
def test_untraceable_features_fall_back_to_the_eager_step(feature, options, net, setup):
    eager_model, model = net(), net()
    eager_opt = FusedEmaAdamW(eager_model.parameters(), lr=1e-2, ema_decay=0.9, **options)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, ema_decay=0.9, **options)
    if setup is not None:
        setup(eager_opt, eager_model)
        setup(opt, model)
    backward(eager_model, eager_opt, 1)   # both models run a forward (BatchNorm statistics)
    backward(model, opt, 1)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=feature):
        torch.compile(opt.step, backend="eager", fullgraph=True)()
    assert int(opt.state[model.a.weight].get("step", 0)) == 0  # nothing ran
    compiled = torch.compile(opt.step, backend="eager")  # one graph break, eager step
    for t in range(1, 4):
        step_both(eager_model, eager_opt, model, opt, compiled, t)
    assert_same(eager_opt, eager_model, opt, model)
    for key, value in eager_opt.ema_buffers.items():
        assert torch.equal(value, opt.ema_buffers[key]), key


def test_capturable_runs_the_eager_step_which_raises_on_cpu():
    """capturable=True keeps steps on the device in the eager step; the traced op cannot, so a
    compiled step falls back to the eager one, which raises where it cannot (here: CPU)."""
    model = Net()
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, capturable=True)
    backward(model, opt, 1)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="capturable"):
        torch.compile(opt.step, backend="eager", fullgraph=True)()
    before = model.a.weight.detach().clone()
    with pytest.raises(ValueError, match="capturable=True needs the step counters"):
        torch.compile(opt.step, backend="eager")()
    assert torch.equal(model.a.weight, before)


def test_step_inside_swap_ema_weights_raises():
    model = Net()
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(opt.step, backend="eager")
    backward(model, opt, 1)
    compiled()
    before = model.a.weight.detach().clone()
    with opt.swap_ema_weights():
        with pytest.raises(RuntimeError, match="inside swap_ema_weights"):
            compiled()
    assert torch.equal(model.a.weight, before)


def test_bad_option_raises_while_compiling():
    model = Net()
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    backward(model, opt, 1)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(RuntimeError, match="Invalid learning rate"):
        torch.compile(opt.step, backend="eager", fullgraph=True)()
    assert not opt.state


def _op_samples():
    """One bucket per list form: fp32 with EMA, bf16 with masters and EMA, fp32 Adam, RAdam."""
    def bucket(op, dtype, ema, master, steps=(0.0, 3.0), every=1):
        gen = torch.Generator().manual_seed(0)
        shapes = [(3, 5), (7,)]
        params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        state_dtype = torch.float32 if master else dtype
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        zeros = lambda: [torch.rand(s, generator=gen).to(state_dtype) for s in shapes]  # noqa: E731
        return (op, grads, params, zeros(), zeros(),
                [p.to(state_dtype) for p in params] if ema else [],
                [p.float() for p in params] if master else [],
                [torch.tensor(s) for s in steps], 1e-2, None, 0.9, 0.999, 1e-8, 0.1, True,
                True, False, 0.99 if ema else None, "warmup", 0, 1.0, 2.0 / 3.0, 0.0, every,
                None, None, 65536)
    return [bucket("fused_ema_adamw", torch.float32, True, False),
            bucket("fused_ema_adamw", torch.bfloat16, True, True),
            bucket("adam", torch.float32, False, False),
            bucket("radam_ema", torch.float32, True, False, steps=(9.0, 9.0)),
            bucket("fused_ema_adamw", torch.float32, True, False, steps=(1.0, 1.0), every=3)]


@pytest.mark.parametrize("args", _op_samples(),
                         ids=["ema", "ema_masters", "adam", "radam_ema", "ema_skipped_step"])
def test_opcheck(args):
    """torch.library.opcheck: schema (mutations declared), fake impl, autograd registration,
    and AOT dispatch with dynamic shapes."""
    torch.library.opcheck(torch.ops.fused_optim.adam_step_.default, args)


class _DeviceStepBucket:
    """A prepared bucket that computes the step's scalars on the device (as the Triton
    backend's does)."""

    device_steps = True

    def run_device_step(self, *args, **kwargs):
        raise AssertionError("not run here")


@pytest.mark.parametrize("options, device_steps", [
    ({}, True),
    ({"ema_schedule": "warmup"}, False),      # the decay depends on the step: read on the host
    ({"ema_update_every": 2}, False),
])
def test_compiled_steps_live_where_the_backend_keeps_them(monkeypatch, options, device_steps):
    """init_group puts a bucket's step tensors on the params' device when its backend keeps
    steps there and the decay is step-independent, so the op never reads the steps or
    found_inf on the host (a CPU step with CUDA params would make every GradScaler step sync);
    elsewhere they stay where they are."""
    from fused_optim import compiled
    from multi_tensor import plan

    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = FusedEmaAdamW(params, lr=1e-3, ema_decay=0.99, **options)
    homes = []
    own_step = compiled._own_step
    monkeypatch.setattr(compiled, "_own_step", lambda state, seen, home=None: (
        homes.append(home), own_step(state, seen, home))[1])
    monkeypatch.setattr(plan, "prepared", lambda *a, **k: _DeviceStepBucket())
    buckets = compiled.init_group(opt, *([] for _ in range(8)))
    assert len(buckets) == 1
    assert homes == [params[0].device if device_steps else None] * 2
    # the native backend computes its scalars on the host: steps stay where they are
    monkeypatch.undo()
    opt = FusedEmaAdamW(params, lr=1e-3, ema_decay=0.99, **options)
    steps = []
    compiled.init_group(opt, [], [], [], [], [], [], steps, [])
    assert all(s.device.type == "cpu" for s in steps)


def test_own_step_moves_a_step_to_its_home_and_unshares_it():
    from fused_optim import compiled

    shared = torch.tensor(5.0)
    a, b = {"step": shared}, {"step": shared}
    seen = set()
    sa = compiled._own_step(a, seen, torch.device("meta"))
    sb = compiled._own_step(b, seen, torch.device("meta"))
    assert sa.device.type == sb.device.type == "meta" and sa is not sb
    assert a["step"] is sa and b["step"] is sb and sa.dtype == torch.float32
    c, d = {"step": shared}, {"step": shared}
    seen = set()
    sc, sd = compiled._own_step(c, seen), compiled._own_step(d, seen)
    assert sc is shared and sd is not shared and float(sd) == 5.0
