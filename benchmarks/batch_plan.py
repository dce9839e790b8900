"""Batches sized by memory: the plan per precision policy, against one --max-duration, and its CPU check.

    python benchmarks/batch_plan.py plan --size medium --budget 80GB             # per policy, fake tensors
    python benchmarks/batch_plan.py padding                                      # padding against the bucket count
    python benchmarks/batch_plan.py cpu-check --sizes tiny,small --budget 1.5GB  # real CPU steps at planned sizes
    python benchmarks/batch_plan.py device-run --plans benchmarks/data/batch_plan_gpu.json   # a plan on the GPU

``plan``: ``asrprec.precision.batch_plan.plan_batches`` for each policy (fp32, amp-fp16, amp-bf16, bf16 with the
master / kahan / stochastic update) over the duration buckets of the corpus (``--cuts`` or the assumed
LibriSpeech-shaped durations of :func:`assumed_durations`), the worst bucket checked by direct projection. Every
byte figure is a PROJECTION on fake tensors, never a measurement. Beside each plan: the one ``--max-duration`` that
fits every bucket's typical batch at the same budget (the smallest over buckets of batch size × mean duration),
and padding measured on the batches lhotse's sampler makes of these durations under each.

``padding``: padded frames / all frames over one epoch of lhotse's ``DynamicBucketingSampler`` batches of these
durations, for several bucket counts.

``cpu-check``: the planner's correctness on real tensors: for each model size, a plan at a small budget (fake
tensors), then one real CPU training step per bucket at its planned size, counted by the same tracker
(``project_step(fake=False)``): real peak / budget x safety must be <= 1.

``device-run``: a stored plan's steps on the GPU (``benchmarks/gpu_check.sh``): peak / budget per bucket, OOMs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from asrprec.data.buckets import PaddingTotals, batch_padding, corpus_buckets, planned_sampler
from asrprec.precision.batch_plan import CALIBRATION_SAFETY, Bucket, parse_memory_size, plan_batches
from asrprec.training.batch_plan import joint_factor, step_projector

POLICIES = ("fp32", "amp-fp16", "amp-bf16", "bf16:master", "bf16:stochastic", "bf16:kahan")
TOKENS_PER_SECOND = 3.0  # assumed (500 BPE tokens on LibriSpeech text), as benchmarks/memory_step.py


def assumed_durations(n: int = 20000, seed: int = 0) -> list[float]:
    """ASSUMED LibriSpeech-shaped durations (no manifest here): 75 % normal(14.6 s, 1.8 s), 25 % uniform 1-13 s,
    kept in 1-20 s (icefall's filter). Mean ~12.7 s, near the corpus's 12.3 s (960.9 h / 281,241 utterances);
    most cuts 12-17 s, as LibriSpeech's segmentation (up to 35 s, mostly 10-20 s) gives."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        d = rng.gauss(14.6, 1.8) if rng.random() < 0.75 else rng.uniform(1.0, 13.0)
        if 1.0 <= d <= 20.0:
            out.append(round(d, 2))
    return out


def _cuts(durations: list[float]):
    from lhotse import CutSet, SupervisionSegment
    from lhotse.testing.dummies import dummy_cut

    def cut(i, d):
        c = dummy_cut(i, duration=d, recording_duration=d)
        c.supervisions = [SupervisionSegment(id=f"s{i}", recording_id=c.recording_id, start=0.0, duration=d,
                                             text="x")]
        return c

    return CutSet.from_cuts(cut(i, d) for i, d in enumerate(durations))


def measured_padding(cuts, sampler) -> PaddingTotals:
    """Padding over one epoch of ``sampler``'s batches (frames at 100/s; tokens at TOKENS_PER_SECOND)."""
    tot = PaddingTotals()
    n = 0
    for batch in sampler:
        ds = [c.duration for c in batch]
        tot.add(batch_padding([round(d * 100) for d in ds], [max(1, round(d * TOKENS_PER_SECOND)) for d in ds]))
        n += 1
    tot.batches = n
    return tot


def build_model(size: str, vocab: int, loss: str):
    from asrprec.models import LossConfig, build_transducer

    random.seed(0)
    torch.manual_seed(0)
    return build_transducer(encoder="zipformer", size=size, vocab_size=vocab, loss=LossConfig(loss=loss))


def buckets_of(durations: list[float], num_buckets: int) -> list[Bucket]:
    stats = corpus_buckets(_cuts(durations), num_buckets, tokens_per_second=TOKENS_PER_SECOND)
    return [Bucket(s.max_duration, s.max_tokens, s.min_duration, s.cuts, s.seconds) for s in stats]


def cmd_plan(args) -> None:
    durations = assumed_durations() if not args.cuts else _load_durations(args.cuts)
    source = f"durations of {args.cuts}" if args.cuts else "ASSUMED LibriSpeech-shaped durations (assumed_durations)"
    buckets = buckets_of(durations, args.num_buckets)
    budget = parse_memory_size(args.budget)
    model = build_model(args.size, args.vocab, args.loss)
    cuts = _cuts(durations)
    print(f"# Batch plan per policy: Zipformer {args.size}, loss {args.loss}, vocab {args.vocab}, optimizer "
          f"{args.optimizer}, world size {args.world_size}; budget {budget / 1e9:g} GB x safety {args.safety:g}; "
          f"{len(buckets)} buckets over {len(durations)} cuts ({source}), {TOKENS_PER_SECOND:g} tokens/s assumed; "
          f"torch {torch.__version__}, {datetime.date.today()}. PROJECTIONS (fake tensors), not measurements.")
    out = {"budget_bytes": budget, "safety": args.safety, "policies": {}}
    plans = {}
    for spec in args.policies.split(","):
        policy, _, update = spec.partition(":")
        t0 = time.perf_counter()
        project = step_projector(model, vocab_size=args.vocab, policy=policy, optimizer=args.optimizer,
                                 bf16_update=update or "master", world_size=args.world_size)
        describe = {"size": args.size, "policy": policy, "bf16_update": update or "master", "vocab": args.vocab,
                    "loss": args.loss, "optimizer": args.optimizer}
        twin = next((t for t in TWINS.get(spec, ()) if t in plans), None) if args.derive else None
        if twin is not None:
            plan = derived_plan(plans[twin], project, buckets, budget, args.safety, describe)
            how = f"derived from the {twin} fit: same activations, its fixed part from one projection of its own"
        else:
            plan = plan_batches(project, buckets, budget, safety=args.safety,
                                joint=joint_factor(args.loss, "full", args.vocab), verify=args.verify,
                                describe=describe, light=args.light)
            how = f"fit error on its points <= {plan.fit.max_error:.1%}" + (
                " (4 points for 4 terms: exact by construction)" if args.light else "")
        plans[spec] = plan
        secs = time.perf_counter() - t0
        # one --max-duration for every bucket: the largest whose typical batch (D / mean duration cuts) fits each
        single = min(b.batch_size * (b.seconds / b.cuts) for b in plan.buckets)
        fixed = [max(1, math.floor(single / (b.seconds / b.cuts))) for b in plan.buckets]
        pad_plan = measured_padding(cuts, planned_sampler(cuts, plan.edges, plan.batch_sizes, shuffle=True,
                                                          drop_last=False, seed=0))
        from lhotse.dataset import DynamicBucketingSampler

        pad_single = measured_padding(cuts, DynamicBucketingSampler(cuts, max_duration=single,
                                                                    num_buckets=args.num_buckets, shuffle=True,
                                                                    seed=0))
        print(f"\n## {spec} (planned in {secs:.0f} s; {how})\n")
        print(plan.table())
        print(f"\naudio per batch (epoch mean): plan {plan.mean_batch_seconds():.0f} s in "
              f"{pad_plan.batches} batches; one --max-duration {single:.0f} s (fits every bucket) in "
              f"{pad_single.batches} batches. Padding measured on the sampler's batches: plan "
              f"{pad_plan.frame_fraction:.1%} of frames, {pad_plan.joint_fraction:.1%} of joint cells; one "
              f"--max-duration {pad_single.frame_fraction:.1%}, {pad_single.joint_fraction:.1%}. Batch sizes under "
              f"the one --max-duration: {fixed}")
        out["policies"][spec] = {"plan": plan.to_dict(), "single_max_duration": single, "single_batch_sizes": fixed,
                                 "padding_plan": vars(pad_plan), "padding_single": vars(pad_single),
                                 "plan_batches": pad_plan.batches, "single_batches": pad_single.batches,
                                 "seconds": secs}
        sys.stdout.flush()
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))


