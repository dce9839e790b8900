"""Training-step time and decoding RTFx with ``torch.compile`` (asrprec.models.compile) against eager mode.

For each model and precision policy an eager and a compiled copy of the same model (same initial weights) run
interleaved on the same synthetic batches (eager step, compiled step, ...), so a shared CPU slows both alike. The
batches vary in (B, T) like the bucketing sampler's. The first ``--warmup`` batches are not timed; the compile
time is what the compiled copy's warm-up steps took beyond the eager copy's. The table gives each median step time
and the median of the per-batch time ratios; a ratio above 1 means the compiled step is faster.

    python benchmarks/compile.py --models zipformer:tiny,zipformer:small,conformer:tiny --precisions fp32,amp-bf16
    python benchmarks/compile.py --decode --models zipformer:tiny       # encoder + greedy search, RTFx
    python benchmarks/compile.py --models zipformer:small --regions layers   # front-end and layers compiled apart
    python benchmarks/compile.py --padding recipes/espeak/data/espeak_cuts_train_fbank.jsonl.gz --max-duration 30

``--padding`` times nothing: it runs lhotse's bucketing sampler over a training manifest for an epoch and prints
what padding T to a multiple of N frames would cost against symbolic (B, T): the frames added and the distinct
shapes, each a graph of its own under static shapes.

The encoder's schedules see ``--encoder-batch-count`` (default 5000: past the position-score skip, the one part
that stays eager early in training; see asrprec/models/compile.py).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import time
import warnings

import torch

from asrprec.decoding import greedy_search
from asrprec.models import LossConfig, build_transducer, set_batch_count
from asrprec.models.compile import COMPILE_DYNAMIC, COMPILE_REGIONS, compile_model, compiled_graph_count
from asrprec.optim import ScaledAdam
from asrprec.precision import get_policy


def make_batches(n: int, seed: int, batch: tuple[int, int], frames: tuple[int, int], vocab: int = 128):
    """n batches of B in ``batch`` utterances of ``frames`` feature frames (100 Hz), 6-15 tokens each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = int(torch.randint(batch[0], batch[1] + 1, (), generator=g))
        lens = torch.randint(frames[0], frames[1] + 1, (b,), generator=g)
        feats = torch.randn(b, int(lens.max()), 80, generator=g)
        u = torch.randint(6, 16, (b,), generator=g)
        targets = torch.randint(1, vocab, (b, int(u.max())), generator=g)
        out.append((feats, lens, targets, u))
    return out


def _pair(name: str, precision: str, device: str, batch_count: float, dynamic: str, joiner: bool, train: bool,
          backend: str = "inductor", regions: str = "model"):
    encoder, _, size = name.partition(":")
    torch.manual_seed(0)
    model = build_transducer(encoder=encoder, size=size or "tiny", vocab_size=128,
                             loss=LossConfig(loss="pruned", loss_warmup_batches=4000), model_warmup_batches=0)
    policy = get_policy(precision, device)
    model = policy.prepare_model(model) if train else policy.prepare_for_inference(model)
    model.train(train)
    set_batch_count(model.encoder, batch_count)
    compiled = copy.deepcopy(model)
    compile_model(compiled, parts=("encoder", "joiner") if joiner else ("encoder",), dynamic=dynamic,
                  backend=backend, regions=regions)
    return policy, model, compiled


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_train(name: str, precision: str, args, batches) -> str:
    policy, eager, compiled = _pair(name, precision, args.device, args.encoder_batch_count, args.dynamic,
                                    args.compile_joiner, train=True, backend=args.backend, regions=args.regions)
    runs = []
    for model in (eager, compiled):
        opt = policy.build_optimizer(model.parameters(), lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0))
        if model is compiled and args.compile_optimizer:
            getattr(opt, "inner", opt).compile(backend=args.backend)
        runs.append((model, opt, []))
    graphs0 = compiled_graph_count()
    for i, (feats, lens, targets, u) in enumerate(batches):
        for model, opt, times in runs:
            # the schedules move every step as in training: a graph that specialised on them would recompile
            set_batch_count(model.encoder, args.encoder_batch_count + i)
            feats_d, lens_d, targets_d, u_d = (t.to(args.device) for t in (feats, lens, targets, u))
            _sync(args.device)
            t0 = time.perf_counter()
            with policy.autocast():
                loss = model(feats_d, lens_d, targets_d, u_d)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(args.device)
            times.append(time.perf_counter() - t0)
    (_, _, te), (_, _, tc) = runs
    w = args.warmup
    compile_s = sum(tc[:w]) - sum(te[:w])
    ratio = statistics.median(a / b for a, b in zip(te[w:], tc[w:]))
    return (f"| train {name} | {precision} | {statistics.median(te[w:]) * 1e3:.0f} ms | "
            f"{statistics.median(tc[w:]) * 1e3:.0f} ms | {ratio:.2f}x | {compile_s:.0f} s | "
            f"{compiled_graph_count() - graphs0} | {os.getloadavg()[0]:.1f} |")


