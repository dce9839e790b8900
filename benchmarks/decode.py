"""Inference precision and greedy-search benchmark: RTFx and WER of each decoding method under each precision mode,
on one model and one data set, in one run.

Precision modes (the same weights every time):

* ``fp32``: the model as trained;
* ``autocast-bf16`` / ``autocast-fp16``: the fp32 model under ``torch.autocast``;
* ``cast-bf16`` / ``cast-fp16``: the whole model cast (``policy.prepare_for_inference`` of ``bf16`` / ``amp-fp16``),
  NeMo's choice for inference (NVIDIA/NeMo PR #9198 reports ~15 % higher RTFx than autocast on GPUs).

Methods: ``greedy_search`` (frame-looping), ``label_looping`` (:class:`asrprec.decoding.LabelLoopingGreedy`,
eager), ``label_looping_graphs`` (the same, captured as CUDA graphs; CUDA only), ``modified_beam_search`` and
``malsd_batch`` (:class:`asrprec.decoding.batched_beam.MalsdBeamSearch`, one search kept for the run, as the
recipes' ``decode.py`` keeps it: its decoder outputs by context and state persist from batch to batch),
``malsd_batch_per_call`` (a new search per batch, a one-off :func:`asrprec.decoding.malsd_beam_search` call; static
shapes on CUDA) and
``malsd_batch_graphs`` (its step captured as a CUDA graph; CUDA only); on a
model with a CTC head (a hybrid decodes both heads; ``--synthetic --ctc`` builds one) ``ctc_greedy_search`` and
``ctc_prefix_beam_search`` (``--beam``). A TDT model (``--loss tdt``) runs the TDT searches under the same names
(:func:`asrprec.decoding.tdt_greedy_search`, :class:`asrprec.decoding.TdtLabelLoopingGreedy`,
:func:`asrprec.decoding.tdt_modified_beam_search`); ``benchmarks/tdt_decode.py`` sets TDT against RNN-T.

Each row: WER (%), RTFx = audio seconds / (encoder + search) seconds, by the wall clock and by this process's CPU
time (on a shared machine the wall clock also counts the time the process waits for a core; with one thread the
CPU time is the work itself), the four times and the search's own RTFx (audio seconds / search CPU seconds),
medians of ``--runs`` timed passes after one warm-up pass, every mode x method interleaved pass by pass; features
are loaded before timing. With a trained model (``--exp-dir``, ``--epoch``, ``--avg``, ``--data-dir``) the WER is
real; ``--synthetic`` decodes random features with random weights (speed only: the blank logit is shifted so greedy
search emits about ``--token-rate`` tokens per encoder frame, as a trained model would), for machines without the
data.

    python benchmarks/decode.py --exp-dir exp --epoch 10 --avg 3 --data-dir data --split test
    python benchmarks/decode.py --synthetic --size small --device cuda --modes fp32,cast-bf16,autocast-bf16
    python benchmarks/decode.py --exp-dir exp --data-dir data --modes fp32 --batch-size 32 --threads 1 --runs 5 \
        --methods label_looping,modified_beam_search,malsd_batch,malsd_batch_per_call
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from asrprec.data.frames import FRAME_SHIFT_S
from asrprec.decoding import (
    LabelLoopingGreedy, TdtLabelLoopingGreedy, check_method, ctc_greedy_search, ctc_prefix_beam_search, greedy_search,
    is_tdt, malsd_beam_search, modified_beam_search, tdt_greedy_search, tdt_modified_beam_search,
)
from asrprec.decoding.batched_beam import MalsdBeamSearch
from asrprec.metrics import compute_wer
from asrprec.models import build_transducer
from asrprec.precision import get_policy

MODES = ("fp32", "autocast-bf16", "autocast-fp16", "cast-bf16", "cast-fp16")
METHODS = ("greedy_search", "label_looping", "label_looping_graphs", "modified_beam_search", "malsd_batch",
           "malsd_batch_per_call", "malsd_batch_graphs", "ctc_greedy_search", "ctc_prefix_beam_search")
GRAPH_METHODS = ("label_looping_graphs", "malsd_batch_graphs")  # CUDA only


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp-dir", type=Path, help="trained model folder (model.json, epoch-N.pt)")
    p.add_argument("--epoch", type=int, default=10)
    p.add_argument("--avg", type=int, default=3)
    p.add_argument("--data-dir", type=Path, help="prepared data (fbank manifests, bpe.model)")
    p.add_argument("--split", default="test")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds of audio per batch")
    p.add_argument("--max-utts", type=int, default=0, help="decode only the first N utterances (0 = all)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="utterances per batch, in the split's order (0 = the loader's batches of --max-duration)")
    p.add_argument("--synthetic", action="store_true", help="random weights and random features (speed only)")
    p.add_argument("--encoder", default="zipformer")
    p.add_argument("--size", default="tiny", help="--synthetic: model preset")
    p.add_argument("--vocab", type=int, default=500, help="--synthetic: vocabulary size")
    p.add_argument("--utts", type=int, default=32, help="--synthetic: utterances (one batch)")
    p.add_argument("--seconds", type=float, default=8.0, help="--synthetic: longest utterance (others 50-100 %%)")
    p.add_argument("--token-rate", type=float, default=0.3, help="--synthetic: greedy tokens per encoder frame")
    p.add_argument("--ctc", action="store_true", help="--synthetic: add a CTC head (its blank calibrated alike)")
    p.add_argument("--tdt-durations", default="", help="--synthetic: a TDT joiner with these durations, e.g. 0,1,2,3,4")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--methods", default="greedy_search,label_looping,label_looping_graphs,modified_beam_search")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-sym-per-frame", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--out", type=Path, help="append the table (markdown) to this file")
    return p


def _csv(text: str, known: tuple[str, ...], what: str) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in known]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {', '.join(known)}")
    return items


def load_trained(args) -> tuple[torch.nn.Module, list[dict], object]:
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.data import AsrDataModule, DataConfig, load_fbank_cuts
    from asrprec.experiment import build_experiment_model
    from asrprec.tokenizer import Tokenizer

    if not (args.exp_dir and args.data_dir):
        raise SystemExit("give --exp-dir and --data-dir (a trained model and its data), or --synthetic")
    model = build_experiment_model(args.exp_dir).eval()  # model.json, as decode.py reads it; no dropout
    print("weights:", load_decoding_weights(model, args.exp_dir, args.epoch, args.avg))
    cuts = load_fbank_cuts(args.data_dir, splits=(args.split,))[args.split]
    if args.max_utts:
        cuts = cuts.subset(first=args.max_utts)
    loader = AsrDataModule(DataConfig(max_duration=args.max_duration)).test_dataloader(cuts)
    batches = [{k: batch[k] for k in ("features", "feature_lens", "texts")} for batch in loader]
    return model, batches, Tokenizer(args.data_dir / "bpe.model")


def rebatch(batches: list[dict], size: int) -> list[dict]:
    """The same utterances in batches of ``size`` (the last one smaller), padding trimmed to each batch's longest."""
    feats = [b["features"][i, : int(n)] for b in batches for i, n in enumerate(b["feature_lens"])]
    texts = [t for b in batches for t in (b["texts"] or [None] * len(b["feature_lens"]))]
    out = []
    for start in range(0, len(feats), size):
        chunk = feats[start : start + size]
        lens = torch.tensor([f.shape[0] for f in chunk])
        out.append({"features": torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True), "feature_lens": lens,
                    "texts": texts[start : start + size] if texts[0] is not None else None})
    return out


