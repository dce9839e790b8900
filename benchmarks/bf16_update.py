"""bf16 weight updates (``--bf16-update master | kahan | stochastic | none``): memory per parameter, the share of
updates that round away, and the projected GPU peak of a training step.

    # bytes per parameter of weights + gradients + optimizer state, measured on real models (CPU)
    python benchmarks/bf16_update.py bytes --sizes tiny small
    # the share of element updates that leave the bf16 weight unchanged, per epoch, on the embedded recipe
    python benchmarks/bf16_update.py rounded-away --updates none kahan stochastic --epochs 3 --exp-root /tmp/bf16
    # projected bytes of weights + gradients + optimizer state per update (parameter counts x bytes per parameter)
    python benchmarks/bf16_update.py project --models zipformer-medium zipformer-large conformer-0.6b
    # the projected peak of a whole training step (fake tensors: no GPU needed, slow on a CPU)
    python benchmarks/bf16_update.py project --whole-step --models zipformer-medium --batch 16 --frames 1500

``rounded-away`` counts, in every optimizer step, the elements whose fp32-computed new value differs from the
old one and, of those, the elements whose bf16 weight did not change (:class:`asrprec.optim.Bf16Update`'s
counters, switched on through torch's global optimizer-step hooks so the loop is untouched). Under ``none`` those
updates are lost; under ``kahan`` they are carried in the compensation buffer and under ``stochastic`` rounded
up later with the right probability. Extra arguments after ``--`` go to ``recipes/espeak/train.py``;
``--bf16-moments`` builds the recipe's policy with ``get_policy(..., bf16_moments=True)``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import runpy
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from asrprec.models import build_transducer, count_parameters, set_batch_count
from asrprec.optim import Bf16Update, ScaledAdam
from asrprec.optim.bf16_update import bytes_per_parameter
from asrprec.precision import MasterWeightOptimizer, get_policy
from asrprec.experiment import read_history

ROOT = Path(__file__).resolve().parents[1]
# (policy, bf16 update, bf16 moments)
CONFIGS = [("fp32", "master", False), ("amp-bf16", "master", False), ("bf16", "master", False),
           ("bf16", "kahan", False), ("bf16", "stochastic", False), ("bf16", "none", False),
           ("bf16", "kahan", True), ("bf16", "stochastic", True), ("bf16", "none", True)]


def _label(policy: str, update: str, moments: bool) -> str:
    if policy != "bf16":
        return policy
    return f"bf16 {update}" + (" + bf16 moments" if moments else "")


def _factory(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "scaled_adam":
        return lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


# -- bytes per parameter (measured) ------------------------------------------------------------------------------

def measure_bytes(model: nn.Module, policy: str, update: str, moments: bool, optimizer: str) -> dict[str, int]:
    """Bytes of the weights, the gradients and the optimizer state (fp32 masters and their gradients included)
    after one optimizer step on zero gradients; the master gradients are counted while the inner step runs."""
    pol = get_policy(policy, "cpu", bf16_update=update, bf16_moments=moments) if policy == "bf16" else \
        get_policy(policy, "cpu")
    model = pol.prepare_model(copy.deepcopy(model))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = pol.build_optimizer(params, _factory(optimizer))
    master_grads = [0]
    if isinstance(opt, MasterWeightOptimizer):
        opt.inner.register_step_pre_hook(
            lambda o, a, k: master_grads.__setitem__(0, _storage_bytes(m.grad for m in opt._masters)))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    masters = list(opt._masters) if isinstance(opt, MasterWeightOptimizer) else []
    return {"params": sum(p.numel() for p in params), "weights": _storage_bytes(params),
            "grads": _storage_bytes(p.grad for p in params),
            "state": _storage_bytes(state) + _storage_bytes(masters) + master_grads[0]}


def run_bytes(args) -> None:
    print(f"# bytes per parameter, measured (weights + gradients + optimizer state incl. fp32 masters and their "
          f"gradients during the step); {_host()}")
    for size in args.sizes:
        torch.manual_seed(0)
        model = build_transducer(encoder="zipformer", size=size, vocab_size=500)
        print(f"\nZipformer `{size}` transducer, {count_parameters(model):,} parameters (V = 500)\n")
        print("| optimizer | policy / update | weights | gradients | optimizer state | total | documented |")
        print("|---|---|---|---|---|---|---|")
        for optimizer in args.optimizers:
            for policy, update, moments in CONFIGS:
                m = measure_bytes(model, policy, update, moments, optimizer)
                n = m["params"]
                total = (m["weights"] + m["grads"] + m["state"]) / n
                doc = bytes_per_parameter(update, "bf16" if moments else "fp32") if policy == "bf16" else 16
                print(f"| {optimizer} | {_label(policy, update, moments)} | {m['weights'] / n:.2f} | "
                      f"{m['grads'] / n:.2f} | {m['state'] / n:.2f} | {total:.2f} | {doc} |", flush=True)


# -- share of updates rounded away (measured on the embedded recipe) --------------------------------------------

def _rule(opt) -> Bf16Update | None:
    for name in ("weight_update", "update"):
        r = getattr(opt, name, None)
        if isinstance(r, Bf16Update):
            return r
    return None


def subset_data_dir(src: Path, dst: Path, train_cuts: int, dev_cuts: int) -> Path:
    """A data folder holding every ``k``-th training and dev cut of ``src`` (the features stay where they are: the
    cuts name them by absolute path), for runs shorter than the recipe's epochs."""
    import gzip
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith("_fbank.jsonl.gz"):
            shutil.copy2(f, dst / f.name)
    for split, keep in (("train", train_cuts), ("dev", dev_cuts), ("test", 0)):
        name = f"espeak_cuts_{split}_fbank.jsonl.gz"
        with gzip.open(src / name, "rt") as fh:
            lines = fh.readlines()
        if keep:
            step = max(1, len(lines) // keep)
            lines = lines[::step][:keep]
        with gzip.open(dst / name, "wt") as fh:
            fh.writelines(lines)
    return dst


def run_rounded_away(args, recipe_args: list[str]) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    rows: list[dict[str, Any]] = []
    if args.train_cuts:
        data = subset_data_dir(ROOT / "recipes/espeak/data", Path(args.exp_root) / "bf16-update-data",
                               args.train_cuts, args.dev_cuts)
        recipe_args = ["--data-dir", str(data), *recipe_args]
    for update in args.updates:
        steps: list[tuple[int, int, float]] = []  # (updated elements, left unchanged, lr) per optimizer step

        def pre(opt, a, k):
            r = _rule(opt)
            if r is not None:
                r.counting = True

        def post(opt, a, k):  # every optimizer step (under master: the inner optimizer's, no rule to count)
            r = _rule(opt)
            steps.append((*(r.take_counts() if r is not None else (0, 0)), opt.param_groups[0]["lr"]))

        exp_dir = Path(args.exp_root) / (f"bf16-update-{update}" + ("-bf16-moments" if args.bf16_moments else ""))
        argv = [str(ROOT / "recipes/espeak/train.py"), "--precision", "bf16", "--bf16-update", update,
                "--exp-dir", str(exp_dir), "--num-epochs", str(args.epochs), "--threads", "1", "--seed",
                str(args.seed), "--overwrite", *(("--precision.bf16_moments", "true") if args.bf16_moments else ()),
                *recipe_args]
        h_pre, h_post = register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)
        saved_argv = sys.argv
        try:
            sys.argv = argv
            print("+", " ".join(argv), flush=True)
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        finally:
            sys.argv = saved_argv
            h_pre.remove()
            h_post.remove()
        start = 0
        for ev in (e for e in read_history(exp_dir) if e.get("event") == "epoch"):
            chunk = steps[start:start + int(ev["steps"])]
            start += int(ev["steps"])
            upd, stuck = sum(s[0] for s in chunk), sum(s[1] for s in chunk)
            rows.append({"update": update + (" + bf16 moments" if args.bf16_moments else ""), "epoch": ev["epoch"],
                         "steps": len(chunk), "updated": upd, "stuck": stuck,
                         "lr": (chunk[0][2], chunk[-1][2]) if chunk else (float("nan"),) * 2,
                         "valid_loss": ev.get("valid_loss"), "train_loss": ev.get("train_loss")})
    print(f"\n# share of element updates that left the bf16 weight unchanged; {_host()}\n")
    print("| update | epoch | steps | lr (first-last) | updated elements | unchanged in bf16 | share | "
          "train loss/frame | valid loss/frame |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["updated"]:
            cells = f"{r['updated']:,} | {r['stuck']:,} | {100 * r['stuck'] / r['updated']:.1f} %"
        else:
            cells = "- | - | - (no rule to count)"
        print(f"| {r['update']} | {r['epoch']} | {r['steps']} | {r['lr'][0]:.2e}-{r['lr'][1]:.2e} | {cells} | "
              f"{_f(r['train_loss'])} | {_f(r['valid_loss'])} |")


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}"


