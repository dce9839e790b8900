"""Projected GPU memory of one whole training step, part by part, per precision policy (fake tensors, no GPU).

    python benchmarks/memory_step.py --size medium --batch 64 --seconds 15
    python benchmarks/memory_step.py --size medium --max-duration 1000            # the OOM scan's worst batch
    python benchmarks/memory_step.py --max-duration 1000 --icefall-dir ../icefall_zipformer --calibrate

One step = forward under the policy, the configured loss (``--loss pruned|full``, ``--joint-mode full|lean``),
backward, the optimizer's update (``--optimizer scaled_adam|adamw``; ``bf16`` through the policy's
``--bf16-update``), with DDP's gradient buckets (``--world-size`` > 1; torch's ``bucket_cap_mb`` rule,
``asrprec.precision.memory_step.ddp_bucket_bytes``). ``asrprec.precision.memory_step.project_step`` does the
accounting; its docstring says what a projection leaves out. Every figure printed is a projection on fake tensors
and a lower bound of ``torch.cuda.max_memory_allocated``, never a measurement.

``--max-duration D``: the batch is the bucketing sampler's worst, as the OOM scan picks it: lhotse's
``DynamicBucketingSampler(max_duration=D, num_buckets=--num-buckets)`` over the cuts' durations, then
``find_pessimistic_batches`` (as ``asrprec.training.oom.scan_pessimistic_batches``); of its batches the one with
the most padded frames (B x longest cut) is projected. Durations come from ``--cuts`` (a lhotse manifest) or
``--durations uniform:LO:HI:N`` (an assumption, printed with the table). Tokens per utterance:
``--tokens-per-second`` x duration (an assumption; the pruned loss's memory hardly depends on it).

``--icefall-dir DIR``: also project icefall's own Zipformer recipe step (k2-fsa/icefall
``egs/librispeech/ASR/zipformer``: ``model.py``'s ``forward_transducer`` and ``train.py``'s ``compute_loss``, pruned
loss with prune range 5, simple-loss scale 0.5 after warm-up) from the model files in DIR (``zipformer.py``,
``scaling.py``, ``subsampling.py``, ``decoder.py``, ``joiner.py``, and a ``k2`` package providing
``rnnt_loss_smoothed``, ``get_rnnt_prune_ranges``, ``do_rnnt_pruning``, ``rnnt_loss_pruned`` and the Swoosh ops),
with the same tool and the same batch. Its ScaledAdam is asrprec's (the same fp32 state per parameter).
``--calibrate`` prints projected / measured for icefall's published peaks (PR #1700), and asrprec's peak raw and
scaled by that ratio.

MB in the tables = 10^6 bytes, the unit of icefall's log line (``torch.cuda.max_memory_allocated() // 1000000``
in ``zipformer/train.py``), so the published figures compare directly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from asrprec.precision.memory_step import StepMemory, project_step

POLICIES = ("fp32", "amp-fp16", "amp-bf16", "bf16")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_ICEFALL_DIR = REPO.parent / "shared" / "third_party" / "icefall_zipformer"
# every schedule at its final value, as asrprec's OOM scan (asrprec.training.oom); --batch-count changes it
SCHEDULE_BATCH_COUNT = 1e9
# icefall PR #1700, Zipformer medium, max-duration 1000, A100: "peak GPU memory" (icefall's log, 10^6-byte MB)
ICEFALL_MEASURED_MB = {"amp-fp16": 20459, "bf16": 15473, "amp-bf16": 16169}
ICEFALL_MEASURED_WHERE = {"amp-fp16": "train-clean-100, 2 x A100", "bf16": "train-clean-100, 2 x A100",
                          "amp-bf16": "full LibriSpeech, 4 x A100"}
# icefall zipformer/train.py defaults ("medium")
ICEFALL_MEDIUM = dict(num_encoder_layers=(2, 2, 3, 4, 3, 2), downsampling_factor=(1, 2, 4, 8, 4, 2),
                      feedforward_dim=(512, 768, 1024, 1536, 1024, 768), num_heads=(4, 4, 4, 8, 4, 4),
                      encoder_dim=(192, 256, 384, 512, 384, 256), encoder_unmasked_dim=(192, 192, 256, 256, 256, 192),
                      cnn_module_kernel=(31, 31, 15, 15, 15, 31), query_head_dim=32, value_head_dim=12, pos_head_dim=4,
                      pos_dim=48)
MB = 1e6


# -- the two recipes' steps ----------------------------------------------------------------------------------
def asrprec_step(size: str, vocab: int, loss: str, joint_mode: str, prune_range: int):
    """(build_model, loss_fn) of asrprec's recipe step: ``build_transducer`` + ``Transducer.forward``'s loss."""
    from asrprec.models import LossConfig, build_transducer, set_batch_count

    def build():
        random.seed(0)
        torch.manual_seed(0)
        m = build_transducer(encoder="zipformer", size=size, vocab_size=vocab,
                             loss=LossConfig(loss=loss, joint_mode=joint_mode, prune_range=prune_range))
        set_batch_count(m, SCHEDULE_BATCH_COUNT)
        return m

    return build, lambda model, batch: model(*batch)["loss"]


def icefall_step(icefall_dir: Path, vocab: int):
    """(build_model, loss_fn) of icefall's Zipformer-medium recipe step, from the files in ``icefall_dir``."""
    icefall_dir = Path(icefall_dir).resolve()
    if not (icefall_dir / "zipformer.py").is_file():
        raise SystemExit(f"--icefall-dir {icefall_dir}: no zipformer.py there; pass the folder holding icefall's "
                         "egs/librispeech/ASR/zipformer model files and a k2 package")
    # icefall's torch_autocast(enabled=False) islands switch off CUDA autocast; on fake CPU tensors the autocast in
    # force is CPU's, and the stand-in icefall/utils.py in that folder switches it off too when asked so
    os.environ.setdefault("ICEFALL_AUTOCAST_SHIM", "gpu")
    if str(icefall_dir) not in sys.path:
        sys.path.insert(0, str(icefall_dir))
    import k2
    from decoder import Decoder
    from icefall.utils import make_pad_mask, torch_autocast
    from joiner import Joiner
    from scaling import ScaledLinear, ScheduledFloat
    from subsampling import Conv2dSubsampling
    from zipformer import Zipformer2

    cfg = ICEFALL_MEDIUM

    class IcefallStep(torch.nn.Module):
        """icefall's AsrModel with only the transducer head (module names as there)."""

        def __init__(self):
            super().__init__()
            dim = max(cfg["encoder_dim"])
            self.encoder_embed = Conv2dSubsampling(80, cfg["encoder_dim"][0],
                                                   dropout=ScheduledFloat((0.0, 0.3), (20000.0, 0.1)))
            self.encoder = Zipformer2(output_downsampling_factor=2, dropout=ScheduledFloat((0.0, 0.3), (20000.0, 0.1)),
                                      warmup_batches=4000.0, causal=False, **cfg)
            self.decoder = Decoder(vocab_size=vocab, decoder_dim=512, blank_id=0, context_size=2)
            self.joiner = Joiner(encoder_dim=dim, decoder_dim=512, joiner_dim=512, vocab_size=vocab)
            self.simple_am_proj = ScaledLinear(dim, vocab, initial_scale=0.25)
            self.simple_lm_proj = ScaledLinear(512, vocab, initial_scale=0.25)

    def build():
        random.seed(0)
        torch.manual_seed(0)
        m = IcefallStep()
        for name, module in m.named_modules():  # icefall train.py set_batch_count
            if hasattr(module, "batch_count"):
                module.batch_count = SCHEDULE_BATCH_COUNT
            if hasattr(module, "name"):
                module.name = name
        return m

    def loss_fn(m, batch):
        x, x_lens, y, y_lens = batch
        x, x_lens = m.encoder_embed(x.to(m.simple_am_proj.weight.dtype), x_lens)  # bf16: a bf16 input
        mask = make_pad_mask(x_lens, x.size(1))
        enc, enc_lens = m.encoder(x.permute(1, 0, 2), x_lens, mask)
        enc = enc.permute(1, 0, 2)
        sos_y = torch.cat([torch.zeros_like(y[:, :1]), y], dim=1)  # blank-prefixed, padding 0 = blank
        dec = m.decoder(sos_y)
        boundary = torch.zeros((enc.size(0), 4), dtype=torch.int64, device=enc.device)
        boundary[:, 2] = y_lens
        boundary[:, 3] = enc_lens
        lm, am = m.simple_lm_proj(dec), m.simple_am_proj(enc)
        with torch_autocast(enabled=False):
            simple, (px_grad, py_grad) = k2.rnnt_loss_smoothed(
                lm=lm.float(), am=am.float(), symbols=y, termination_symbol=0, lm_only_scale=0.25,
                am_only_scale=0.0, boundary=boundary, reduction="sum", return_grad=True)
        ranges = k2.get_rnnt_prune_ranges(px_grad=px_grad, py_grad=py_grad, boundary=boundary, s_range=5)
        am_p, lm_p = k2.do_rnnt_pruning(am=m.joiner.encoder_proj(enc), lm=m.joiner.decoder_proj(dec), ranges=ranges)
        logits = m.joiner(am_p, lm_p, project_input=False)
        with torch_autocast(enabled=False):
            pruned = k2.rnnt_loss_pruned(logits=logits.float(), symbols=y, ranges=ranges, termination_symbol=0,
                                         boundary=boundary, reduction="sum")
        return 0.5 * simple + pruned  # train.py compute_loss after warm-up

    return build, loss_fn