# policies whose activations are another's (same cast and autocast): only the fixed part differs
TWINS = {"amp-fp16": ("amp-bf16",), "bf16:kahan": ("bf16:master",), "bf16:stochastic": ("bf16:master",),
         "amp-bf16": ("amp-fp16",)}


def derived_plan(twin, project, buckets, budget, safety, describe):
    """``twin``'s fit with the fixed part (and the optimizer step's) moved by one projection of this policy at the
    twin's first fit point: the bf16 update rules differ only in optimizer state, amp-fp16 and amp-bf16 not at all."""
    from asrprec.precision.batch_plan import _peaks, plan_from_fit

    B, T, U, fb, opt = twin.fit.points[0]
    mine_fb, mine_opt = _peaks(project(B, T, U))
    fit = copy.deepcopy(twin.fit)
    fit.a += mine_fb - fb
    fit.o += mine_opt - opt
    fit.points = [[B, T, U, mine_fb, mine_opt]]
    return plan_from_fit(fit, buckets, budget, safety, describe)


def cmd_padding(args) -> None:
    from lhotse.dataset import DynamicBucketingSampler, SimpleCutSampler

    durations = assumed_durations() if not args.cuts else _load_durations(args.cuts)
    cuts = _cuts(durations)
    print(f"# Padding of lhotse DynamicBucketingSampler(max_duration={args.max_duration:g}) batches over "
          f"{len(durations)} {'ASSUMED LibriSpeech-shaped' if not args.cuts else ''} durations "
          f"(frames: 100/s; joint cells (T, U+1) at {TOKENS_PER_SECOND:g} tokens/s assumed)\n")
    print("| buckets | batches | padded frames / all frames | padded joint cells / all |")
    print("|---|---|---|---|")
    for k in [int(x) for x in args.buckets.split(",")]:
        sampler = DynamicBucketingSampler(cuts, max_duration=args.max_duration, num_buckets=k, shuffle=True, seed=0) \
            if k > 1 else SimpleCutSampler(cuts, max_duration=args.max_duration, shuffle=True, seed=0)
        tot = measured_padding(cuts, sampler)
        print(f"| {k} | {tot.batches} | {tot.frame_fraction:.1%} | {tot.joint_fraction:.1%} |")


