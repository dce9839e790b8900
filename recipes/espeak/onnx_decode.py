#!/usr/bin/env python3
"""Decode the espeak test (and dev) speakers with an exported model (recipes/espeak/export.py), by onnxruntime or by
sherpa-onnx itself, with greedy search; write recogs, errs and WER files as decode.py does, and the word times,
ctm-<split>-<tag>.txt, and segments-<split>-<tag>.txt, from the runtime's token times (sherpa-onnx's ``timestamps``;
onnxruntime: the encoder frame that emitted each token, a TDT token's duration). A CTC export (model.onnx;
--ctc for the CTC head of a hybrid's folder) runs CTC greedy search (sherpa-onnx's zipformer CTC recognisers).

    python recipes/espeak/onnx_decode.py --onnx-dir recipes/espeak/exp/fp32/onnx-epoch-10-avg-3 [--variant int8] \
        [--runtime sherpa-onnx] [--reference recipes/espeak/exp/fp32/recogs-test-greedy_search-....txt]

onnxruntime reads the prepared fbank features (as decode.py); sherpa-onnx reads the audio and computes its own.
Streaming exports are decoded as sherpa-onnx clients send streams: the audio followed by --tail-padding seconds of
silence (0.66 in sherpa-onnx's examples; onnxruntime then computes the features from that audio too), whole chunks
only; decode.py --streaming --tail-padding 0.66 scores the PyTorch model on the same streams. --reference (recogs
files of decode.py) prints how many recognitions are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from asrprec.data import AsrDataModule, DataConfig, load_fbank_cuts
from asrprec.data.features import at_feature_rate, pad_with_silence, report_audio_formats
from asrprec.data.frames import FRAME_SHIFT_S
from asrprec.timestamps import FRAME_SHIFT_S as ENCODER_FRAME_S
from asrprec.timestamps import ctm_path, segments_path, words_from_token_times, write_ctm, write_segments
from asrprec.export import OnnxCtcOfflineModel, OnnxCtcStreamingModel, load_onnx_model
from asrprec.export.sherpa import recognize_timed
from asrprec.metrics import RtfxMeter, read_recogs, write_error_stats, write_recogs
from asrprec.tokenizer import Tokenizer
from asrprec.cli import setup_logging

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--onnx-dir", type=Path, required=True, help="the folder export.py wrote")
    p.add_argument("--variant", choices=("int8", "fp16"), default=None, help="decode encoder.<variant>.onnx ...")
    p.add_argument("--runtime", choices=("onnxruntime", "sherpa-onnx"), default="onnxruntime")
    p.add_argument("--ctc", action="store_true",
                   help="decode the CTC head's model.onnx of a hybrid export (a CTC-only export is found without it)")
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--res-dir", type=Path, default=None, help="where results go (default: --onnx-dir)")
    p.add_argument("--splits", nargs="+", default=["test", "dev"])
    p.add_argument("--max-duration", type=float, default=300.0)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--tail-padding", type=float, default=0.66, metavar="SECONDS",
                   help="streaming exports: silence appended to each utterance's audio")
    p.add_argument("--batch", type=int, default=8,
                   help="utterances per encoder call (int8 quantises activations with one scale per call)")
    p.add_argument("--reference", type=Path, nargs="*", default=[],
                   help="recogs files to compare with (the split is read from each file's name)")
    return p


def is_ctc(model) -> bool:
    return isinstance(model, (OnnxCtcOfflineModel, OnnxCtcStreamingModel))


def decode_split(args, model, tokenizer, cuts, data, streaming):
    """``(cut_id, ref_words, hyp_words)`` per cut, the RTFx meter, and each cut's word spans from the runtime's
    token times."""
    meter = RtfxMeter()
    results = []
    if args.runtime == "sherpa-onnx":
        cuts = list(cuts)
        waves = [c.load_audio().mean(axis=0) for c in cuts]  # mono: other channels mixed down
        seconds = sum(c.duration for c in cuts)
        report_audio_formats(cuts)
        with meter.measure(audio_seconds=seconds):
            hyps = recognize_timed(args.onnx_dir, waves, streaming=streaming, variant=args.variant,
                                   num_threads=args.num_threads, batch=args.batch, tail_padding_s=args.tail_padding,
                                   ctc=is_ctc(model), sample_rates=[c.sampling_rate for c in cuts])
        for cut, hyp in zip(cuts, hyps):
            results.append((cut.id, cut.supervisions[0].text.split(), tokenizer.decode(hyp.ids).split()))
        return results, meter, [(cut.id, hyp.words(cut.duration)) for cut, hyp in zip(cuts, hyps)]
    seconds = {c.id: c.duration for c in cuts}  # the words stay inside the audio (no tail padding)
    words = []
    if streaming:
        # the audio a sherpa-onnx client sends, features computed from it (as sherpa-onnx does)
        cuts = pad_with_silence(at_feature_rate(cuts), args.tail_padding)
        data = AsrDataModule(DataConfig(max_duration=args.max_duration, on_the_fly_feats=True))
    for batch in data.test_dataloader(cuts):
        for i in range(0, len(batch["cut_ids"]), args.batch):
            part = slice(i, i + args.batch)
            lens = batch["feature_lens"][part]
            feats = batch["features"][part, : int(lens.max())]
            with meter.measure(audio_seconds=float(lens.sum()) * FRAME_SHIFT_S):
                hyps = model.decode(feats, lens, return_frames=True)
            for cut_id, ref, hyp in zip(batch["cut_ids"][part], batch["texts"][part], hyps):
                results.append((cut_id, ref.split(), tokenizer.decode(hyp.tokens).split()))
                words.append((cut_id, words_from_token_times(
                    [tokenizer.id_to_piece(t) for t in hyp.tokens], [f * ENCODER_FRAME_S for f in hyp.frames],
                    seconds[cut_id], durations=hyp.durations)))
    return results, meter, words


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    torch.set_num_threads(args.num_threads)
    model = load_onnx_model(args.onnx_dir, args.variant, num_threads=args.num_threads, ctc=args.ctc)
    tokenizer = Tokenizer(args.data_dir / "bpe.model")
    if tokenizer.vocab_size != model.vocab_size:
        raise ValueError(f"{args.data_dir / 'bpe.model'} has {tokenizer.vocab_size} tokens but the model emits "
                         f"{model.vocab_size}: pass the --data-dir it was trained on")
    cuts = load_fbank_cuts(args.data_dir, splits=tuple(args.splits))
    data = AsrDataModule(DataConfig(max_duration=args.max_duration))
    res_dir = args.res_dir or args.onnx_dir
    tag = f"{args.runtime}-{'ctc_' if is_ctc(model) else ''}greedy_search" + \
        (f"-{args.variant}" if args.variant else "") + ("-streaming" if model.streaming else "")
    references = {}
    for path in args.reference:
        split = next((s for s in args.splits if f"-{s}-" in path.name), None)
        if split is None:
            raise ValueError(f"cannot tell the split of {path} (its name holds none of {args.splits})")
        references.setdefault(split, []).append((path.name, read_recogs(path)))
    summary = {}
    for split in args.splits:
        results, meter, words = decode_split(args, model, tokenizer, cuts[split], data, model.streaming)
        write_recogs(res_dir / f"recogs-{split}-{tag}.txt", results)
        write_ctm(ctm_path(res_dir, split, tag), words)  # word times and segments beside the recogs
        write_segments(segments_path(res_dir, split, tag), words)
        wer = write_error_stats(res_dir / f"errs-{split}-{tag}.txt", results, title=f"{split} {tag}").wer_percent
        summary[split] = {"wer": wer, "rtfx": meter.rtfx, "utterances": len(results)}
        line = f"{split}: WER {wer:.2f}% ({tag}); RTFx {meter.rtfx:.1f}"
        print(line)
        for name, ref in references.get(split, []):
            same = sum(ref[c][1] == hyp for c, _, hyp in results if c in ref)
            summary[split].setdefault("identical_to", {})[name] = same
            print(f"  identical to {name} on {same}/{len(results)} ({100.0 * same / len(results):.1f} %)")
    (res_dir / f"wer-summary-{tag}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError, ImportError) as e:
        sys.exit(f"error: {e}")
