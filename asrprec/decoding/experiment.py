"""Decode an experiment folder as the recipes' ``decode.py`` do, so each recipe only says which data to decode.

:func:`load_for_decoding` rebuilds the model from the folder's ``model.json``, loads the weights that
``--epoch/--avg/--use-averaged-model`` name, fixes the chunking of a causal model and applies the precision
policy; :func:`decode_splits` decodes each split and writes, into the folder, icefall's result files:
``recogs-<split>-<tag>.txt``, ``errs-<split>-<tag>.txt`` and one ``wer-summary-<tag>.json`` for all splits
(``<tag>`` = method, epoch, avg, precision and the options that change results).

``args`` is the namespace of a parser built with :func:`asrprec.training.cli.add_decoding_args` and
:func:`asrprec.training.cli.add_precision_args`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from torch import nn


@dataclass(frozen=True)
class DecodingSetup:
    """A model ready to decode: ``model`` (prepared for inference by ``policy``), the ``tag`` of its result files,
    ``weights`` (which checkpoints were averaged, for the log), ``streaming`` ((chunk, left context) for real
    streaming, or None) and ``min_input_frames`` (the fewest feature frames its encoder takes)."""

    model: nn.Module
    policy: Any
    tag: str
    weights: str
    streaming: tuple[int, int] | None
    min_input_frames: int = 1


def result_tag(args: argparse.Namespace, streaming_tag: str = "") -> str:
    """``<method>-epoch-E-avg-A-<precision>[-use-averaged-model][-beam-K][-<streaming tag>]``."""
    tag = f"{args.decoding_method}-epoch-{args.epoch}-avg-{args.avg}-{args.precision}"
    if args.use_averaged_model:
        tag += "-use-averaged-model"
    if args.decoding_method in ("modified_beam_search", "ctc_prefix_beam_search"):
        tag += f"-beam-{args.beam_size}"
    if streaming_tag:
        tag += f"-{streaming_tag}"
    if getattr(args, "tail_padding", 0.0):
        tag += f"-tail-{args.tail_padding:g}s"
    return tag


def load_for_decoding(exp_dir: Path | str, args: argparse.Namespace) -> DecodingSetup:
    """Rebuild the model of ``exp_dir`` (its ``model.json``), load the weights ``args`` name, configure streaming
    and prepare it for inference under ``args.precision`` on ``args.device``. A ``--decoding-method`` the model has no
    head for raises :class:`~asrprec.training.experiment.ExperimentError` naming the methods it has
    (:func:`asrprec.decoding.check_method`).

    Raises FileNotFoundError / :class:`asrprec.training.experiment.ExperimentError` naming the file and the fix for
    a missing folder or an unreadable ``model.json``, and :class:`asrprec.checkpoint.CheckpointError` for the
    checkpoints."""
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.decoding.api import check_method
    from asrprec.models import build_transducer, configure_streaming
    from asrprec.precision import get_policy
    from asrprec.training.cli import resolve_device
    from asrprec.training.experiment import ExperimentError, read_model_config

    exp_dir = Path(exp_dir)
    if getattr(args, "tail_padding", 0.0) and not args.streaming:
        raise ValueError("--tail-padding applies to --streaming decoding (it ends each live stream with silence)")
    model = build_transducer(**read_model_config(exp_dir))
    try:  # before loading weights: the method must match the heads the folder's model.json describes
        check_method(model, args.decoding_method)
    except ValueError as e:
        raise ExperimentError(f"{exp_dir}: {e}") from None
    weights = load_decoding_weights(model, exp_dir, args.epoch, args.avg, args.use_averaged_model)
    streaming_tag = configure_streaming(model, args.chunk_size, args.left_context_frames, args.streaming)
    policy = get_policy(args.precision, resolve_device(args.device))
    min_frames = model.min_input_frames
    model = policy.prepare_for_inference(model)
    streaming = (args.chunk_size, args.left_context_frames) if args.streaming else None
    return DecodingSetup(model=model, policy=policy, tag=result_tag(args, streaming_tag), weights=weights,
                         streaming=streaming, min_input_frames=min_frames)


def with_tail_padding(cuts: Mapping[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """``--tail-padding S``: each split's cuts followed by S seconds of silence (the stream a sherpa-onnx client
    sends), and True: their features must then be computed from the padded audio (on-the-fly features).
    Without it, the cuts unchanged and False."""
    seconds = getattr(args, "tail_padding", 0.0)
    if not seconds:
        return dict(cuts), False
    from asrprec.data.features import pad_with_silence

    return {split: pad_with_silence(c, seconds) for split, c in cuts.items()}, True


def decode_splits(setup: DecodingSetup, cuts: Mapping[str, Any], make_loader: Callable[[Any], Iterable[dict]],
                  tokenizer, args: argparse.Namespace, exp_dir: Path | str) -> dict[str, dict[str, Any]]:
    """Decode each ``{split: CutSet}`` (through ``make_loader(cuts)``) and write its recogs and errs files and the
    WER summary into ``exp_dir``.

    Cuts the encoder cannot take or whose files are missing (``args.validate_data``, :func:`asrprec.data.check_cuts`;
    a test reference may be empty) and cuts the loader cannot read are left out, counted per reason in the log and
    in the summary (``left_out``, ``left_out_by_reason``), never silently. Returns ``{split: {"wer": ..., "rtfx":
    ..., ...}}`` and prints one line per split.
    """
    from asrprec.data import check_cuts
    from asrprec.decoding import DecodingOptions, LabelLoopingGreedy, decode_dataset
    from asrprec.metrics import write_error_stats, write_recogs

    exp_dir = Path(exp_dir)
    options = DecodingOptions(method=args.decoding_method, beam=args.beam_size,
                              max_sym_per_frame=args.max_sym_per_frame)
    tag = setup.tag
    search = None  # label looping keeps its preallocated state (and CUDA graphs) across batches
    if (args.decoding_method == "greedy_search" and getattr(args, "greedy_method", "frame_looping") == "label_looping"
            and setup.streaming is None):
        from asrprec.decoding.tdt import is_tdt
        from asrprec.decoding.tdt_label_looping import TdtLabelLoopingGreedy

        looping = TdtLabelLoopingGreedy if is_tdt(setup.model) else LabelLoopingGreedy
        search = looping(setup.model, args.max_sym_per_frame)
    summary = {}
    for split, split_cuts in cuts.items():
        split_cuts, report = check_cuts(split_cuts, split=split, mode=getattr(args, "validate_data", "fast"),
                                        min_frames=setup.min_input_frames, require_transcript=False)
        results, stats = decode_dataset(setup.model, make_loader(split_cuts), tokenizer, options, setup.policy.device,
                                        streaming=setup.streaming, search=search,
                                        whole_chunks_only=bool(getattr(args, "tail_padding", 0.0)))
        write_recogs(exp_dir / f"recogs-{split}-{tag}.txt", results)
        wer = write_error_stats(exp_dir / f"errs-{split}-{tag}.txt", results, title=f"{split} {tag}").wer_percent
        left_out = report.dropped + stats["unreadable_cuts"]
        summary[split] = {"wer": wer, **stats, "cuts": report.total, "decoded": len(results), "left_out": left_out,
                          "left_out_by_reason": report.to_dict()["dropped"]}
        note = f"; {left_out} of {report.total} cuts left out, see the log" if left_out else ""
        print(f"{split}: WER {wer:.2f}% ({tag}); RTFx {stats.get('rtfx', float('nan')):.1f}{note}")
    (exp_dir / f"wer-summary-{tag}.json").write_text(json.dumps(summary, indent=1))
    return summary
