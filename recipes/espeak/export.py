#!/usr/bin/env python3
"""Export a trained model to the ONNX files sherpa-onnx runs: encoder.onnx, decoder.onnx, joiner.onnx, tokens.txt.

    python recipes/espeak/export.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 --use-averaged-model --int8

A causal Zipformer (trained with --causal) exports as a streaming model at one trained chunk size and left context:

    python recipes/espeak/export.py --exp-dir recipes/espeak/exp/causal --epoch 10 --avg 3 --use-averaged-model \
        --streaming --chunk-size 32 --left-context-frames 128 --int8

The files land in --out-dir (default: a folder in --exp-dir named after the weights). --int8 adds encoder.int8.onnx
... (onnxruntime dynamic quantisation), --fp16 adds encoder.fp16.onnx ...; tokens.txt serves every variant. Decode
them with recipes/espeak/onnx_decode.py (onnxruntime or sherpa-onnx), or with sherpa-onnx directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asrprec.export import convert_fp16, export_offline, export_streaming, load_experiment_model, quantize_int8
from asrprec.tokenizer import Tokenizer
from asrprec.training.cli import setup_logging

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data", help="holds bpe.model (tokens.txt comes from it)")
    p.add_argument("--exp-dir", type=Path, default=HERE / "exp" / "default")
    p.add_argument("--epoch", type=int, required=True, help="export epoch-N.pt (averaged with --avg)")
    p.add_argument("--avg", type=int, default=1, help="average the last AVG epoch checkpoints ending at --epoch")
    p.add_argument("--use-averaged-model", action="store_true",
                   help="the running average of the weights over those epochs (as decode.py)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--streaming", action="store_true",
                   help="causal Zipformer: export a streaming encoder (sherpa-onnx OnlineRecognizer)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="50 Hz frames per chunk; one the causal model was trained with (needed for --streaming; "
                        "without --streaming it exports simulated streaming, -1 = full context)")
    p.add_argument("--left-context-frames", type=int, default=None,
                   help="left context in 50 Hz frames; one the causal model was trained with")
    p.add_argument("--int8", action="store_true", help="also write the int8 (dynamically quantised) variant")
    p.add_argument("--fp16", action="store_true", help="also write the fp16 variant (float32 inputs and outputs)")
    return p


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    model, _, source = load_experiment_model(args.exp_dir, args.epoch, args.avg, args.use_averaged_model)
    print("weights:", source)
    tokenizer = Tokenizer(args.data_dir / "bpe.model")
    tag = f"epoch-{args.epoch}-avg-{args.avg}" + ("-use-averaged-model" if args.use_averaged_model else "")
    if args.streaming:
        if args.chunk_size is None or args.left_context_frames is None:
            raise ValueError("--streaming needs --chunk-size and --left-context-frames (values the model was "
                             "trained with, e.g. --chunk-size 32 --left-context-frames 128)")
        out_dir = args.out_dir or args.exp_dir / f"onnx-{tag}-streaming-chunk-{args.chunk_size}-left-" \
                                                 f"{args.left_context_frames}"
        exported = export_streaming(model, tokenizer, out_dir, chunk_size=args.chunk_size,
                                    left_context_frames=args.left_context_frames)
    else:
        chunking = {"chunk_size": args.chunk_size if args.chunk_size is not None else -1,
                    "left_context_frames": args.left_context_frames if args.left_context_frames is not None else -1}
        out_dir = args.out_dir or args.exp_dir / f"onnx-{tag}"
        exported = export_offline(model, tokenizer, out_dir, **chunking)
    written = [exported]
    if args.int8:
        written.append(quantize_int8(exported))
    if args.fp16:
        written.append(convert_fp16(exported))
    (out_dir / "export.json").write_text(json.dumps(
        {"exp_dir": str(args.exp_dir), "weights": source, "streaming": args.streaming,
         "chunk_size": args.chunk_size, "left_context_frames": args.left_context_frames}, indent=1))
    for e in written:
        print(f"wrote {e.encoder.name}, {e.decoder.name}, {e.joiner.name}")
    print(f"in {out_dir} with tokens.txt")


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError, ImportError) as e:
        sys.exit(f"error: {e}")
