"""Decode an experiment folder as the recipes' ``decode.py`` do, so each recipe only says which data to decode.

:func:`load_for_decoding` rebuilds the model from the folder's ``model.json``, loads the weights that
``--epoch/--avg/--use-averaged-model`` name, fixes the chunking of a causal model and applies the precision
policy; :func:`decode_splits` decodes each split and writes, into the folder, icefall's result files:
``recogs-<split>-<tag>.txt``, ``errs-<split>-<tag>.txt`` and one ``wer-summary-<tag>.json`` for all splits
(``<tag>`` = method, epoch, avg, precision and the options that change results).

What to decode is one :class:`DecodeConfig` (its fields are the recipes' decoding flags,
:func:`add_decoding_args`), in the precision a
:class:`~asrprec.precision.PrecisionOptions` names.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from torch import nn

from asrprec.config import add_dataclass_args, dataclass_from_args, option
from asrprec.data.validate import CHECK_MODES

from asrprec.models.compile import COMPILE_DYNAMIC, COMPILE_MODES, COMPILE_REGIONS
from asrprec.models.icefall import icefall_args_option, parse_icefall_source

from .api import METHODS, DecodingOptions
from .label_looping import DEFAULT_GREEDY_METHOD, GREEDY_METHODS


@dataclass
class DecodeConfig:
    """Which weights of an experiment to decode, with which search (the recipes' ``decode.py`` flags)."""

    epoch: int | None = option(None, help="decode with epoch-N.pt (averaged with --avg); required unless --init-from")
    init_from: str = option("", metavar="icefall:FILE",
                            help="decode an icefall Zipformer checkpoint instead of the folder's (results go to "
                                 "--exp-dir)")
    icefall_args: str = icefall_args_option()
    allow_nonfinite: bool = option(False, help="load checkpoints whose weights hold NaN or Inf (refused by default, "
                                               "naming the tensor) with a warning, to debug a run that diverged")
    avg: int = option(1, help="average the last AVG epoch checkpoints ending at --epoch")
    use_averaged_model: bool = option(
        False, help="decode with the mean of the weights sampled (every --average-period batches) after epoch "
                    "EPOCH-AVG up to epoch EPOCH, from the running averages in the two checkpoints (icefall's "
                    "--use-averaged-model), instead of the mean of the AVG epoch-end weights")
    validate_data: str = option("fast", choices=CHECK_MODES,
                                help="leave out (and report) cuts the encoder cannot take or whose files are missing; "
                                     "full also decodes every feature file first")
    decoding_method: str = option("greedy_search", choices=METHODS,
                                  help="greedy_search / modified_beam_search / malsd_batch (the batched ALSD beam "
                                       "search, RNN-T and TDT) decode the transducer, ctc_greedy_search "
                                       "/ ctc_prefix_beam_search the CTC head (a hybrid model takes all four)")
    beam_size: int = option(4, help="modified_beam_search, malsd_batch and ctc_prefix_beam_search: hypotheses kept "
                                    "per utterance")
    max_sym_per_frame: int = option(1, help="at most this many tokens per encoder frame: greedy_search, and both "
                                            "searches of a TDT model (NeMo's max_symbols)")
    greedy_method: str = option(DEFAULT_GREEDY_METHOD, choices=GREEDY_METHODS,
                                help="greedy_search by label looping (asrprec.decoding.LabelLoopingGreedy: batched, "
                                     "CUDA graphs on a GPU) or by frame looping (asrprec.decoding.greedy_search); the "
                                     "same results. A TDT model: TdtLabelLoopingGreedy or tdt_greedy_search")
    chunk_size: int | None = option(None, help="causal Zipformer only (required there): decode in chunks of this many "
                                               "50 Hz frames (simulated streaming), or -1 for full context")
    left_context_frames: int | None = option(None, help="causal Zipformer only: left context in 50 Hz frames for "
                                                        "chunked decoding (-1 = all)")
    streaming: bool = option(False, help="causal Zipformer only: decode as live streams, chunk by chunk with the "
                                         "encoder's caches (icefall's streaming_decode.py), instead of simulating "
                                         "streaming with a chunk mask; needs --chunk-size > 0 and a finite "
                                         "--left-context-frames")
    compile: bool = option(False, help="torch.compile the encoder (inductor): the same results; pays when the decoded "
                                       "audio takes longer than the compile (docs/compile.md). Not with --streaming")
    compile_dynamic: str = option("auto", choices=COMPILE_DYNAMIC,
                                  help="--compile's shape handling: auto = a static graph, then a dynamic one at "
                                       "the first new (B, T); true = dynamic from the first batch; false = a graph "
                                       "per shape")
    compile_mode: str = option("default", choices=COMPILE_MODES, help="--compile's torch.compile mode")
    compile_regions: str = option("model", choices=COMPILE_REGIONS,
                                  help="--compile's scope: model = the encoder whole; layers = its front-end and "
                                       "each layer on their own (a shorter compile: docs/compile.md)")
    tail_padding: float = option(0.0, metavar="SECONDS",
                                 help="with --streaming: end each stream as a sherpa-onnx client does, with this much "
                                      "silence appended to the audio (its examples: 0.66) and only whole chunks "
                                      "decoded; features are then computed from the padded audio")
    lm: str = option("", metavar="ARPA", help="shallow fusion with this n-gram LM (an ARPA file over the model's BPE "
                                              "pieces, e.g. the recipe's prepare_lm.py output), weighted --lm-scale")
    lm_scale: float = option(0.0, help="weight of --lm's log-probabilities added to non-blank tokens")
    lodr: str = option("", metavar="ARPA", help="LODR: a low-order n-gram LM (ARPA, BPE pieces) whose score is "
                                                "subtracted, weighted --lodr-scale (transducer searches)")
    lodr_scale: float = option(0.0, help="weight of --lodr's log-probabilities subtracted from non-blank tokens")
    hotwords: str = option("", metavar="FILE", help="phrases to boost, one a line (with each cut's own phrases "
                                                    "from its manifest field --hotwords-field)")
    hotword_score: float = option(0.0, help="bonus per token of a matched phrase (a partial match that is abandoned "
                                            "gives it back)")
    hotwords_field: str = option("hotwords", help="the cut (or supervision) custom field holding a cut's own "
                                                  "phrases: a list of strings, or one string split at '|'")

    def fusion(self, tokenizer) -> Any:
        """The :class:`asrprec.decoding.fusion.Fusion` these flags name, or None without --lm, --lodr, --hotwords
        or a nonzero --hotword-score (per-cut phrases)."""
        if not (self.lm or self.lodr or self.hotwords or self.hotword_score):
            return None
        from asrprec.decoding.fusion import Fusion

        return Fusion.from_files(tokenizer, lm=self.lm or None, lm_scale=self.lm_scale, lodr=self.lodr or None,
                                 lodr_scale=self.lodr_scale, hotwords=self.hotwords or None,
                                 hotword_score=self.hotword_score)

    def __post_init__(self) -> None:
        if self.init_from and parse_icefall_source(self.init_from) is None:
            raise ValueError(f"--init-from {self.init_from!r}: decode.py takes an icefall checkpoint as "
                             "icefall:FILE; an asrprec run is decoded with --exp-dir and --epoch")
        if self.epoch is None and not self.init_from:
            raise ValueError("--epoch is required: the epoch-N.pt to decode (or --init-from icefall:FILE)")
        if self.tail_padding and not self.streaming:
            raise ValueError("--tail-padding applies to --streaming decoding (it ends each live stream with silence)")

    def search(self) -> DecodingOptions:
        """The search options of :func:`asrprec.decoding.decode_dataset`."""
        return DecodingOptions(method=self.decoding_method, beam=self.beam_size,
                               max_sym_per_frame=self.max_sym_per_frame)


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


def add_decoding_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One flag per :class:`DecodeConfig` field; ``defaults`` are the recipe's."""
    add_dataclass_args(p, DecodeConfig, defaults=defaults)


def decode_config_from_args(args: argparse.Namespace) -> DecodeConfig:
    """The :class:`DecodeConfig` of the :func:`add_decoding_args` flags; an invalid combination exits like an
    argparse error."""
    try:
        return dataclass_from_args(DecodeConfig, args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def result_tag(cfg: DecodeConfig, precision: str, streaming_tag: str = "") -> str:
    """``<method>-epoch-E-avg-A-<precision>[-use-averaged-model][-beam-K][-<streaming tag>][-tail-Ss]``."""
    if cfg.init_from:
        tag = f"{cfg.decoding_method}-icefall-{Path(parse_icefall_source(cfg.init_from)).stem}-{precision}"
    else:
        tag = f"{cfg.decoding_method}-epoch-{cfg.epoch}-avg-{cfg.avg}-{precision}"
    if cfg.use_averaged_model and not cfg.init_from:
        tag += "-use-averaged-model"
    if cfg.decoding_method in ("modified_beam_search", "malsd_batch", "ctc_prefix_beam_search"):
        tag += f"-beam-{cfg.beam_size}"
    for flag, scale, name in ((cfg.lm, cfg.lm_scale, "lm"), (cfg.lodr, cfg.lodr_scale, "lodr"),
                              (cfg.hotwords or cfg.hotword_score, cfg.hotword_score, "hot")):
        if flag:
            tag += f"-{name}-{scale:g}"
    if streaming_tag:
        tag += f"-{streaming_tag}"
    if cfg.tail_padding:
        tag += f"-tail-{cfg.tail_padding:g}s"
    return tag


def load_for_decoding(exp_dir: Path | str, cfg: DecodeConfig, precision: Any) -> DecodingSetup:
    """Rebuild the model of ``exp_dir`` (its ``model.json``), load the weights ``cfg`` names, configure streaming
    and prepare it for inference under ``precision`` (a :class:`~asrprec.precision.PrecisionOptions`: its policy and
    device). A ``--decoding-method`` the model has no head for raises
    :class:`~asrprec.experiment.ExperimentError` naming the methods it has
    (:func:`asrprec.decoding.check_method`).

    Raises FileNotFoundError / :class:`asrprec.experiment.ExperimentError` naming the file and the fix for
    a missing folder or an unreadable ``model.json``, and :class:`asrprec.checkpoint.CheckpointError` for the
    checkpoints."""
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.decoding.api import check_method
    from asrprec.models import configure_streaming
    from asrprec.devices import resolve_device
    from asrprec.experiment import ExperimentError, build_experiment_model

    exp_dir = Path(exp_dir)
    icefall = parse_icefall_source(cfg.init_from)
    if icefall is not None:  # icefall's checkpoint: its architecture and weights; results go to exp_dir
        from asrprec.models.icefall import load_icefall

        model, _ = load_icefall(icefall, cfg.icefall_args or None)
        exp_dir.mkdir(parents=True, exist_ok=True)
        weights = f"icefall checkpoint {icefall}"
    else:
        model = build_experiment_model(exp_dir)
    try:  # before loading weights: the method must match the heads the model has
        check_method(model, cfg.decoding_method)
    except ValueError as e:
        raise ExperimentError(f"{icefall or exp_dir}: {e}") from None
    if icefall is None:
        weights = load_decoding_weights(model, exp_dir, cfg.epoch, cfg.avg, cfg.use_averaged_model,
                                        allow_nonfinite=cfg.allow_nonfinite)
    streaming_tag = configure_streaming(model, cfg.chunk_size, cfg.left_context_frames, cfg.streaming)
    policy = precision.policy(resolve_device(precision.device))
    min_frames = model.min_input_frames
    model = policy.prepare_for_inference(model)
    if cfg.compile and not cfg.streaming:  # streaming runs streaming_forward, not forward
        from asrprec.models.compile import compile_model

        compile_model(model, dynamic=cfg.compile_dynamic, mode=cfg.compile_mode, regions=cfg.compile_regions)
    streaming = (cfg.chunk_size, cfg.left_context_frames) if cfg.streaming else None
    return DecodingSetup(model=model, policy=policy, tag=result_tag(cfg, precision.precision, streaming_tag),
                         weights=weights, streaming=streaming, min_input_frames=min_frames)


def with_tail_padding(cuts: Mapping[str, Any], cfg: DecodeConfig) -> tuple[dict[str, Any], bool]:
    """``--tail-padding S``: each split's cuts followed by S seconds of silence (the stream a sherpa-onnx client
    sends), and True: their features must then be computed from the padded audio (on-the-fly features).
    Without it, the cuts unchanged and False."""
    seconds = cfg.tail_padding
    if not seconds:
        return dict(cuts), False
    from asrprec.data.features import pad_with_silence

    return {split: pad_with_silence(c, seconds) for split, c in cuts.items()}, True


def decode_splits(setup: DecodingSetup, cuts: Mapping[str, Any], make_loader: Callable[[Any], Iterable[dict]],
                  tokenizer, cfg: DecodeConfig, exp_dir: Path | str) -> dict[str, dict[str, Any]]:
    """Decode each ``{split: CutSet}`` (through ``make_loader(cuts)``) and write its recogs and errs files and the
    WER summary into ``exp_dir``.

    Cuts the encoder cannot take or whose files are missing (``cfg.validate_data``, :func:`asrprec.data.check_cuts`;
    a test reference may be empty) and cuts the loader cannot read are left out, counted per reason in the log and
    in the summary (``left_out``, ``left_out_by_reason``), never silently. Returns ``{split: {"wer": ..., "rtfx":
    ..., ...}}`` and prints one line per split.
    """
    from asrprec.data import check_cuts
    from asrprec.decoding import LabelLoopingGreedy, decode_dataset
    from asrprec.metrics import write_error_stats, write_recogs

    exp_dir = Path(exp_dir)
    options = cfg.search()
    tag = setup.tag
    fusion = cfg.fusion(tokenizer)
    if fusion is not None:
        fusion.to(setup.policy.device)
    search = None  # label looping keeps its preallocated state (and CUDA graphs) across batches
    if cfg.decoding_method == "greedy_search" and cfg.greedy_method == "label_looping" and setup.streaming is None:
        from asrprec.decoding.tdt import is_tdt
        from asrprec.decoding.tdt_label_looping import TdtLabelLoopingGreedy

        looping = TdtLabelLoopingGreedy if is_tdt(setup.model) else LabelLoopingGreedy
        if not (fusion is not None and is_tdt(setup.model)):  # TDT fusion: the frame-looping TDT greedy search
            search = looping(setup.model, cfg.max_sym_per_frame)
    summary = {}
    for split, split_cuts in cuts.items():
        split_cuts, report = check_cuts(split_cuts, split=split, mode=cfg.validate_data,
                                        min_frames=setup.min_input_frames, require_transcript=False)
        if fusion is not None:  # each cut's own phrases
            fusion.with_cut_phrases(split_cuts, tokenizer, cfg.hotwords_field)
        results, stats = decode_dataset(setup.model, make_loader(split_cuts), tokenizer, options, setup.policy.device,
                                        streaming=setup.streaming, search=search,
                                        whole_chunks_only=bool(cfg.tail_padding), fusion=fusion)
        write_recogs(exp_dir / f"recogs-{split}-{tag}.txt", results)
        wer = write_error_stats(exp_dir / f"errs-{split}-{tag}.txt", results, title=f"{split} {tag}").wer_percent
        left_out = report.dropped + stats["unreadable_cuts"]
        summary[split] = {"wer": wer, **stats, "cuts": report.total, "decoded": len(results), "left_out": left_out,
                          "left_out_by_reason": report.to_dict()["dropped"]}
        note = f"; {left_out} of {report.total} cuts left out, see the log" if left_out else ""
        print(f"{split}: WER {wer:.2f}% ({tag}); RTFx {stats.get('rtfx', float('nan')):.1f}{note}")
    (exp_dir / f"wer-summary-{tag}.json").write_text(json.dumps(summary, indent=1))
    return summary


def decode_from_args(args: Any, *, tokenizer_path: str | Path | Callable[[], str | Path],
                     load_splits: Callable[[], Mapping[str, Any]], max_duration: float,
                     on_the_fly_feats: bool = False) -> dict[str, dict[str, Any]]:
    """A recipe's ``decode.py`` as one call: the model of ``args.exp_dir`` with the weights, search and precision
    the flags name (:func:`add_decoding_args`, ``add_precision_args``), decoded on the splits
    ``load_splits()`` returns, result files written into ``args.exp_dir``.

    Args:
        args: the parsed flags. tokenizer_path: the sentencepiece model (or a callable giving it, called once the
            model has loaded, so that a wrong ``--exp-dir`` is reported first).
        load_splits: ``{split: CutSet}`` to decode. max_duration: seconds of audio per batch.
        on_the_fly_feats: compute fbank from the audio (always so with ``--tail-padding``).
    """
    from asrprec.data import AsrDataModule, DataConfig
    from asrprec.tokenizer import Tokenizer
    from asrprec.cli import precision_options_from_args, setup_logging
    from asrprec.experiment import experiment_tokenizer

    setup_logging()
    cfg = decode_config_from_args(args)
    setup = load_for_decoding(args.exp_dir, cfg, precision_options_from_args(args))
    print("weights:", setup.weights)
    tokenizer = Tokenizer(experiment_tokenizer(args.exp_dir, tokenizer_path))  # the folder's copy when it has one
    cuts, padded = with_tail_padding(load_splits(), cfg)  # --tail-padding: the stream a sherpa-onnx client sends
    data = AsrDataModule(DataConfig(max_duration=max_duration, on_the_fly_feats=on_the_fly_feats or padded))
    return decode_splits(setup, cuts, data.test_dataloader, tokenizer, cfg, args.exp_dir)
