#!/usr/bin/env python3
"""Demo: a bf16 digit classifier trained with FusedEmaAdamW (fp32 masters + EMA in one step).

Real data, no download: scikit-learn's ``load_digits`` (1,797 8x8 handwritten digits, bundled
in the scikit-learn wheel), split into a stratified training set and a held-out test set. A small
MLP with bf16 params is trained with ``FusedEmaAdamW(master_weights=True)``; every
``--eval-every`` steps the test loss and accuracy are measured with the raw weights and, inside
``opt.swap_ema_weights()``, with the EMA weights.

In the same loop, on the same batches, a second copy of the model is trained the way plain
PyTorch does the same work (the composed mixed-precision recipe): copy the bf16 grads into fp32
master grads, ``torch.optim.AdamW(fused=True).step()`` on the masters,
``torch._foreach_lerp_`` for the EMA, copy the masters back into the bf16 params. Only the
optimizer step is timed, for both, alternating which goes first; the medians after the warm-up
steps are compared.

Output: a progress bar (tqdm), raw vs EMA test accuracy and loss, the step times, and a PNG
(matplotlib, optional) with the training loss and the raw/EMA test curves.

    python tools/demo.py                      # 1500 steps, about 15 s on 2 cores
    python tools/demo.py --steps 300 --plot out.png
    python tools/demo.py --no-plot --hidden 1024

Needs scikit-learn and tqdm (``pip install scikit-learn tqdm``); matplotlib for the picture.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fused_optim import FusedEmaAdamW  # noqa: E402
from multi_tensor import backend_for  # noqa: E402


# --- data and model ---------------------------------------------------------------------------
def load_digits_split(test_size: int, seed: int):
    """Stratified train/test split of sklearn's digits: images (N, 8, 8) with pixels 0..16."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, stratify=y, random_state=seed)
    images = [torch.tensor(a, dtype=torch.float32).view(-1, 8, 8) for a in (x_train, x_test)]
    return images[0], torch.tensor(y_train), images[1], torch.tensor(y_test)


def features(images: torch.Tensor) -> torch.Tensor:
    """(N, 8, 8) pixels 0..16 -> (N, 64) features in [-1, 1]."""
    return images.reshape(len(images), 64) / 8.0 - 1.0