def make_synthetic(args) -> tuple[torch.nn.Module, list[dict], None]:
    torch.manual_seed(0)
    durations = [int(d) for d in args.tdt_durations.split(",") if d.strip()]
    loss = {"loss": "tdt", "tdt_durations": durations} if durations else None
    model = build_transducer(encoder=args.encoder, size=args.size, vocab_size=args.vocab,
                             ctc={} if args.ctc else None, loss=loss).eval()
    g = torch.Generator().manual_seed(0)
    frames = int(args.seconds / FRAME_SHIFT_S)
    lens = torch.linspace(frames // 2, frames, args.utts).long().flip(0)
    feats = torch.randn(args.utts, frames, 80, generator=g)
    batches = [{"features": feats, "feature_lens": lens, "texts": None}]
    _calibrate_blank(model, batches[0], args.token_rate)
    if args.ctc:
        _vary_ctc_head(model, batches[0])
        _calibrate_blank(model, batches[0], args.token_rate, ctc=True)
    return model, batches, None


@torch.inference_mode()
def _vary_ctc_head(model, batch) -> None:
    """Random CTC weights on the centred, scaled encoder output: a fresh encoder's output is mostly a per-channel
    constant, on which a random head would emit the same token on every frame."""
    enc, _ = model.encode(batch["features"], batch["feature_lens"])
    mean, std = enc.mean(dim=(0, 1)), enc.std(dim=(0, 1))
    lin = model.ctc_output[1]
    lin.weight.copy_(torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(1)) * 3.0
                     / enc.shape[-1] ** 0.5 / std)
    lin.bias.copy_(-(lin.weight @ mean))