# -- projected GPU peak (fake tensors) --------------------------------------------------------------------------

# (encoder, size, encoder overrides, vocabulary, decoder/joiner dim)
MODELS = {
    "zipformer-medium": ("zipformer", "medium", {}, 500, None),
    "zipformer-large": ("zipformer", "large", {}, 500, None),
    # a 0.6 B-parameter Conformer transducer: NeMo's Parakeet-0.6B shape (24 layers, d 1024, 8 heads,
    # feed-forward 4096; 1024 tokens, prediction/joint 640), with this library's Conformer layers
    "conformer-0.6b": ("conformer", "librispeech",
                       {"encoder_dim": 1024, "num_encoder_layers": 24, "num_heads": 8, "feedforward_dim": 4096},
                       1024, 640),
}


def _build(name: str, device: str = "cpu") -> nn.Module:
    encoder, size, overrides, vocab, dim = MODELS[name]
    torch.manual_seed(0)
    with torch.device(device):
        m = build_transducer(encoder=encoder, size=size, vocab_size=vocab, encoder_overrides=overrides,
                             decoder_dim=dim, joiner_dim=dim)
    set_batch_count(m, 100000)
    return m


def run_project(args) -> None:
    if args.whole_step:
        return run_project_step(args)
    print(f"# PROJECTED bytes of weights + gradients + optimizer state (parameter count on the meta device x the "
          f"bytes per parameter of bytes_per_parameter(), which `bytes` measures on real models; activations not "
          f"included); {_host()}\n")
    counts = {name: count_parameters(_build(name, "meta")) for name in args.models}
    print("| policy / update | bytes per parameter | " + " | ".join(f"{k} ({v / 1e6:.0f} M)" for k, v in counts.items())
          + " |")
    print("|---|---|" + "---|" * len(counts))
    for policy, update, moments in CONFIGS:
        per = bytes_per_parameter(update, "bf16" if moments else "fp32") if policy == "bf16" else 16
        print(f"| {_label(policy, update, moments)} | {per} | " + " | ".join(_gb(per * n) for n in counts.values())
              + " |", flush=True)


