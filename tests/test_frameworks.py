"""The recipes of docs/recipes.md, run small: Lightning, the Hugging Face Trainer and a plain loop.

Each framework test skips when its package is absent (``tools/bootstrap.sh --test`` installs
them). A framework run is compared with the same plain loop: bit for bit where the framework does
nothing but call ``step()`` (same grads, same order), to float rounding against torch's AdamW.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from fused_optim import FusedEmaAdamW
from seed_reference import assert_bitwise_equal, assert_close64

BATCH, EPOCH_BATCHES = 16, 4


def _net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def _data(seed=1, n=BATCH * EPOCH_BATCHES):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return x, (x[:, :1] * 3.0 + torch.randn(n, 1, generator=gen)) * 4.0  # large grads: clipping acts


def _loader(seed=1):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(seed)), batch_size=BATCH)


def _opt(params, **kw):
    return FusedEmaAdamW(params, lr=1e-2, weight_decay=0.01, ema_decay=0.9, **kw)


def _plain_loop(make_opt, epochs, *, autocast=None, clip=None, scaler=None, dtype=torch.float32):
    """The loop a framework runs: forward (under autocast), backward, clip, step."""
    net = _net(dtype=dtype)
    opt = make_opt(net.parameters())
    norms = []
    for _ in range(epochs):
        for x, y in _loader():
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = F.mse_loss(net(x.to(dtype)), y.to(dtype))
            (scaler.scale(loss) if scaler else loss).backward()
            if clip is not None:
                if scaler:
                    scaler.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return net, opt, norms


def _assert_same(net_a, opt_a, net_b, opt_b, what):
    for i, (p, q) in enumerate(zip(net_a.parameters(), net_b.parameters())):
        assert_bitwise_equal(p, q, f"{what}: param {i}")
        for key, value in opt_b.state[q].items():
            assert_bitwise_equal(opt_a.state[p][key], value, f"{what}: state[{i}][{key!r}]")


# ---------------------------------------------------------------------------------------------
# Lightning

@functools.lru_cache(maxsize=None)
def _lightning():
    L = pytest.importorskip("lightning.pytorch")

    class Regressor(L.LightningModule):
        def __init__(self, make_opt=_opt, dtype=torch.float32):
            super().__init__()
            self.net = _net(dtype=dtype)
            self.make_opt = make_opt
            self.val_losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x.to(self.dtype)), y.to(self.dtype))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_losses.append(F.mse_loss(self.net(x), y).detach().clone())

        def configure_optimizers(self):
            return self.make_opt(self.parameters())

    class EmaValidation(L.Callback):
        """Validate with the EMA weights: swapped in for the validation loop, restored after."""

        def on_validation_epoch_start(self, trainer, pl_module):
            self._swap = trainer.optimizers[0].swap_ema_weights()
            self._swap.__enter__()

        def on_validation_epoch_end(self, trainer, pl_module):
            self._swap.__exit__(None, None, None)

    return L, Regressor, EmaValidation


def _fit(module, epochs, tmp_path, val=False, ckpt_path=None, **trainer_kw):
    L = _lightning()[0]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path), **trainer_kw)
    trainer.fit(module, _loader(), _loader(seed=2) if val else None, ckpt_path=ckpt_path)
    return trainer


def test_lightning_fp32_matches_plain_loop_and_torch_adamw(tmp_path):
    _, Regressor, _ = _lightning()
    module = Regressor()
    trainer = _fit(module, 3, tmp_path)
    opt = trainer.optimizers[0]
    net, ref_opt, _ = _plain_loop(_opt, 3)
    _assert_same(module.net, opt, net, ref_opt, "Lightning vs plain loop")
    # torch's AdamW with the same hyperparameters: the same trajectory to float rounding
    torch_net, _, _ = _plain_loop(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False), 3)
    for p, q, p0 in zip(module.net.parameters(), torch_net.parameters(), _net().parameters()):
        assert_close64(p, q, rtol=1e-5, atol=1e-6, msg="Lightning + FusedEmaAdamW vs torch AdamW")
        assert (p - p0).abs().max() > 1e-2  # it trained
    assert int(opt.state[next(module.parameters())]["step"]) == 3 * EPOCH_BATCHES


def test_lightning_bf16_mixed_gradient_clip_val_with_fused_unscale_off(tmp_path):
    """Lightning clips the grads itself (``gradient_clip_val``): ``fused_unscale=False``."""
    _, Regressor, _ = _lightning()
    make_opt = functools.partial(_opt, fused_unscale=False)
    module = Regressor(make_opt)
    trainer = _fit(module, 2, tmp_path, precision="bf16-mixed", gradient_clip_val=0.5)
    net, ref_opt, norms = _plain_loop(make_opt, 2, autocast=torch.bfloat16, clip=0.5)
    assert min(norms) > 0.5  # every step was clipped
    _assert_same(module.net, trainer.optimizers[0], net, ref_opt, "Lightning clip vs plain clip")


def test_lightning_refuses_gradient_clip_val_with_fused_unscale_use_max_grad_norm(tmp_path):
    """With the fused unscale (the default) Lightning refuses ``gradient_clip_val`` under mixed
    precision, as for torch's ``AdamW(fused=True)``; ``max_grad_norm=`` clips inside the step."""
    _, Regressor, _ = _lightning()
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Regressor(), 1, tmp_path, precision="bf16-mixed", gradient_clip_val=0.5)
    make_opt = functools.partial(_opt, max_grad_norm=0.5)
    module = Regressor(make_opt)
    trainer = _fit(module, 2, tmp_path, precision="bf16-mixed")
    net, ref_opt, _ = _plain_loop(make_opt, 2, autocast=torch.bfloat16)
    _assert_same(module.net, trainer.optimizers[0], net, ref_opt, "Lightning max_grad_norm")
    assert float(trainer.optimizers[0].last_grad_norm) > 0.5  # clipping acted
    # the same clip as gradient_clip_val (to float rounding: the factor joins the unscale)
    clipped, _, _ = _plain_loop(_opt, 2, autocast=torch.bfloat16, clip=0.5)
    for p, q in zip(module.net.parameters(), clipped.parameters()):
        assert_close64(p, q, rtol=1e-5, atol=1e-6, msg="max_grad_norm vs clip_grad_norm_")