def random_shift(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Training augmentation: move each image by -1, 0 or +1 pixel in each direction."""
    n = len(images)
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1))
    offset = torch.randint(0, 3, (n, 2), generator=gen)
    rows = (offset[:, :1] + torch.arange(8))[:, :, None]
    cols = (offset[:, 1:] + torch.arange(8))[:, None, :]
    return padded[torch.arange(n)[:, None, None], rows, cols]


def make_mlp(hidden: int, depth: int) -> torch.nn.Module:
    layers: List[torch.nn.Module] = [torch.nn.Linear(64, hidden), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 10))


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    logits = model(x.to(torch.bfloat16)).float()
    loss = torch.nn.functional.cross_entropy(logits, y).item()
    return loss, 100.0 * (logits.argmax(1) == y).float().mean().item()


class TorchMixedPrecisionEma:
    """PyTorch's composition of the same update: fp32 master copies, AdamW(fused=True) on them,
    an EMA pass (``_foreach_lerp_``) and a copy back into the bf16 params."""

    def __init__(self, params, lr, betas, eps, weight_decay, ema_decay):
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.emas = [m.clone() for m in self.masters]
        self.weight = 1.0 - ema_decay
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.opt.step()
        torch._foreach_lerp_(self.emas, self.masters, self.weight)
        torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def evaluate_ema(self, model, x, y):
        backup = [p.clone() for p in self.params]
        torch._foreach_copy_(self.params, self.emas)
        try:
            return evaluate(model, x, y)
        finally:
            torch._foreach_copy_(self.params, backup)


# --- plot -------------------------------------------------------------------------------------
def running(values: List[float], window: int, how) -> List[float]:
    """``how`` (mean, median) over the last ``window`` values at each position."""
    return [how(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def write_plot(path: str, history: Dict[str, List[float]], losses: List[float],
               times_ms: Dict[str, List[float]], warmup: int, title: str) -> Optional[str]:
    """The PNG: training and test loss, test accuracy, optimizer step times.

    Returns None when written, else why not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib), no picture written"
    steps = history["step"]
    xs = range(1, len(losses) + 1)
    raw_style = dict(color="tab:blue", lw=1.6, marker=".", ms=4)
    ema_style = dict(color="tab:orange", lw=1.6, marker=".", ms=4)
    fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(17, 5))

    ax_loss.plot(xs, losses, color="0.82", lw=0.6, label="train, each batch")
    ax_loss.plot(xs, running(losses, 50, statistics.fmean), color="0.35", lw=1.2,
                 label="train, mean of 50 batches")
    ax_loss.plot(steps, history["raw_loss"], label="test, raw weights", **raw_style)
    ax_loss.plot(steps, history["ema_loss"], label="test, EMA weights", **ema_style)
    ax_loss.set_yscale("log")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (log scale)", title="loss")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3, which="both")

    for key, name, style in (("raw_acc", "raw", raw_style), ("ema_acc", "EMA", ema_style)):
        ax_acc.plot(steps, history[key], label=f"{name} weights (final {history[key][-1]:.1f}%)",
                    **style)
    after = len(steps) // 10 + 1  # zoom on the part after the first tenth of training
    low = min(history["raw_acc"][after:] + history["ema_acc"][after:], default=0.0)
    bottom = max(0.0, 5 * math.floor(low / 5) - 5)
    ax_acc.set_ylim(bottom, 100.5)
    ax_acc.set(xlabel="step", ylabel="test accuracy (%)",
               title="held-out test accuracy" + (f" (axis from {bottom:.0f}%)" if bottom else ""))
    ax_acc.legend(fontsize=8, loc="lower right")
    ax_acc.grid(alpha=0.3)

    colors = {"FusedEmaAdamW": "tab:green", "torch recipe": "tab:red"}
    for name, t in times_ms.items():
        color = colors.get(name)
        med = statistics.median(t[warmup:] or t)
        ax_time.plot(range(1, len(t) + 1), t, ".", ms=1.5, alpha=0.35, color=color)
        ax_time.plot(range(1, len(t) + 1), running(t, 51, statistics.median), lw=1.4,
                     color=color, label=f"{name}: median {med:.3f} ms")
    if warmup:
        ax_time.axvline(warmup, color="0.5", ls="--", lw=0.8)
        ax_time.annotate("warm-up | timed", (warmup, 0.98), xycoords=("data", "axes fraction"),
                         fontsize=7, ha="left", va="top", color="0.4")
    ax_time.set_yscale("log")
    ax_time.set(xlabel="step", ylabel="ms (log scale)",
                title="optimizer step time (dots: each step; line: median of 51)")
    ax_time.legend(fontsize=8)
    ax_time.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# --- main -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers (default 2)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--ema-decay", type=float, default=0.995)
    parser.add_argument("--no-augment", action="store_true",
                        help="train without the random 1-pixel shifts")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluate raw and EMA weights every N steps (default: steps / 50)")
    parser.add_argument("--test-size", type=int, default=450, help="held-out images (default 450)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the timing (default: min(50, steps / 5))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--plot", metavar="PATH", default="demo_digits.png",
                        help="where to write the PNG (default demo_digits.png)")
    parser.add_argument("--no-plot", action="store_true", help="write no picture")
    return parser


def threads_text() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("" if n == 1 else "s")


