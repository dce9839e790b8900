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
from typing import Any, Iterable, Mapping

from torch import nn


@dataclass(frozen=True)
class DecodingSetup:
    """A model ready to decode: ``model`` (prepared for inference by ``policy``), the ``tag`` of its result files,
    ``weights`` (which checkpoints were averaged, for the log) and ``streaming`` ((chunk, left context) for real
    streaming, or None)."""

    model: nn.Module
    policy: Any
    tag: str
    weights: str
    streaming: tuple[int, int] | None


def result_tag(args: argparse.Namespace, streaming_tag: str = "") -> str:
    """``<method>-epoch-E-avg-A-<precision>[-use-averaged-model][-beam-K][-<streaming tag>]``."""
    tag = f"{args.decoding_method}-epoch-{args.epoch}-avg-{args.avg}-{args.precision}"
    if args.use_averaged_model:
        tag += "-use-averaged-model"
    if args.decoding_method == "modified_beam_search":
        tag += f"-beam-{args.beam_size}"
    if streaming_tag:
        tag += f"-{streaming_tag}"
    return tag


def load_for_decoding(exp_dir: Path | str, args: argparse.Namespace) -> DecodingSetup:
    """Rebuild the model of ``exp_dir`` (its ``model.json``), load the weights ``args`` name, configure streaming
    and prepare it for inference under ``args.precision`` on ``args.device``."""
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.models import build_transducer, configure_streaming
    from asrprec.precision import get_policy
    from asrprec.training.cli import resolve_device

    exp_dir = Path(exp_dir)
    config_path = exp_dir / "model.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: {exp_dir} is not a training folder; fix: pass the "
                                f"--exp-dir that train.py wrote")
    model = build_transducer(**json.loads(config_path.read_text()))
    weights = load_decoding_weights(model, exp_dir, args.epoch, args.avg, args.use_averaged_model)
    streaming_tag = configure_streaming(model, args.chunk_size, args.left_context_frames, args.streaming)
    policy = get_policy(args.precision, resolve_device(args.device))
    model = policy.prepare_for_inference(model)
    streaming = (args.chunk_size, args.left_context_frames) if args.streaming else None
    return DecodingSetup(model=model, policy=policy, tag=result_tag(args, streaming_tag), weights=weights,
                         streaming=streaming)


def decode_splits(setup: DecodingSetup, loaders: Mapping[str, Iterable[dict]], tokenizer, args: argparse.Namespace,
                  exp_dir: Path | str) -> dict[str, dict[str, float]]:
    """Decode each ``{split: loader}`` and write its recogs and errs files and the WER summary into ``exp_dir``.

    Returns ``{split: {"wer": ..., "rtfx": ..., ...}}`` and prints one line per split.
    """
    from asrprec.decoding import DecodingOptions, decode_dataset
    from asrprec.metrics import write_error_stats, write_recogs

    exp_dir = Path(exp_dir)
    options = DecodingOptions(method=args.decoding_method, beam=args.beam_size,
                              max_sym_per_frame=args.max_sym_per_frame)
    tag = setup.tag
    summary = {}
    for split, loader in loaders.items():
        results, stats = decode_dataset(setup.model, loader, tokenizer, options, setup.policy.device,
                                        streaming=setup.streaming)
        write_recogs(exp_dir / f"recogs-{split}-{tag}.txt", results)
        wer = write_error_stats(exp_dir / f"errs-{split}-{tag}.txt", results, title=f"{split} {tag}").wer_percent
        summary[split] = {"wer": wer, **stats}
        print(f"{split}: WER {wer:.2f}% ({tag}); RTFx {stats.get('rtfx', float('nan')):.1f}")
    (exp_dir / f"wer-summary-{tag}.json").write_text(json.dumps(summary, indent=1))
    return summary