@torch.inference_mode()
def _calibrate_blank(model, batch, rate: float, ctc: bool = False) -> None:
    """Shift the blank logit (bisection) until greedy search (``ctc``: of the CTC head) emits about ``rate`` tokens
    per encoder frame."""
    enc, lens = model.encode(batch["features"], batch["feature_lens"])
    bias = model.ctc_output[1].bias if ctc else model.joiner.output_linear.bias
    base = bias[model.blank_id].item()
    lo, hi = -20.0, 20.0
    for _ in range(14):
        mid = (lo + hi) / 2
        bias[model.blank_id] = base + mid
        if ctc:
            hyps = ctc_greedy_search(model.ctc_log_probs(enc), lens)
        else:
            hyps = (tdt_greedy_search if is_tdt(model) else greedy_search)(model, enc, lens)
        got = sum(map(len, hyps)) / float(lens.sum())
        lo, hi = (mid, hi) if got > rate else (lo, mid)
    bias[model.blank_id] = base + (lo + hi) / 2


def variant(model, mode: str, device: str):
    """(model, autocast context factory) for a precision mode."""
    if mode.startswith("cast-"):
        policy = get_policy("bf16" if mode == "cast-bf16" else "amp-fp16", device)
        return policy.prepare_for_inference(copy.deepcopy(model)), lambda: torch.autocast(device, enabled=False)
    m = get_policy("fp32", device).prepare_for_inference(copy.deepcopy(model))
    if mode == "fp32":
        return m, lambda: torch.autocast(device, enabled=False)
    dtype = torch.bfloat16 if mode == "autocast-bf16" else torch.float16
    return m, lambda: torch.autocast(device, dtype=dtype)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def searcher(model, method: str, args):
    if method == "ctc_greedy_search":
        return lambda enc, lens: ctc_greedy_search(model.ctc_log_probs(enc), lens, blank_id=model.blank_id)
    if method == "ctc_prefix_beam_search":
        return lambda enc, lens: ctc_prefix_beam_search(model.ctc_log_probs(enc), lens, args.beam,
                                                        blank_id=model.blank_id)
    tdt = is_tdt(model)  # a TDT joiner: the searches that jump by the predicted durations
    if method == "greedy_search":
        greedy = tdt_greedy_search if tdt else greedy_search
        return lambda enc, lens: greedy(model, enc, lens, max_sym_per_frame=args.max_sym_per_frame)
    if method == "modified_beam_search":
        if tdt:
            return lambda enc, lens: tdt_modified_beam_search(model, enc, lens, args.beam, args.max_sym_per_frame)
        return lambda enc, lens: modified_beam_search(model, enc, lens, beam=args.beam)
    graphs = method in GRAPH_METHODS
    if method == "malsd_batch_per_call":
        return lambda enc, lens: malsd_beam_search(model, enc, lens, args.beam, args.max_sym_per_frame)
    if method.startswith("malsd_batch"):
        return MalsdBeamSearch(model, args.beam, args.max_sym_per_frame, use_cuda_graphs=graphs)
    looping = TdtLabelLoopingGreedy if tdt else LabelLoopingGreedy
    return looping(model, args.max_sym_per_frame, use_cuda_graphs=graphs)