def bench_decode(name: str, precision: str, args, batches) -> str:
    policy, eager, compiled = _pair(name, precision, args.device, args.encoder_batch_count, args.dynamic,
                                    False, train=False, backend=args.backend, regions=args.regions)
    times: list[list[float]] = [[], []]
    audio = []
    graphs0 = compiled_graph_count()
    with torch.inference_mode():
        for feats, lens, _, _ in batches:
            audio.append(float(lens.sum()) / 100.0)
            for k, model in enumerate((eager, compiled)):
                feats_d, lens_d = feats.to(args.device), lens.to(args.device)
                _sync(args.device)
                t0 = time.perf_counter()
                with policy.autocast():
                    greedy_search(model, *model.encode(feats_d, lens_d))
                _sync(args.device)
                times[k].append(time.perf_counter() - t0)
    w = args.warmup
    te, tc = times
    rtfx_e = sum(audio[w:]) / sum(te[w:])
    rtfx_c = sum(audio[w:]) / sum(tc[w:])
    return (f"| decode {name} (greedy) | {precision} | RTFx {rtfx_e:.0f} | RTFx {rtfx_c:.0f} | "
            f"{rtfx_c / rtfx_e:.2f}x | {sum(tc[:w]) - sum(te[:w]):.0f} s | {compiled_graph_count() - graphs0} | "
            f"{os.getloadavg()[0]:.1f} |")


def padding_table(manifest: str, max_duration: float, num_buckets: int, multiples: list[int], seed: int = 0) -> None:
    """Batches of one epoch of ``DynamicBucketingSampler`` over ``manifest``: the frames that padding T to a multiple
    of each N adds to the batches, and the distinct shapes (what a static-shape compile makes a graph for)."""
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler

    cuts = CutSet.from_file(manifest).to_eager()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*eagerly read CutSet.*")  # a manifest that fits in memory
        sampler = DynamicBucketingSampler(cuts, max_duration=max_duration, num_buckets=num_buckets, shuffle=True,
                                          seed=seed)
    shapes = [(len(batch), max(c.num_frames for c in batch)) for batch in sampler]
    frames = sum(b * t for b, t in shapes)  # what the model runs on with symbolic (B, T): padded to each batch's max
    speech = sum(c.num_frames for c in cuts)
    print(f"# {manifest}: {len(cuts)} cuts, {len(shapes)} batches (max_duration {max_duration} s, {num_buckets} "
          f"buckets); batch frames {frames} = {frames / speech - 1:+.1%} over the speech's {speech}")
    print("| T padded to a multiple of | frames run | added | distinct T | distinct (B, T) |")
    print("|---|---|---|---|---|")
    print(f"| - (symbolic B, T) | {frames} | - | {len({t for _, t in shapes})} | "
          f"{len(set(shapes))} |")
    for n in multiples:
        padded = [(b, -(-t // n) * n) for b, t in shapes]
        run = sum(b * t for b, t in padded)
        print(f"| {n} | {run} | {run / frames - 1:+.1%} | {len({t for _, t in padded})} | {len(set(padded))} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="zipformer:tiny,conformer:tiny", help="comma-separated encoder:size")
    p.add_argument("--precisions", default="fp32,amp-bf16", help="comma-separated precision policies")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, default=12, help="timed batches (after --warmup)")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first: they hold the compiles")
    p.add_argument("--batch-size", default="6,10", help="min,max utterances per batch")
    p.add_argument("--frames", default="100,200", help="min,max feature frames per utterance")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dynamic", choices=COMPILE_DYNAMIC, default="auto")
    p.add_argument("--compile-joiner", action="store_true", help="also compile the joiner")
    p.add_argument("--compile-optimizer", action="store_true", help="also compile ScaledAdam's update")
    p.add_argument("--regions", choices=COMPILE_REGIONS, default="model",
                   help="model = the encoder compiled whole; layers = its front-end and each layer on their own")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager / aot_eager: trace only)")
    p.add_argument("--encoder-batch-count", type=float, default=5000.0)
    p.add_argument("--decode", action="store_true", help="decoding RTFx instead of training steps")
    p.add_argument("--padding", metavar="MANIFEST",
                   help="no timing: the cost of padding T for a lhotse cut manifest's bucketed batches")
    p.add_argument("--max-duration", type=float, default=30.0, help="with --padding: seconds per batch")
    p.add_argument("--num-buckets", type=int, default=10, help="with --padding: the sampler's buckets")
    p.add_argument("--pad-multiples", default="32,64,128,256", help="with --padding: comma-separated N (frames)")
    args = p.parse_args()
    if args.padding:
        padding_table(args.padding, args.max_duration, args.num_buckets,
                      [int(v) for v in args.pad_multiples.split(",")])
        return
    torch.set_num_threads(args.threads)
    bs = tuple(int(v) for v in args.batch_size.split(","))
    fr = tuple(int(v) for v in args.frames.split(","))
    batches = make_batches(args.warmup + args.batches, 0, bs, fr)
    print(f"# {datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {args.threads} threads, device {args.device}, dynamic={args.dynamic}, "
          f"{args.batches} timed batches after {args.warmup}, B {args.batch_size}, frames {args.frames}"
          f"{', joiner compiled' if args.compile_joiner else ''}"
          f"{', optimizer compiled' if args.compile_optimizer else ''}, backend {args.backend}"
          f"{', regions ' + args.regions if args.regions != 'model' else ''}")
    print("| what | precision | eager | compiled | speed-up (median per batch) | compile time | graphs | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            bench = bench_decode if args.decode else bench_train
            print(bench(name, precision, args, batches), flush=True)


if __name__ == "__main__":
    main()