def cmd_cpu_check(args) -> None:
    durations = assumed_durations(args.cuts_n, seed=1)
    buckets = buckets_of(durations, args.num_buckets)
    budget = parse_memory_size(args.budget)
    print(f"# CPU check: plans at {budget / 1e9:g} GB x safety {args.safety:g} (fake tensors), then one real CPU step "
          f"per bucket at the planned size counted by the same tracker (project_step(fake=False)); "
          f"{len(buckets)} buckets of ASSUMED LibriSpeech-shaped durations; {args.policy}; "
          f"torch {torch.__version__}, {datetime.date.today()}\n")
    print("| model | bucket max duration (s) | batch size | projected peak (GB) | real CPU peak (GB) | "
          "real / (budget x safety) |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for size in args.sizes.split(","):
        model = build_model(size, args.vocab, "pruned")
        fake = step_projector(model, vocab_size=args.vocab, policy=args.policy, optimizer="scaled_adam")
        real = step_projector(model, vocab_size=args.vocab, policy=args.policy, optimizer="scaled_adam", fake=False)
        plan = plan_batches(fake, buckets, budget, safety=args.safety, joint=1, verify="none", light=args.light)
        for b in plan.buckets:
            res = real(b.batch_size, b.frames, b.tokens)
            peak = max(res.backward_peak, res.optimizer_peak)
            worst = max(worst, peak / plan.cap_bytes)
            print(f"| {size} | {b.max_duration:.2f} | {b.batch_size} | {b.projected_peak_bytes / 1e9:.3f} | "
                  f"{peak / 1e9:.3f} | {peak / plan.cap_bytes:.3f} |", flush=True)
    print(f"\nlargest real / cap: {worst:.3f} ({'within' if worst <= 1 else 'OVER'} the budget in every bucket)")


def cmd_device_run(args) -> None:
    """The plan's steps for real: per bucket (longest first) ``--steps`` training steps at its planned batch of its
    padded shape, the peak (CUDA: ``max_memory_allocated``; CPU, the dry run: the tracker on real tensors) against
    the budget, OOMs counted; then the padding of the plan's batches over the durations it was made for."""
    from asrprec.precision import get_policy
    from asrprec.precision.batch_plan import BatchPlan
    from asrprec.precision.memory_step import project_step
    from asrprec.training.batch_plan import PLAN_BATCH_COUNT, _optimizer
    from asrprec.models import set_batch_count

    stored = json.loads(Path(args.plans).read_text())["policies"][args.policy]
    plan = BatchPlan.from_dict(stored["plan"])
    d = plan.describe
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    print(f"# The plan run for real: Zipformer {d['size']}, {args.policy}, budget {plan.budget_bytes / 1e9:g} GB x "
          f"safety {plan.safety:g} (plan from {args.plans}); {args.steps} steps per bucket at its planned batch, "
          f"padded to the bucket's longest cut; {'max_memory_allocated' if cuda else 'real CPU tensors counted by the tracker'}; "
          f"{torch.cuda.get_device_name(device) if cuda else 'CPU'}, torch {torch.__version__}, {datetime.date.today()}\n")
    print("| bucket max duration (s) | batch size | projected peak (GB) | peak (GB) | peak / budget | projected / peak | OOM |")
    print("|---|---|---|---|---|---|---|")
    ooms, worst = 0, 0.0
    model = build_model(d["size"], d["vocab"], d["loss"])
    set_batch_count(model, PLAN_BATCH_COUNT)
    for b in sorted(plan.buckets, key=lambda b: -b.max_duration)[: args.buckets or None]:
        B, T, U = b.batch_size, b.frames, b.tokens

        def make(dev, B=B, T=T, U=U):
            return (torch.randn(B, T, 80, device=dev), torch.full((B,), T, device=dev),
                    torch.randint(1, d["vocab"], (B, U), device=dev), torch.full((B,), U, device=dev))

        if not cuda:  # the dry run: the same step on real CPU tensors, counted
            res = project_step(lambda: model, make, lambda m, x: m(*x)["loss"], d["policy"], _optimizer(d["optimizer"]),
                               bf16_update=d["bf16_update"], fake=False, cuda_forward=False)
            peak, oom = max(res.backward_peak, res.optimizer_peak), False
        else:
            pol = get_policy(d["policy"], device, bf16_update=d["bf16_update"])
            m = pol.prepare_model(copy.deepcopy(model)).train()
            opt = pol.build_optimizer([p for p in m.parameters() if p.requires_grad], _optimizer(d["optimizer"]))
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            oom = False
            try:
                for _ in range(args.steps):
                    x = make(device)
                    with pol.autocast():
                        loss = m(*x)["loss"]
                    loss.backward()
                    del loss, x
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
            except torch.OutOfMemoryError:
                oom = True
            peak = torch.cuda.max_memory_allocated(device)
            del m, opt
            torch.cuda.empty_cache()
        ooms += oom
        worst = max(worst, peak / plan.budget_bytes)
        print(f"| {b.max_duration:.2f} | {B} | {b.projected_peak_bytes / 1e9:.2f} | {peak / 1e9:.2f} | "
              f"{peak / plan.budget_bytes:.3f} | {b.projected_peak_bytes / max(peak, 1):.2f} | {'yes' if oom else 'no'} |",
              flush=True)
    pad = stored.get("padding_plan", {})
    print(f"\nOOMs: {ooms}; largest peak / budget: {worst:.3f}; padding of the plan's batches (sampler over the "
          f"plan's durations): {pad.get('padded_frames', 0) / max(pad.get('frames', 1), 1):.1%} of frames, "
          f"{pad.get('padded_joint', 0) / max(pad.get('joint', 1), 1):.1%} of joint cells")
    if ooms:
        raise SystemExit(1)


def _load_durations(path: str) -> list[float]:
    from lhotse import load_manifest_lazy

    return [c.duration for c in load_manifest_lazy(path) if 1.0 <= c.duration <= 20.0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("plan")
    a.add_argument("--size", default="medium")
    a.add_argument("--vocab", type=int, default=500)
    a.add_argument("--loss", default="pruned")
    a.add_argument("--optimizer", default="scaled_adam")
    a.add_argument("--world-size", type=int, default=1)
    a.add_argument("--budget", default="80GB")
    a.add_argument("--safety", type=float, default=CALIBRATION_SAFETY)
    a.add_argument("--num-buckets", type=int, default=30)
    a.add_argument("--policies", default=",".join(POLICIES))
    a.add_argument("--cuts", default=None, help="a lhotse manifest whose durations replace the assumed ones")
    a.add_argument("--light", action="store_true", help="four projections per fit instead of six (fit_cost)")
    a.add_argument("--derive", action="store_true",
                   help="bf16 kahan/stochastic from the bf16 master fit and amp-fp16 from amp-bf16 (derived_plan)")
    a.add_argument("--verify", default="worst", choices=("none", "worst", "all"),
                   help="buckets settled by direct projection (plan_batches); none = the fit alone")
    a.add_argument("--json", default=None)
    b = sub.add_parser("padding")
    b.add_argument("--buckets", default="1,2,4,6,8,10,15,20,30,50")
    b.add_argument("--max-duration", type=float, default=1000.0)
    b.add_argument("--cuts", default=None)
    c = sub.add_parser("cpu-check")
    c.add_argument("--sizes", default="tiny,small")
    c.add_argument("--vocab", type=int, default=500)
    c.add_argument("--budget", default="1.5GB")
    c.add_argument("--safety", type=float, default=CALIBRATION_SAFETY)
    c.add_argument("--policy", default="fp32")
    c.add_argument("--num-buckets", type=int, default=4)
    c.add_argument("--cuts-n", type=int, default=400)
    c.add_argument("--light", action="store_true", help="four projections per fit instead of six (fit_cost)")
    e = sub.add_parser("device-run")
    e.add_argument("--plans", default="benchmarks/data/batch_plan_gpu.json", help="a `plan --json` file")
    e.add_argument("--policy", default="amp-bf16", help="which of its plans")
    e.add_argument("--device", default="cuda")
    e.add_argument("--steps", type=int, default=2)
    e.add_argument("--buckets", type=int, default=0, help="only the N longest buckets (0 = all)")
    e.add_argument("--dry-run", action="store_true", help="(for gpu_check.sh; the flags above make it small)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    {"plan": cmd_plan, "padding": cmd_padding, "cpu-check": cmd_cpu_check, "device-run": cmd_device_run}[args.cmd](args)


if __name__ == "__main__":
    main()