def test_lightning_fp16_grad_scaler(tmp_path):
    """fp16 autocast with a GradScaler. Lightning turns ``precision="16-mixed"`` on the CPU into
    bf16-mixed, so the test hands it the MixedPrecision plugin with a CPU GradScaler directly."""
    _, Regressor, _ = _lightning()
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))

    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Regressor(), 1, tmp_path, plugins=[plugin()], gradient_clip_val=0.5)
    for kw, trainer_kw, clip in ((dict(max_grad_norm=0.5), {}, None),
                                 (dict(fused_unscale=False), dict(gradient_clip_val=0.5), 0.5)):
        make_opt = functools.partial(_opt, **kw)
        module = Regressor(make_opt)
        trainer = _fit(module, 2, tmp_path, plugins=[plugin()], **trainer_kw)
        net, ref_opt, _ = _plain_loop(make_opt, 2, autocast=torch.float16, clip=clip,
                                      scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
        _assert_same(module.net, trainer.optimizers[0], net, ref_opt, f"Lightning 16-mixed {kw}")


def test_lightning_ema_validation_callback(tmp_path):
    _, Regressor, EmaValidation = _lightning()
    module = Regressor()
    trainer = _fit(module, 2, tmp_path, val=True, callbacks=[EmaValidation()])
    opt = trainer.optimizers[0]
    net, ref_opt, _ = _plain_loop(_opt, 2)
    _assert_same(module.net, opt, net, ref_opt, "params restored after EMA validation")
    ema_net = _net()
    ema_net.load_state_dict(opt.ema_state_dict(module.net))
    x, y = _data(seed=2)
    batches = range(0, len(x), BATCH)
    assert len(module.val_losses) == 2 * len(batches)
    for i, loss in zip(batches, module.val_losses[-len(batches):]):
        with torch.no_grad():
            ema_loss = F.mse_loss(ema_net(x[i:i + BATCH]), y[i:i + BATCH])
            raw_loss = F.mse_loss(module.net(x[i:i + BATCH]), y[i:i + BATCH])
        assert_bitwise_equal(loss, ema_loss, "validated with the EMA weights")
        assert not torch.equal(loss, raw_loss)


def test_lightning_checkpoint_resume_is_bit_exact(tmp_path):
    """bf16 params (``precision="bf16-true"``) with fp32 masters, an EMA warm-up schedule: the
    checkpoint carries moments, masters, EMA and steps; the resumed run equals an uninterrupted one."""
    _, Regressor, _ = _lightning()
    make_opt = functools.partial(_opt, ema_schedule="warmup")
    first = Regressor(make_opt)
    trainer = _fit(first, 2, tmp_path, precision="bf16-true")
    assert first.net[0].weight.dtype == torch.bfloat16
    assert "master_param" in trainer.optimizers[0].state[first.net[0].weight]
    ckpt = str(tmp_path / "half.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = Regressor(make_opt)
    resumed_trainer = _fit(resumed, 4, tmp_path, precision="bf16-true", ckpt_path=ckpt)
    whole = Regressor(make_opt)
    whole_trainer = _fit(whole, 4, tmp_path, precision="bf16-true")
    _assert_same(resumed.net, resumed_trainer.optimizers[0], whole.net, whole_trainer.optimizers[0],
                 "resumed vs uninterrupted")
    assert int(whole_trainer.optimizers[0].state[whole.net[0].weight]["step"]) == 4 * EPOCH_BATCHES


# ---------------------------------------------------------------------------------------------
# Hugging Face Trainer

@functools.lru_cache(maxsize=None)
def _hf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class TinyConfig(transformers.PretrainedConfig):
        model_type = "fused-optim-tiny"

        def __init__(self, hidden=16, **kwargs):
            self.hidden = hidden
            super().__init__(**kwargs)

    class TinyModel(transformers.PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = _net()
            self.post_init()

        def _init_weights(self, module):
            pass  # _net() is seeded: every run starts from the same weights

        def forward(self, x, labels=None):
            out = self.net(x.to(self.dtype))
            loss = None if labels is None else F.mse_loss(out, labels.to(self.dtype))
            return {"loss": loss, "logits": out}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = _data()

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    return transformers, TinyConfig, TinyModel, Rows


def _hf_train(tmp_path, name, make_opt, *, dtype=torch.float32, max_steps=8, resume=None, **args):
    transformers, TinyConfig, TinyModel, Rows = _hf()
    model = TinyModel(TinyConfig()).to(dtype)
    opt = make_opt(model.parameters())
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, max_steps)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=BATCH, max_steps=max_steps,
        report_to="none", use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=0,
        **{"save_strategy": "no", **args})
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Rows(),
                                   optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    return model, opt


def test_hf_trainer_fp32_matches_torch_adamw_and_clipping_recipes(tmp_path):
    """The Trainer clips (``args.max_grad_norm``, default 1.0) before ``step()``: with fp32 on
    the CPU nothing is scaled, so any optimizer works. ``args.max_grad_norm=0`` with the
    optimizer's ``max_grad_norm=`` clips inside the step (and keeps the fused unscale)."""
    theirs, _ = _hf_train(tmp_path, "torch", lambda ps: torch.optim.AdamW(
        ps, lr=1e-2, weight_decay=0.01, foreach=False), max_grad_norm=0.5)
    hf_clip, _ = _hf_train(tmp_path, "hf_clip", _opt, max_grad_norm=0.5)
    ours_clip, opt = _hf_train(tmp_path, "our_clip", functools.partial(_opt, max_grad_norm=0.5),
                               max_grad_norm=0.0)
    unclipped, _ = _hf_train(tmp_path, "no_clip", _opt, max_grad_norm=0.0)
    assert float(opt.last_grad_norm) > 0.5  # clipping acted
    for p, q, r, u in zip(hf_clip.parameters(), theirs.parameters(), ours_clip.parameters(),
                          unclipped.parameters()):
        assert_close64(p, q, rtol=1e-5, atol=1e-6, msg="HF: FusedEmaAdamW vs torch AdamW")
        assert_close64(r, p, rtol=1e-5, atol=1e-6, msg="HF: max_grad_norm vs args.max_grad_norm")
        assert not torch.allclose(u, p, rtol=1e-3, atol=1e-4)  # the clip changed the result


def test_hf_trainer_resume_is_bit_exact_and_ema_export(tmp_path):
    """bf16 params with fp32 masters: the Trainer saves ``opt.state_dict()`` (moments, masters,
    EMA, steps) in ``optimizer.pt`` and loads it on resume (mid-epoch, shuffled data); the
    resumed run equals the uninterrupted one bit for bit. The EMA is exported as a model."""
    transformers, TinyConfig, TinyModel, _ = _hf()
    make_opt = functools.partial(_opt, ema_schedule="warmup")
    whole, opt = _hf_train(tmp_path, "run", make_opt, dtype=torch.bfloat16, max_steps=12,
                           save_strategy="steps", save_steps=6)
    assert opt.state[whole.net[0].weight]["master_param"].dtype == torch.float32
    resumed, resumed_opt = _hf_train(tmp_path, "run", make_opt, dtype=torch.bfloat16,
                                     max_steps=12, resume=str(tmp_path / "run" / "checkpoint-6"))
    assert int(resumed_opt.state[resumed.net[0].weight]["step"]) == 12
    _assert_same(resumed.net, resumed_opt, whole.net, opt, "HF resumed vs uninterrupted")
    # export: the fp32 EMA as a model of its own (save_pretrained / from_pretrained)
    ema_model = TinyModel(TinyConfig())
    ema_model.load_state_dict(opt.ema_state_dict(whole, dtype=torch.float32))
    ema_model.save_pretrained(str(tmp_path / "ema"))
    loaded = TinyModel.from_pretrained(str(tmp_path / "ema"))
    for p, q in zip(whole.net.parameters(), loaded.net.parameters()):
        assert_bitwise_equal(q.detach(), opt.state[p]["ema"], "exported EMA")
        assert not torch.equal(q.detach(), opt.state[p]["master_param"])


# ---------------------------------------------------------------------------------------------
# A plain (timm-style) loop: docs/recipes.md's recipe as written. GradScaler with the fused unscale
# and clipping against clip_grad_norm_ are tested in test_amp_clipping.py, resume under a
# GradScaler in test_state_dict_amp.py.

def _plain_recipe(model, opt, scaler, epochs, start=0, x_val=None, y_val=None):
    """bf16 (or fp16 + GradScaler) autocast, clipping inside the step, EMA evaluation."""
    amp_dtype = torch.float16 if scaler.is_enabled() else torch.bfloat16
    val_losses = []
    for epoch in range(start, epochs):
        for x, y in _loader():
            with torch.autocast("cpu", dtype=amp_dtype):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)              # a disabled scaler just calls opt.step()
            scaler.update()
            opt.zero_grad(set_to_none=True)
        with opt.swap_ema_weights(), torch.no_grad():
            val_losses.append(F.mse_loss(model(x_val), y_val))
    return val_losses