def batch_maker(B: int, frames: int, U: int, vocab: int):
    """One padded batch: (B, frames, 80) features, full lengths, (B, U) token ids, U tokens each."""
    def make(device):
        return (torch.randn(B, frames, 80, device=device), torch.full((B,), frames, device=device),
                torch.randint(1, vocab, (B, U), device=device), torch.full((B,), U, device=device))
    return make


def optimizer_factory(name: str):
    from asrprec.optim import ScaledAdam

    if name == "scaled_adam":  # batched as on a GPU (it stacks same-shaped tensors for the update)
        return lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0, batched=True)
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)
    raise SystemExit(f"--optimizer must be scaled_adam or adamw, got {name!r}")


# -- the worst batch of a --max-duration --------------------------------------------------------------------
def durations_from(spec: str | None, cuts: str | None, seed: int = 0) -> tuple[list[float], str]:
    if cuts:
        from lhotse import load_manifest_lazy

        return [c.duration for c in load_manifest_lazy(cuts)], f"durations of {cuts}"
    kind, lo, hi, n = spec.split(":")
    if kind != "uniform":
        raise SystemExit(f"--durations must be uniform:LO:HI:N, got {spec!r}")
    g = torch.Generator().manual_seed(seed)
    lo, hi, n = float(lo), float(hi), int(n)
    return (lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).tolist(), \
        f"assumed durations uniform in [{lo:g}, {hi:g}] s ({n} cuts)"