def run_project_step(args) -> None:
    from asrprec.precision.memory_step import project_step

    B, T, U = args.batch, args.frames, args.tokens
    print(f"# PROJECTED peak memory of one training step (asrprec.precision.memory_step.project_step: fake tensors, "
          f"allocator rounding; a lower bound of torch.cuda.max_memory_allocated), B={B}, T={T} frames, U={U} "
          f"tokens, pruned loss, {args.optimizer}; {_host()}\n")
    print("| model | parameters | policy / update | weights | gradients | optimizer state + masters | "
          "step peak (projected) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        vocab = MODELS[name][3]

        def make_batch(device, vocab=vocab):
            return (torch.randn(B, T, 80, device=device), torch.full((B,), T, dtype=torch.int64, device=device),
                    torch.randint(1, vocab, (B, U), device=device), torch.full((B,), U, dtype=torch.int64,
                                                                               device=device))

        def loss_fn(model, batch):
            return model(*batch)["loss"]

        n = count_parameters(_build(name, "meta"))
        for policy, update, moments in args.step_configs:
            r = project_step(lambda name=name: _build(name), make_batch, loss_fn, policy, _factory(args.optimizer),
                             bf16_update=update, bf16_moments=moments, cuda_forward=False)
            state = r.optimizer_state + r.master_weights
            print(f"| {name} | {n / 1e6:.0f} M | {_label(policy, update, moments)} | {_gb(r.parameters)} | "
                  f"{_gb(r.gradients)} | {_gb(state)} | {_gb(r.peak)} ({r.peak_phase}) |", flush=True)


def _step_config(text: str) -> tuple[str, str, bool]:
    parts = text.split(":")
    config = (parts[0], parts[1] if len(parts) > 1 else "master", parts[2:] == ["moments"])
    if config not in CONFIGS or len(parts) > 3 or (len(parts) == 3 and parts[2] != "moments"):
        raise argparse.ArgumentTypeError(
            f"unknown step config {text!r}: known are " + ", ".join(
                f"{p}:{u}" + (":moments" if m else "") for p, u, m in CONFIGS))
    return config


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _host() -> str:
    return (f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}")


def main() -> None:
    argv = sys.argv[1:]
    recipe_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, recipe_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bytes", help="bytes per parameter, measured on real models")
    b.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    b.add_argument("--optimizers", nargs="+", default=["scaled_adam", "adamw"], choices=["scaled_adam", "adamw"])
    r = sub.add_parser("rounded-away", help="share of updates rounded away, per epoch, on the embedded recipe")
    r.add_argument("--updates", nargs="+", default=["none"], choices=["master", "kahan", "stochastic", "none"])
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--bf16-moments", action="store_true", help="the optimizer's moment buffers in bf16 too")
    r.add_argument("--seed", type=int, default=42)
    r.add_argument("--train-cuts", type=int, default=0,
                   help="train on this many of the corpus' 2,500 training cuts (every k-th; 0 = all)")
    r.add_argument("--dev-cuts", type=int, default=0, help="validate on this many dev cuts (with --train-cuts)")
    r.add_argument("--exp-root", default=str(ROOT / "recipes/espeak/exp"))
    p = sub.add_parser("project", help="projected GPU peak of a training step per update")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--frames", type=int, default=1500, help="feature frames (100 per second)")
    p.add_argument("--tokens", type=int, default=80)
    p.add_argument("--optimizer", default="scaled_adam", choices=["scaled_adam", "adamw"])
    p.add_argument("--whole-step", action="store_true",
                   help="project a whole training step on fake tensors (activations included; slow on a CPU)")
    p.add_argument("--step-configs", nargs="+", type=_step_config,
                   default=[c for c in CONFIGS if c[0] != "fp32" and not c[2]][:5],
                   help="policy:update[:moments] for --whole-step, e.g. amp-bf16:master bf16:stochastic:moments")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "bytes":
        run_bytes(args)
    elif args.what == "rounded-away":
        run_rounded_away(args, recipe_args)
    else:
        run_project(args)


if __name__ == "__main__":
    main()