def _foreign_load():
    """benchlib's measure of the cores other processes keep busy (None where unavailable)."""
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from benchlib.machine import ForeignLoad
        return ForeignLoad()
    except Exception:
        return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    try:
        import sklearn  # noqa: F401
        from tqdm import tqdm
    except ImportError as exc:
        print(f"the demo needs scikit-learn for its data (load_digits ships inside the wheel, no "
              f"download) and tqdm for its progress bar: pip install scikit-learn tqdm   (bash "
              f"tools/bootstrap.sh installs both; {exc})", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    eval_every = args.eval_every or max(1, args.steps // 50)
    warmup = args.warmup if args.warmup is not None else min(50, args.steps // 5)
    betas, eps = (0.9, 0.999), 1e-8

    torch.manual_seed(args.seed)
    images_train, y_train, images_test, y_test = load_digits_split(args.test_size, args.seed)
    x_test = features(images_test)
    model = make_mlp(args.hidden, args.depth).to(torch.bfloat16)
    peer_model = make_mlp(args.hidden, args.depth).to(torch.bfloat16)
    peer_model.load_state_dict(model.state_dict())
    opt = FusedEmaAdamW(model.parameters(), lr=args.lr, betas=betas, eps=eps,
                        weight_decay=args.weight_decay, ema_decay=args.ema_decay,
                        master_weights=True)
    peer = TorchMixedPrecisionEma(peer_model.parameters(), args.lr, betas, eps,
                                  args.weight_decay, args.ema_decay)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)

    print(f"data: scikit-learn load_digits (8x8 images, 10 classes): {len(y_train)} train / "
          f"{len(y_test)} held-out test images, stratified split (seed {args.seed})"
          + ("" if args.no_augment else "; training batches randomly shifted by up to 1 pixel"))
    print(f"model: MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10, bf16 params "
          f"({n_params:,} in {len(params)} tensors)")
    print(f"optimizer: FusedEmaAdamW(lr={args.lr:g}, weight_decay={args.weight_decay:g}, "
          f"ema_decay={args.ema_decay:g}, master_weights=True): fp32 masters, moments and EMA")
    print(f"backend {backend_for('fused_ema_adamw', 'cpu').name}, torch {torch.__version__}, "
          f"{threads_text()}; {args.steps} steps of batch {args.batch}, "
          f"raw and EMA weights evaluated every {eval_every} steps", flush=True)

    history: Dict[str, List[float]] = {k: [] for k in
                                       ("step", "raw_loss", "raw_acc", "ema_loss", "ema_acc")}

    def record(step: int) -> None:
        raw = evaluate(model, x_test, y_test)
        if step == 0:  # before the first step the EMA is the weights
            ema = raw
        else:
            with opt.swap_ema_weights():
                ema = evaluate(model, x_test, y_test)
        for key, value in zip(history, (step, *raw, *ema)):
            history[key].append(value)

    record(0)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(y_train), generator=gen)
    cursor = 0
    losses: List[float] = []
    times = {"ours": [], "torch": [], "fwd_bwd": []}
    runners = ((model, params, opt.step, "ours"), (peer_model, peer.params, peer.step, "torch"))
    bar = tqdm(total=args.steps, desc="  training", unit="step", file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5)
    load = _foreign_load()
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        if cursor + args.batch > len(order):  # a new epoch
            order, cursor = torch.randperm(len(y_train), generator=gen), 0
        idx = order[cursor:cursor + args.batch]
        cursor += args.batch
        batch = images_train[idx] if args.no_augment else random_shift(images_train[idx], gen)
        xb, yb = features(batch), y_train[idx]
        for m, ps, stepper, name in (runners if step % 2 else runners[::-1]):
            for p in ps:
                p.grad = None
            t0 = time.perf_counter()
            loss = loss_fn(m, xb, yb)
            loss.backward()
            t1 = time.perf_counter()
            stepper()
            times[name].append((time.perf_counter() - t1) * 1e3)
            if name == "ours":
                times["fwd_bwd"].append((t1 - t0) * 1e3)
                losses.append(loss.item())
        if step % eval_every == 0 or step == args.steps:
            record(step)
        bar.set_postfix_str(f"train loss {statistics.fmean(losses[-50:]):.3f} | test acc raw "
                            f"{history['raw_acc'][-1]:5.1f}% EMA {history['ema_acc'][-1]:5.1f}%",
                            refresh=False)
        bar.update(1)
    bar.close()
    train_s = time.perf_counter() - t_train
    busy = load.cores() if load is not None else None

    raw_loss, raw_acc = history["raw_loss"][-1], history["raw_acc"][-1]
    ema_loss, ema_acc = history["ema_loss"][-1], history["ema_acc"][-1]
    peer_raw = evaluate(peer_model, x_test, y_test)
    peer_ema = peer.evaluate_ema(peer_model, x_test, y_test)
    n_test = len(y_test)
    print(f"\ntraining: {args.steps} steps of both models in {train_s:.1f} s; train loss "
          f"{statistics.fmean(losses[:20]):.3f} (first 20 batches) -> "
          f"{statistics.fmean(losses[-50:]):.3f} (last 50)")
    print(f"final test accuracy, {n_test} held-out images (chance 10%):")
    print(f"  raw weights  {raw_acc:5.1f}% ({round(raw_acc * n_test / 100)}/{n_test}), "
          f"test loss {raw_loss:.4f}")
    print(f"  EMA weights  {ema_acc:5.1f}% ({round(ema_acc * n_test / 100)}/{n_test}), "
          f"test loss {ema_loss:.4f}   (ema_decay {args.ema_decay:g}, opt.swap_ema_weights())")
    half = len(history["step"]) // 2
    late_raw, late_ema = history["raw_acc"][half:], history["ema_acc"][half:]
    print(f"  over the second half of training ({len(late_raw)} evaluations): raw "
          f"{min(late_raw):.1f}..{max(late_raw):.1f}% (mean {statistics.fmean(late_raw):.1f}%), "
          f"EMA {min(late_ema):.1f}..{max(late_ema):.1f}% (mean {statistics.fmean(late_ema):.1f}%)")
    print(f"  the torch recipe's copy of the model (same batches): raw {peer_raw[1]:.1f}%, "
          f"EMA {peer_ema[1]:.1f}% (same update rule in another operation order, so the two "
          "runs part by rounding)")

    timed_ours, timed_torch = times["ours"][warmup:], times["torch"][warmup:]
    ours, theirs = statistics.median(timed_ours), statistics.median(timed_torch)
    fwd_bwd = statistics.median(times["fwd_bwd"][warmup:])

    def spread(t: List[float]) -> str:
        q = statistics.quantiles(t, n=10) if len(t) >= 2 else [t[0]] * 9
        return f"p10..p90 {q[0]:.3f}..{q[-1]:.3f}"

    print(f"\noptimizer step time: median of {len(timed_ours)} steps after {warmup} warm-up steps; "
          f"both in this run, on the same batches, alternating which steps first; "
          f"{threads_text()}")
    print(f"  FusedEmaAdamW.step()  {ours:7.3f} ms ({spread(timed_ours)}): AdamW on the fp32 "
          "masters + EMA + bf16 params written, one fused pass")
    print(f"  torch recipe          {theirs:7.3f} ms ({spread(timed_torch)}): _foreach_copy_ bf16 "
          "grads -> fp32 master grads, AdamW(fused=True).step() on the masters, "
          "_foreach_lerp_ EMA, _foreach_copy_ masters -> bf16 params")
    ratio = theirs / ours
    if ratio >= 1.0:
        print(f"  torch / ours = {ratio:.2f}: FusedEmaAdamW's step is {ratio:.2f}x as fast here.")
    else:
        print(f"  torch / ours = {ratio:.2f}: FusedEmaAdamW's step is SLOWER on this model: it "
              f"takes {ours / theirs:.2f}x torch's time, {ours - theirs:.3f} ms more per step.")
    print(f"  for scale: forward + backward of this model takes {fwd_bwd:.3f} ms (median). "
          "tools/bench.py compares the optimizers alone on large models (up to 124M params).")
    if busy is not None and busy > 0.2:
        print(f"  NOTE: other processes kept {busy:.2f} cores busy during training; these "
              "timings are noisy.")

    if not args.no_plot:
        title = (f"FusedEmaAdamW on scikit-learn digits: bf16 MLP ({n_params:,} params), fp32 "
                 f"masters, lr {args.lr:g}, ema_decay {args.ema_decay:g}, batch {args.batch}, "
                 f"{n_test} held-out test images, {threads_text()}")
        why_not = write_plot(args.plot, history, losses,
                             {"FusedEmaAdamW": times["ours"], "torch recipe": times["torch"]},
                             warmup, title)
        print(f"\nplot: {why_not}" if why_not else f"\nplot: wrote {os.path.abspath(args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