def pessimistic_batches(durations: list[float], max_duration: float, num_buckets: int, tokens_per_second: float,
                        min_s: float = 1.0, max_s: float = 20.0) -> list[dict]:
    """The OOM scan's batches for these durations: [{criterion, B, frames, U, seconds}], 100 frames per second."""
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler
    from lhotse.dataset.sampling.utils import find_pessimistic_batches
    from lhotse.testing.dummies import dummy_cut

    kept = [d for d in durations if min_s <= d <= max_s]
    cuts = CutSet.from_cuts(dummy_cut(i, duration=round(d, 2), recording_duration=round(d, 2))
                            for i, d in enumerate(kept))
    sampler = DynamicBucketingSampler(cuts, max_duration=max_duration, num_buckets=num_buckets, shuffle=True,
                                      drop_last=True, seed=0)
    batches, _ = find_pessimistic_batches(sampler)
    out = []
    for criterion, b in batches.items():
        longest = max(c.duration for c in b)
        out.append(dict(criterion=criterion, B=len(b), frames=int(round(longest * 100)),
                        U=max(1, int(round(longest * tokens_per_second))), seconds=sum(c.duration for c in b)))
    return out


# -- output ---------------------------------------------------------------------------------------------------
def _mb(n: int) -> str:
    return f"{n / MB:,.0f}"


