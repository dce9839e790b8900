#!/usr/bin/env python3
"""Decode the espeak test (and dev) speakers with greedy or modified beam search; write recogs, errs, WER.

    python recipes/espeak/decode.py --exp-dir recipes/espeak/exp/default --epoch 8 --avg 3 \
        --decoding-method modified_beam_search --beam-size 4 --precision bf16

A causal Zipformer (trained with --causal) needs --chunk-size and --left-context-frames (simulated streaming);
add --streaming to decode chunk by chunk with the encoder's caches, as a live stream:

    python recipes/espeak/decode.py --exp-dir recipes/espeak/exp/causal --epoch 10 --avg 3 \
        --chunk-size 32 --left-context-frames 128 --streaming
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from asrprec.checkpoint import load_decoding_weights
from asrprec.data import AsrDataModule, DataConfig, load_fbank_cuts
from asrprec.data.features import pad_with_silence
from asrprec.decoding import DecodingOptions, decode_dataset
from asrprec.metrics import write_error_stats, write_recogs
from asrprec.models import build_transducer, configure_streaming
from asrprec.precision import get_policy
from asrprec.tokenizer import Tokenizer
from asrprec.training.cli import add_decoding_args, add_precision_args, resolve_device, setup_logging

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--exp-dir", type=Path, default=HERE / "exp" / "default")
    p.add_argument("--max-duration", type=float, default=300.0)
    p.add_argument("--splits", nargs="+", default=["test", "dev"])
    add_decoding_args(p)
    add_precision_args(p)
    return p


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    model_config = json.loads((args.exp_dir / "model.json").read_text())
    model = build_transducer(**model_config)
    print("weights:", load_decoding_weights(model, args.exp_dir, args.epoch, args.avg, args.use_averaged_model))
    streaming_tag = configure_streaming(model, args.chunk_size, args.left_context_frames, args.streaming)
    policy = get_policy(args.precision, resolve_device(args.device))
    model = policy.prepare_for_inference(model)
    tokenizer = Tokenizer(args.data_dir / "bpe.model")
    cuts = load_fbank_cuts(args.data_dir)
    data = AsrDataModule(DataConfig(max_duration=args.max_duration))
    tag = f"{args.decoding_method}-epoch-{args.epoch}-avg-{args.avg}-{args.precision}"
    if args.use_averaged_model:
        tag += "-use-averaged-model"
    if args.decoding_method == "modified_beam_search":
        tag += f"-beam-{args.beam_size}"
    if streaming_tag:
        tag += f"-{streaming_tag}"
    if args.tail_padding:
        if not args.streaming:
            raise ValueError("--tail-padding applies to --streaming decoding")
        tag += f"-tail-{args.tail_padding:g}s"
        # the audio a sherpa-onnx client sends: the utterance and then silence; features from it
        cuts = {split: pad_with_silence(c, args.tail_padding) for split, c in cuts.items()}
        data = AsrDataModule(DataConfig(max_duration=args.max_duration, on_the_fly_feats=True))
    options = DecodingOptions(method=args.decoding_method, beam=args.beam_size,
                              max_sym_per_frame=args.max_sym_per_frame)
    streaming = (args.chunk_size, args.left_context_frames) if args.streaming else None
    summary = {}
    for split in args.splits:
        results, stats = decode_dataset(model, data.test_dataloader(cuts[split]), tokenizer, options, policy.device,
                                        streaming=streaming, whole_chunks_only=bool(args.tail_padding))
        write_recogs(args.exp_dir / f"recogs-{split}-{tag}.txt", results)
        wer = write_error_stats(args.exp_dir / f"errs-{split}-{tag}.txt", results, title=f"{split} {tag}").wer_percent
        summary[split] = {"wer": wer, **stats}
        print(f"{split}: WER {wer:.2f}% ({tag}); RTFx {stats.get('rtfx', float('nan')):.1f}")
    (args.exp_dir / f"wer-summary-{tag}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