@torch.inference_mode()
def run_all(setups: dict, batches, device: str, runs: int) -> dict:
    """Decode every batch with each setup ``(model, autocast, search)`` ``runs + 1`` times, all setups interleaved
    pass by pass (so a shared machine's load changes hit them alike; the first pass warms up). Per setup: hyps and
    the medians of encoder and search wall seconds and encoder and search CPU seconds (this process)."""
    times = {key: ([], [], [], []) for key in setups}
    hyps = {}
    for run in range(runs + 1):
        for key, (model, autocast, search) in setups.items():
            te = ts = ce = cs = 0.0
            out = []
            for batch in batches:
                feats, lens = batch["features"].to(device), batch["feature_lens"].to(device)
                with autocast():
                    _sync(device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    enc, enc_lens = model.encode(feats, lens)
                    _sync(device)
                    t1, c1 = time.perf_counter(), time.process_time()
                    out += search(enc, enc_lens)
                    _sync(device)
                    t2, c2 = time.perf_counter(), time.process_time()
                te, ts, ce, cs = te + t1 - t0, ts + t2 - t1, ce + c1 - c0, cs + c2 - c1
            hyps[key] = out
            if run:
                for acc, v in zip(times[key], (te, ts, ce, cs)):
                    acc.append(v)
    return {key: (hyps[key], *(statistics.median(a) for a in times[key])) for key in setups}


def main(argv=None) -> str:
    args = get_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = _csv(args.modes, MODES, "modes")
    methods = _csv(args.methods, METHODS, "methods")
    if not args.device.startswith("cuda"):  # CUDA graphs exist only on CUDA devices
        methods = [m for m in methods if m not in GRAPH_METHODS]
    model, batches, tokenizer = make_synthetic(args) if args.synthetic else load_trained(args)
    if args.batch_size:
        batches = rebatch(batches, args.batch_size)
    for method in methods:  # a method the model has no head for (a CTC method without --ctc / --use-ctc ...)
        try:
            check_method(model, "greedy_search" if method.startswith("label_looping") else
                         "malsd_batch" if method.startswith("malsd_batch") else method)
        except ValueError as e:
            raise SystemExit(f"--methods {method}: {e}") from None
    audio = sum(float(b["feature_lens"].sum()) for b in batches) * FRAME_SHIFT_S
    refs = [t.split() for b in batches for t in (b["texts"] or [])]
    n_utts = sum(len(b["feature_lens"]) for b in batches)
    lines = ["| mode | method | WER % | RTFx (wall) | RTFx (CPU) | encoder s | search s | encoder CPU s | search CPU s "
             "| tokens | same as greedy_search | search RTFx (CPU) |", "|---" * 12 + "|"]
    print("\n".join(lines), flush=True)
    setups = {}
    for mode in modes:
        m, autocast = variant(model, mode, args.device)
        for method in methods:
            setups[mode, method] = (m, autocast, searcher(m, method, args))
    results = run_all(setups, batches, args.device, args.runs)
    for (mode, method), (hyps, te, ts, ce, cs) in results.items():
        same = "-"
        if method.startswith("label_looping") and (mode, "greedy_search") in results:
            differ = sum(a != b for a, b in zip(hyps, results[mode, "greedy_search"][0]))
            same = "yes" if differ == 0 else f"no: {differ} of {len(hyps)} utterances differ"
        if method == "malsd_batch_graphs" and (mode, "malsd_batch") in results:  # the replayed graph's decisions
            differ = sum(a != b for a, b in zip(hyps, results[mode, "malsd_batch"][0]))
            same = "yes (vs malsd_batch)" if differ == 0 else f"no: {differ} of {len(hyps)} differ from malsd_batch"
        wer = "-"
        if tokenizer is not None:
            wer = f"{compute_wer(refs, [tokenizer.decode(h).split() for h in hyps]).wer_percent:.2f}"
        row = (f"| {mode} | {method} | {wer} | {audio / (te + ts):.1f} | {audio / (ce + cs):.1f} | {te:.2f} | "
               f"{ts:.2f} | {ce:.2f} | {cs:.2f} | {sum(map(len, hyps))} | {same} | {audio / cs:.1f} |")
        lines.append(row)
        print(row, flush=True)
    clock, at = ("wall", 2) if args.device.startswith("cuda") else ("CPU", 4)  # a GPU's work is not the CPU's time
    for mode in modes:  # the beam searches' own speed against each other, in this run
        for method in ("malsd_batch", "malsd_batch_per_call", "malsd_batch_graphs"):
            if (mode, method) in results and (mode, "modified_beam_search") in results:
                ratio = results[mode, "modified_beam_search"][at] / results[mode, method][at]
                lines.append(f"\n{mode}: {method}'s search RTFx ({clock}) is {ratio:.2f}x modified_beam_search's")
                print(lines[-1], flush=True)
    n_batches = len(batches)
    source = (f"synthetic: random {args.encoder} {args.size}, V={args.vocab}, {n_utts} utterances x <= {args.seconds} s, "
              f"blank shifted for {args.token_rate} tokens/frame" if args.synthetic else
              f"{args.exp_dir} epoch {args.epoch} avg {args.avg}, {args.split}: {n_utts} utterances")
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else _cpu_name()
    header = (f"\n### Decoding: precision modes x methods ({device}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, {datetime.date.today()})\n\n{source}; {audio:.0f} s of audio; beam {args.beam}, "
              f"max_sym_per_frame {args.max_sym_per_frame}; {n_batches} batches; median of {args.runs} runs after a "
              "warm-up.\n")
    table = header + "\n" + "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    main()