def print_parts(title: str, results: dict[str, StepMemory]) -> None:
    print(f"\n{title}\n")
    names = list(results)
    print("| part (MB = 10^6 bytes) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    rows = [r for r, _ in next(iter(results.values())).rows()]
    for i, part in enumerate(rows):
        print(f"| {part} | " + " | ".join(_mb(results[n].rows()[i][1]) for n in names) + " |")
    print("| peak happens in | " + " | ".join(results[n].peak_phase for n in names) + " |")


def main() -> None:
    global SCHEDULE_BATCH_COUNT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium")
    p.add_argument("--vocab", type=int, default=500)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--loss", default="pruned", help="LossConfig.loss: pruned | full")
    p.add_argument("--joint-mode", default="full", help="LossConfig.joint_mode for --loss full: full | lean")
    p.add_argument("--prune-range", type=int, default=5)
    p.add_argument("--optimizer", default="scaled_adam", help="scaled_adam | adamw")
    p.add_argument("--bf16-update", default="master", help="bf16's update rule (get_policy's bf16_update)")
    p.add_argument("--world-size", type=int, default=2, help="> 1 adds DDP's gradient buckets (icefall ran 2 GPUs)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DistributedDataParallel's bucket_cap_mb")
    p.add_argument("--batch", type=int, default=None, help="utterances (with --seconds), instead of --max-duration")
    p.add_argument("--seconds", type=float, default=15.0, help="padded length of each utterance (with --batch)")
    p.add_argument("--max-duration", type=float, default=None, help="project the OOM scan's worst batch")
    p.add_argument("--num-buckets", type=int, default=30)
    p.add_argument("--durations", default="uniform:1:20:20000", help="uniform:LO:HI:N (assumed durations)")
    p.add_argument("--cuts", default=None, help="a lhotse manifest whose durations replace --durations")
    p.add_argument("--tokens-per-second", type=float, default=3.0, help="assumed tokens per second of audio")
    p.add_argument("--icefall-dir", type=Path, default=None,
                   help="also project icefall's step from this folder: icefall's egs/librispeech/ASR/zipformer model "
                        "code with stand-ins for k2's compiled ops (--calibrate looks for one beside the checkout)")
    p.add_argument("--icefall-policies", default="amp-fp16,amp-bf16,bf16")
    p.add_argument("--calibrate", action="store_true", help="ratios against icefall's published peaks")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--batch-count", type=float, default=SCHEDULE_BATCH_COUNT,
                   help="the batch count every schedule sees (layer skipping, balancer and whitening probabilities, "
                        "dropout; icefall's OOM scan runs at 0)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    SCHEDULE_BATCH_COUNT = args.batch_count
    if args.calibrate and args.icefall_dir is None:
        if not DEFAULT_ICEFALL_DIR.is_dir():
            raise SystemExit(f"--calibrate projects icefall's step: pass --icefall-dir (nothing at the default "
                             f"{DEFAULT_ICEFALL_DIR})")
        args.icefall_dir = DEFAULT_ICEFALL_DIR
    torch.set_num_threads(args.threads)
    if not torch.backends.cuda.is_built():
        print("note: a CPU-only torch build: no fake CUDA forward, so 'CUDA autocast extra' is 0", file=sys.stderr)

    if args.max_duration is not None:
        durations, source = durations_from(args.durations, args.cuts)
        cands = pessimistic_batches(durations, args.max_duration, args.num_buckets, args.tokens_per_second)
        worst = max(cands, key=lambda c: (c["B"] * c["frames"], c["frames"]))
        B, frames, U = worst["B"], worst["frames"], worst["U"]
        batch_desc = (f"the OOM scan's worst batch at --max-duration {args.max_duration:g}, {args.num_buckets} "
                      f"buckets ({source}): {worst['criterion']}, {B} x {frames / 100:g} s padded, U={U}; "
                      "candidates " + "; ".join(f"{c['criterion']}: {c['B']} x {c['frames'] / 100:g} s"
                                                 for c in cands))
    else:
        B, frames = args.batch or 64, int(round(args.seconds * 100))
        U = max(1, int(round(args.seconds * args.tokens_per_second)))
        batch_desc = f"{B} x {args.seconds:g} s, U={U}"
    make = batch_maker(B, frames, U, args.vocab)
    common = dict(ddp=args.world_size > 1, bucket_cap_mb=args.bucket_cap_mb, bf16_update=args.bf16_update,
                  cuda_forward=torch.backends.cuda.is_built())
    opt = optimizer_factory(args.optimizer)
    print(f"# Projected whole training step (fake tensors: lower bound), {batch_desc}; optimizer {args.optimizer}, "
          f"bf16 update {args.bf16_update}, batch count {SCHEDULE_BATCH_COUNT:g}, world size {args.world_size} "
          f"(DDP bucket_cap_mb {args.bucket_cap_mb:g}); "
          f"torch {torch.__version__}, {datetime.date.today()}")
    out: dict = {"batch": dict(B=B, frames=frames, U=U, desc=batch_desc), "asrprec": {}, "icefall": {}}

    def run(name, build, loss_fn, pol):
        t0 = time.perf_counter()
        res = project_step(build, make, loss_fn, pol, opt, **common)
        print(f"({name} {pol}: projected in {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return res

    theirs: dict[str, StepMemory] = {}
    failed: dict[str, str] = {}
    if args.icefall_dir is not None:
        ib, iloss = icefall_step(args.icefall_dir, args.vocab)
        for pol in args.icefall_policies.split(","):
            try:
                theirs[pol] = run("icefall", ib, iloss, pol)
            except Exception as e:  # icefall's current code under a whole-model bf16 cast
                failed[pol] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out["icefall"] = {k: v.as_dict() for k, v in theirs.items()}
        out["icefall_failed"] = failed
    build, loss_fn = asrprec_step(args.size, args.vocab, args.loss, args.joint_mode, args.prune_range)
    ours = {pol: run("asrprec", build, loss_fn, pol) for pol in args.policies.split(",")}
    label = f"asrprec Zipformer {args.size}, loss {args.loss}"
    label += f" ({args.joint_mode})" if args.loss == "full" else ""
    print_parts(label, ours)
    out["asrprec"] = {k: v.as_dict() for k, v in ours.items()}
    if theirs:
        print_parts("icefall Zipformer medium (its model code), pruned loss, prune range 5", theirs)
    for pol, why in failed.items():
        print(f"\nicefall under {pol}: the step fails: {why}")
    if args.calibrate and theirs:
        print_calibration(ours, theirs, out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def print_calibration(ours: dict[str, StepMemory], theirs: dict[str, StepMemory], out: dict) -> None:
    print("\nCalibration on icefall's published peaks (PR #1700, Zipformer medium, max-duration 1000, A100)\n")
    print("| policy | icefall measured MB | icefall projected MB (+ CUDA autocast extra) | projected / measured | "
          "asrprec projected MB: lower bound | asrprec scaled by the ratio: estimate |")
    print("|---|---|---|---|---|---|")
    cal = {}
    for pol, measured in ICEFALL_MEASURED_MB.items():
        if pol not in theirs:
            print(f"| {pol} | {measured:,} ({ICEFALL_MEASURED_WHERE[pol]}) | not projectable | - | "
                  f"{_mb(ours[pol].peak_cuda_estimate) if pol in ours else '-'} | - |")
            continue
        proj = theirs[pol].peak_cuda_estimate
        ratio = proj / (measured * MB)
        cal[pol] = ratio
        mine = ours.get(pol)
        print(f"| {pol} | {measured:,} ({ICEFALL_MEASURED_WHERE[pol]}) | {_mb(theirs[pol].peak)} "
              f"(+ {_mb(theirs[pol].cuda_autocast_extra)}) = {_mb(proj)} | {ratio:.2f} | "
              f"{_mb(mine.peak_cuda_estimate) if mine else '-'} | "
              f"{_mb(mine.peak_cuda_estimate / ratio) if mine else '-'} |")
    out["calibration"] = {"ratio": cal, "measured_mb": ICEFALL_MEASURED_MB}


if __name__ == "__main__":
    main()
