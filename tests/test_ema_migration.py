"""The EMA migration table of docs/migrating.md, row by row, against the update each peer's code
performs.

Each peer's EMA (diffusers ``EMAModel``, timm ``ModelEmaV3``, ema-pytorch ``EMA``, MindSpeed
``FusedEmaAdamW``) is transcribed below from its source into a small float64 reference (the peers
are not installed). Each reference consumes the weights our optimizer produces in a real training
loop, step by step, long enough to cover the warm-up and the start-step boundaries; our decays
(``last_ema_decays``) must equal the reference's exactly, our fp32 EMA (and buffer EMA) must equal
the float64 one within fp32 rounding.

Counting convention used throughout: our optimizer step ``t`` (1 on the first) is the peer's
counter after its increment: diffusers' ``optimization_step``, timm's ``step=num_updates`` (timm's
train.py increments ``num_updates`` before ``update``), ema-pytorch's ``self.step`` (incremented at
the start of ``update()``), MindSpeed's ``num_updates``. The peers' update is called once after
each optimizer step, as their training scripts do.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch

from fused_optim import FusedEmaAdamW, compat

RTOL = ATOL = 2e-6   # fp32 EMA against the float64 recursion


class Net(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 3)
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x)))) + self.frozen


class TanhNet(Net):
    """Net with a tanh before the BatchNorm: no param whose grad is only rounding noise (a bias
    right before a BatchNorm has none), so two runs a rounding apart stay a rounding apart."""

    def forward(self, x):
        return self.head(self.bn(torch.tanh(self.lin(x)))) + self.frozen


def batch(t):
    gen = torch.Generator().manual_seed(1000 + t)
    return torch.randn(16, 4, generator=gen) * 2 + 0.5


def train_step(model, opt, t):
    opt.zero_grad()
    model(batch(t)).square().mean().backward()
    opt.step()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def f64(t):
    return t.detach().to(torch.float64).clone() if t.is_floating_point() else t.detach().clone()


def assert_close(ours, ref, what):
    torch.testing.assert_close(ours.detach().to(torch.float64), ref, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


# --- transcriptions of the peers' EMA code (float64) -------------------------------------------
class DiffusersEMAModel:
    """diffusers.training_utils.EMAModel: __init__ defaults, get_decay and step (foreach=False)."""

    def __init__(self, parameters, decay=0.9999, min_decay=0.0, update_after_step=0,
                 use_ema_warmup=False, inv_gamma=1.0, power=2 / 3):
        parameters = list(parameters)
        self.shadow_params = [f64(p) for p in parameters]
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_ema_warmup, self.inv_gamma, self.power = use_ema_warmup, inv_gamma, power
        self.optimization_step = 0
        self.cur_decay_value = None

    def get_decay(self, optimization_step):
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            cur_decay_value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            cur_decay_value = (1 + step) / (10 + step)
        cur_decay_value = min(cur_decay_value, self.decay)
        cur_decay_value = max(cur_decay_value, self.min_decay)
        return cur_decay_value

    def step(self, parameters):
        parameters = list(parameters)
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        one_minus_decay = 1 - decay
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - f64(param)))
            else:
                s_param.copy_(f64(param))


class TimmModelEmaV3:
    """timm.utils.model_ema.ModelEmaV3: get_decay, apply_update_ / apply_update_no_buffers_."""

    def __init__(self, model, decay=0.9999, min_decay=0.0, update_after_step=0, use_warmup=False,
                 warmup_gamma=1.0, warmup_power=2 / 3, exclude_buffers=False):
        self.state = OrderedDict((k, f64(v)) for k, v in model.state_dict().items())  # deepcopy
        self.param_names = {name for name, _ in model.named_parameters()}
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_warmup, self.warmup_gamma, self.warmup_power = use_warmup, warmup_gamma, warmup_power
        self.exclude_buffers = exclude_buffers
        self.last_decay = None

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            decay = max(min(decay, self.decay), self.min_decay)
        else:
            decay = self.decay
        return decay

    def update(self, model, step=None):
        decay = self.last_decay = self.get_decay(step)
        for name, model_v in model.state_dict().items():
            ema_v = self.state[name]
            if self.exclude_buffers and name not in self.param_names:
                ema_v.copy_(f64(model_v))                       # buffers copied
            elif ema_v.is_floating_point():
                ema_v.lerp_(f64(model_v), 1.0 - decay)          # lerp, weight 1 - decay
            else:
                ema_v.copy_(model_v)


class EmaPytorchEMA:
    """ema_pytorch.EMA: __init__ defaults, update() with its step counter, get_current_decay and
    update_moving_average (float params and float buffers; other buffers are not tracked)."""

    def __init__(self, model, beta=0.9999, update_after_step=100, update_every=10, inv_gamma=1.0,
                 power=2 / 3, min_value=0.0, param_or_buffer_names_no_ema=(), ignore_names=(),
                 update_model_with_ema_every=None):
        self.model = model
        self.ema = OrderedDict((n, f64(p)) for n, p in model.named_parameters() if p.is_floating_point())
        self.buffer_names = {n for n, b in model.named_buffers() if b.is_floating_point()}
        self.ema.update((n, f64(b)) for n, b in model.named_buffers() if n in self.buffer_names)
        self.initial = {n: f64(b) for n, b in model.named_buffers() if n not in self.buffer_names}
        self.beta, self.update_after_step, self.update_every = beta, update_after_step, update_every
        self.inv_gamma, self.power, self.min_value = inv_gamma, power, min_value
        self.no_ema, self.ignore_names = set(param_or_buffer_names_no_ema), set(ignore_names)
        self.update_model_with_ema_every = update_model_with_ema_every
        self.initted = False
        self.step = 0
        self.last_decay = None        # None: no EMA change at this call; 0.0: a copy

    def live(self):
        named = dict(self.model.named_parameters())
        named.update(self.model.named_buffers())
        return {n: named[n] for n in self.ema}

    def copy_params_from_model_to_ema(self):
        for n, v in self.live().items():
            self.ema[n].copy_(f64(v))

    def get_current_decay(self):
        epoch = max(self.step - self.update_after_step - 1, 0)       # self.step already incremented
        value = 1 - (1 + epoch / self.inv_gamma) ** -self.power
        if epoch <= 0:
            return 0.0
        return min(max(value, self.min_value), self.beta)             # clamp(min, max)

    def update(self):
        step = self.step
        self.step += 1
        self.last_decay = None
        if not self.initted:
            self.copy_params_from_model_to_ema()
            self.initted = True
            self.last_decay = 0.0
            return
        should_update = step % self.update_every == 0
        if should_update and step <= self.update_after_step:
            self.copy_params_from_model_to_ema()
            self.last_decay = 0.0
            return
        if should_update:
            decay = self.last_decay = self.get_current_decay()
            for n, v in self.live().items():
                if n in self.ignore_names:
                    continue
                if n in self.no_ema:
                    self.ema[n].copy_(f64(v))
                else:
                    self.ema[n].lerp_(f64(v), 1.0 - decay)
        every = self.update_model_with_ema_every
        if every is not None and step % every == 0:                   # beta 0: copy into the model
            with torch.no_grad():
                for n, v in self.live().items():
                    v.copy_(self.ema[n])


class MindSpeedEma:
    """MindSpeed FusedEmaAdamW's EMA: one optimizer-wide num_updates, incremented at every step()
    before use; ema_params created from the param at its first step; s = d * s + (1 - d) * p."""

    def __init__(self, ema_decay=0.9999, use_num_updates=True):
        self.ema_decay = ema_decay
        self.num_updates = 0 if use_num_updates else -1
        self.ema_params = {}
        self.last_decay = None

    def step(self, before, after):
        """``before``/``after``: the params with grads, before and after the optimizer step."""
        ema_decay = self.ema_decay
        if self.num_updates >= 0:
            self.num_updates += 1
            ema_decay = min(self.ema_decay, (1 + self.num_updates) / (10 + self.num_updates))
        self.last_decay = ema_decay
        for key, (b, a) in enumerate(zip(before, after)):
            s = self.ema_params.setdefault(key, f64(b))
            s.copy_(ema_decay * s + (1 - ema_decay) * f64(a))


# --- diffusers EMAModel --------------------------------------------------------------------------
DIFFUSERS_ROWS = [
    # (EMAModel kwargs, our kwargs)
    (dict(), dict(ema_decay=0.9999, ema_schedule="diffusers")),                       # defaults
    (dict(decay=0.8, update_after_step=5, min_decay=0.3),     # min binds at k = 1, 2; cap at 35
     dict(ema_decay=0.8, ema_schedule="diffusers", ema_start_step=5, ema_min_decay=0.3)),
    (dict(decay=0.9, inv_gamma=3.0, power=1.0),          # inv_gamma/power unused without warm-up
     dict(ema_decay=0.9, ema_schedule="diffusers", ema_inv_gamma=3.0, ema_power=1.0)),
    (dict(use_ema_warmup=True),
     dict(ema_decay=0.9999, ema_schedule="diffusers_warmup")),
    (dict(use_ema_warmup=True, decay=0.9, update_after_step=4, inv_gamma=2.0, power=0.75,
          min_decay=0.3),                                    # min binds at k = 1; cap at k = 41
     dict(ema_decay=0.9, ema_schedule="diffusers_warmup", ema_start_step=4, ema_inv_gamma=2.0,
          ema_power=0.75, ema_min_decay=0.3)),
]


@pytest.mark.parametrize("peer_kw,our_kw", DIFFUSERS_ROWS)
def test_diffusers_ema_model(peer_kw, our_kw, backend):
    model = Net()
    opt = FusedEmaAdamW(trainable(model), lr=2e-2, **our_kw)
    ema = DiffusersEMAModel(model.parameters(), **peer_kw)     # frozen params included, as usual
    for t in range(1, 51):
        train_step(model, opt, t)
        ema.step(model.parameters())
        assert opt.last_ema_decays == {(0, t): ema.cur_decay_value}, t
    names = [n for n, _ in model.named_parameters()]
    sd = opt.ema_state_dict(model)    # what EMAModel.copy_to / save_pretrained would write
    for name, shadow in zip(names, ema.shadow_params):
        assert_close(sd[name], shadow, name)
    assert torch.equal(sd["frozen"], model.frozen)             # diffusers copies frozen params
    # the step counter is in the state dict like diffusers' optimization_step
    assert int(opt.state_dict()["state"][0]["step"]) == ema.optimization_step


# --- timm ModelEmaV3 -----------------------------------------------------------------------------
TIMM_ROWS = [
    # (ModelEmaV3 kwargs, update() passes step=t, our kwargs)
    (dict(), False, dict(ema_decay=0.9999)),                                          # defaults
    (dict(decay=0.8), False, dict(ema_decay=0.8)),
    (dict(decay=0.8, update_after_step=6, min_decay=0.5), False,  # step=None ignores both
     dict(ema_decay=0.8)),
    (dict(decay=0.8, update_after_step=6, min_decay=0.5), True,   # min_decay: warm-up only
     dict(ema_decay=0.8, ema_schedule="constant", ema_start_step=7)),
    (dict(decay=0.8), True, dict(ema_decay=0.8, ema_start_step=1)),
    (dict(use_warmup=True), True, dict(ema_decay=0.9999, ema_schedule="diffusers_warmup")),
    (dict(use_warmup=True, decay=0.85, update_after_step=5, warmup_gamma=2.0, warmup_power=0.75,
          min_decay=0.3), True,                              # min binds at k = 1; cap at k = 23
     dict(ema_decay=0.85, ema_schedule="diffusers_warmup", ema_start_step=5, ema_inv_gamma=2.0,
          ema_power=0.75, ema_min_decay=0.3)),
]


@pytest.mark.parametrize("exclude_buffers", [False, True])
@pytest.mark.parametrize("peer_kw,with_step,our_kw", TIMM_ROWS)
def test_timm_model_ema_v3(peer_kw, with_step, our_kw, exclude_buffers, backend):
    model = Net()
    model_ema = TimmModelEmaV3(model, exclude_buffers=exclude_buffers, **peer_kw)
    opt = FusedEmaAdamW(trainable(model), lr=2e-2, **our_kw)
    if not exclude_buffers:
        opt.register_ema_buffers(model)      # timm averages float buffers, copies the others
    for t in range(1, 41):
        train_step(model, opt, t)
        model_ema.update(model, step=t if with_step else None)
        assert opt.last_ema_decays == {(0, t): model_ema.last_decay}, t
    sd = opt.ema_state_dict(model)           # = model_ema.module.state_dict()
    assert list(sd) == list(model_ema.state)
    for name, ref in model_ema.state.items():
        if ref.is_floating_point():
            assert_close(sd[name], ref, name)
        else:
            assert torch.equal(sd[name], ref), name
    if exclude_buffers:                      # buffers: copies of the model's
        for name, buf in model.named_buffers():
            assert torch.equal(sd[name], buf)


# --- ema-pytorch EMA ---------------------------------------------------------------------------
EMA_PYTORCH_ROWS = [
    # (EMA kwargs, our kwargs)
    (dict(),                                                  # defaults: update_every=10
     dict(ema_decay=0.9999, ema_schedule="diffusers_warmup", ema_start_step=100,
          ema_update_every=10)),
    (dict(update_every=1),
     dict(ema_decay=0.9999, ema_schedule="diffusers_warmup", ema_start_step=100)),
    (dict(update_every=3, beta=0.9, update_after_step=4),
     dict(ema_decay=0.9, ema_schedule="diffusers_warmup", ema_start_step=4, ema_update_every=3)),
    (dict(update_every=1, beta=0.85, update_after_step=5, inv_gamma=2.0, power=0.75, min_value=0.3),
     dict(ema_decay=0.85, ema_schedule="diffusers_warmup", ema_start_step=5, ema_inv_gamma=2.0,
          ema_power=0.75, ema_min_decay=0.3)),                # min binds at k = 1; cap at k = 23
    (dict(update_every=1, beta=0.9, update_after_step=0),
     dict(ema_decay=0.9, ema_schedule="diffusers_warmup")),
]


@pytest.mark.parametrize("peer_kw,our_kw", EMA_PYTORCH_ROWS)
def test_ema_pytorch_ema(peer_kw, our_kw, backend):
    steps = peer_kw.get("update_after_step", 100) + 40
    model = Net()
    ema = EmaPytorchEMA(model, **peer_kw)
    opt = FusedEmaAdamW(trainable(model), lr=1e-2, **our_kw)
    opt.register_ema_buffers(model)          # ema-pytorch averages float buffers too
    for t in range(1, steps + 1):
        train_step(model, opt, t)
        ema.update()
        assert ema.step == t
        expected = {} if ema.last_decay is None else {(0, t): ema.last_decay}
        assert opt.last_ema_decays == expected, t
    sd = opt.ema_state_dict(model)           # = ema.ema_model.state_dict() for tracked entries
    for name, ref in ema.ema.items():
        assert_close(sd[name], ref, name)
    # non-float buffers: ema-pytorch leaves its EMA model's copy at the value it was deep-copied
    # with; ours is a copy of the live buffer taken at every step that updates the EMA (timm's
    # behaviour), here the last of 1, 1 + k, 1 + 2k, ... (one forward per step)
    assert int(ema.initial["bn.num_batches_tracked"]) == 0
    last_update = steps - (steps - 1) % our_kw.get("ema_update_every", 1)
    assert int(model.bn.num_batches_tracked) == steps
    assert int(sd["bn.num_batches_tracked"]) == last_update


def test_ema_pytorch_decays_are_fp32_evaluations_of_the_same_formula():
    """ema-pytorch evaluates get_current_decay on its int64 ``step`` buffer, in fp32 tensors:
    its actual decays are the same formula within a few fp32 ulps, not bit-identical to ours."""
    for beta, after, inv_gamma, power, min_value in ((0.9999, 100, 1.0, 2 / 3, 0.0),
                                                     (0.95, 5, 2.0, 0.75, 0.2)):
        opt = FusedEmaAdamW([torch.nn.Parameter(torch.zeros(1))], ema_decay=beta,
                            ema_schedule="diffusers_warmup", ema_start_step=after,
                            ema_inv_gamma=inv_gamma, ema_power=power, ema_min_decay=min_value)
        for t in range(after + 2, after + 5000, 37):
            step = torch.tensor(t)                              # ema-pytorch's code, verbatim
            epoch = (step - after - 1).clamp(min=0.)
            value = 1 - (1 + epoch / inv_gamma) ** - power
            theirs = value.clamp(min=min_value, max=beta).item()
            ours = opt.ema_decay_at(t)
            assert abs(theirs - ours) <= 2e-7
            if ours == beta:
                assert theirs == torch.tensor(beta, dtype=torch.float32).item()


def test_ema_pytorch_param_or_buffer_names_no_ema_for_params():
    """``param_or_buffer_names_no_ema`` for params: a param group with ema_decay=0.0 (constant)."""
    model = Net()
    ema = EmaPytorchEMA(model, update_every=1, update_after_step=3, beta=0.9,
                        param_or_buffer_names_no_ema={"head.bias"})
    rest = [p for n, p in model.named_parameters() if p.requires_grad and n != "head.bias"]
    opt = FusedEmaAdamW([{"params": rest},
                         {"params": [model.head.bias], "ema_decay": 0.0, "ema_schedule": None}],
                        lr=1e-2, ema_decay=0.9, ema_schedule="diffusers_warmup", ema_start_step=3)
    opt.register_ema_buffers(model)
    for t in range(1, 16):
        train_step(model, opt, t)
        ema.update()
        assert opt.last_ema_decays[(0, t)] == ema.last_decay
    sd = opt.ema_state_dict(model)
    for name, ref in ema.ema.items():
        assert_close(sd[name], ref, name)
    assert_close(sd["head.bias"], f64(model.head.bias), "head.bias is copied")


def test_ema_pytorch_update_model_with_ema_every_with_beta_zero():
    """``update_model_with_ema_every=N`` (``update_model_with_ema_beta=0``): ``opt.copy_ema_to()``
    after steps 1 + N, 1 + 2N, ... (ema-pytorch tests its 0-based pre-increment step; its first
    ``update()`` only initialises)."""
    every = 4
    model, twin = TanhNet(), TanhNet()
    ema = EmaPytorchEMA(twin, update_every=1, update_after_step=2, beta=0.9,
                        update_model_with_ema_every=every)
    opt = FusedEmaAdamW(trainable(model), lr=1e-2, ema_decay=0.9, ema_schedule="diffusers_warmup",
                        ema_start_step=2)
    opt.register_ema_buffers(model)
    twin_opt = FusedEmaAdamW(trainable(twin), lr=1e-2, ema_decay=0.5)   # the same AdamW steps
    for t in range(1, 20):
        train_step(model, opt, t)
        train_step(twin, twin_opt, t)
        if t > 1 and (t - 1) % every == 0:
            opt.copy_ema_to()               # params (and their masters) and registered buffers
        ema.update()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_close(p, f64(q), f"t={t} {name}")
        for name, b in model.named_buffers():
            if b.is_floating_point():
                assert_close(b, f64(twin.get_buffer(name)), f"t={t} {name}")
    sd = opt.ema_state_dict(model)
    for name, ref in ema.ema.items():
        assert_close(sd[name], ref, name)


# --- MindSpeed FusedEmaAdamW ---------------------------------------------------------------------
def train_beside_mindspeed(model, params, opt, ema, steps):
    """Our steps, MindSpeed's EMA fed each step's params before and after: the decays agree
    at every step, the EMAs at the end."""
    for t in steps:
        before = [p.detach().clone() for p in params]
        train_step(model, opt, t)
        ema.step(before, params)
        assert opt.last_ema_decays == {(0, t): ema.last_decay}, t
    for i, p in enumerate(params):
        assert_close(opt.state[p]["ema"], ema.ema_params[i], f"param {i}")


@pytest.mark.parametrize("peer_kw,our_kw", [
    (dict(), dict(ema_decay=0.9999, ema_schedule="warmup")),                          # defaults
    (dict(ema_decay=0.8), dict(ema_decay=0.8, ema_schedule="warmup")),   # cap from n = 35
    (dict(ema_decay=0.95, use_num_updates=False), dict(ema_decay=0.95)),
])
def test_mindspeed_fused_ema_adamw(peer_kw, our_kw, backend):
    model = Net()
    params = trainable(model)
    opt = FusedEmaAdamW(params, lr=1e-2, **our_kw)
    ema = MindSpeedEma(**peer_kw)
    train_beside_mindspeed(model, params, opt, ema, range(1, 61))


def test_mindspeed_step_matches_its_operator_loop():
    """MindSpeed's step() over its per-tensor operator (this package's npu_apply_fused_ema_adamw,
    the same contract) against FusedEmaAdamW(ema_schedule="warmup"): params and EMA."""
    from fused_optim import npu_apply_fused_ema_adamw

    model, twin = Net(), Net()
    opt = FusedEmaAdamW(trainable(model), lr=1e-2, weight_decay=1e-2, ema_decay=0.9999,
                        ema_schedule="warmup")
    params = trainable(twin)
    state = {}
    num_updates, group_step = 0, 0
    for t in range(1, 31):
        train_step(model, opt, t)
        for p in params:
            p.grad = None
        twin(batch(t)).square().mean().backward()
        num_updates += 1                                       # MindSpeed's step(), transcribed
        ema_decay = min(0.9999, (1 + num_updates) / (10 + num_updates))
        group_step += 1
        with torch.no_grad():
            for i, p in enumerate(params):
                st = state.setdefault(i, dict(exp_avg=torch.zeros_like(p),
                                              exp_avg_sq=torch.zeros_like(p),
                                              ema_params=p.detach().clone()))
                npu_apply_fused_ema_adamw(p.grad, p, st["exp_avg"], st["exp_avg_sq"],
                                          st["ema_params"], torch.tensor([group_step]), 1e-2,
                                          ema_decay, 0.9, 0.999, 1e-8, 1, True, 1e-2)
    for i, (p, q) in enumerate(zip(trainable(model), params)):
        assert_close(p, f64(q), f"param {i}")
        assert_close(opt.state[p]["ema"], f64(state[i]["ema_params"]), f"ema {i}")


def test_mindspeed_resume_restarts_num_updates():
    """MindSpeed does not save num_updates: a resumed run warms up again from n = 1. Ours
    continues; ``set_ema_schedule(ema_start_step=<step at resume>)`` after loading reproduces
    MindSpeed's restart (as ``compat.load_torch_state_dict(..., restart_ema_schedule=True)``)."""
    model = Net()
    params = trainable(model)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.999, ema_schedule="warmup")
    ema = MindSpeedEma(ema_decay=0.999)
    train_beside_mindspeed(model, params, opt, ema, range(1, 11))
    saved = copy.deepcopy(opt.state_dict())
    resumed = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.999, ema_schedule="warmup")
    resumed.load_state_dict(saved)
    resumed.set_ema_schedule(ema_start_step=10)
    ema.num_updates = 0                                   # a new MindSpeed optimizer object
    train_beside_mindspeed(model, params, resumed, ema, range(11, 31))
    # the compat helper does the same for a torch state dict
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    torch_opt.load_state_dict(resumed.torch_state_dict())
    fresh = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.999, ema_schedule="warmup")
    compat.load_torch_state_dict(fresh, torch_opt.state_dict(), restart_ema_schedule=True)
    assert fresh.param_groups[0]["ema_start_step"] == 30