@pytest.mark.parametrize("fp16", [False, True])
def test_plain_loop_recipe(tmp_path, fp16):
    x_val, y_val = _data(seed=2)
    make_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, enabled=fp16)  # noqa: E731
    model = _net()
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, ema_decay=0.9,
                        max_grad_norm=0.5)
    scaler = make_scaler()
    val = _plain_recipe(model, opt, scaler, 2, x_val=x_val, y_val=y_val)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
               tmp_path / "ckpt.pt")
    val += _plain_recipe(model, opt, scaler, 3, start=2, x_val=x_val, y_val=y_val)
    assert float(opt.last_grad_norm) > 0.5
    # evaluated with the EMA weights; the training weights are back after each swap
    ema_model = _net()
    ema_model.load_state_dict(opt.ema_state_dict(model))
    with torch.no_grad():
        assert_bitwise_equal(val[-1], F.mse_loss(ema_model(x_val), y_val), "EMA evaluation")
        assert not torch.equal(val[-1], F.mse_loss(model(x_val), y_val))
    # resume from the checkpoint: the last epoch again, bit for bit
    resumed = _net(seed=5)
    resumed_opt = FusedEmaAdamW(resumed.parameters(), lr=1e-2, weight_decay=0.01, ema_decay=0.9,
                                max_grad_norm=0.5)
    resumed_scaler = make_scaler()
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_scaler.load_state_dict(ckpt["scaler"])
    resumed_val = _plain_recipe(resumed, resumed_opt, resumed_scaler, 3, start=2,
                                x_val=x_val, y_val=y_val)
    assert_bitwise_equal(resumed_val[-1], val[-1], "resumed EMA evaluation")
    _assert_same(resumed, resumed_opt, model, opt, "plain loop resumed vs uninterrupted")


def test_unscale_clip_step_keeps_working_with_the_fused_unscale():
    """``scaler.unscale_(opt)``, clip, ``scaler.step(opt)`` (what accelerate, so the HF Trainer,
    does under fp16) with the fused unscale on: torch's GradScaler then hands the optimizer no
    ``grad_scale`` (the grads are already unscaled), and the result equals ``fused_unscale=False``."""
    runs = [_plain_loop(functools.partial(_opt, fused_unscale=fused), 2, autocast=torch.float16,
                        clip=0.5, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
            for fused in (True, False)]
    assert min(runs[0][2]) > 0.5  # clipped
    _assert_same(runs[0][0], runs[0][1], runs[1][0], runs[1][1], "fused unscale after unscale_")
