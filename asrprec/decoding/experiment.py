"""Decode an experiment folder as the recipes' ``decode.py`` do, so each recipe only says which data to decode.

:func:`load_for_decoding` rebuilds the model from the folder's ``model.json``, loads the weights that
``--epoch/--avg/--use-averaged-model`` name, fixes the chunking of a causal model and applies the precision
policy; :func:`decode_splits` decodes each split and writes, into the folder, icefall's result files:
``recogs-<split>-<tag>.txt``, ``errs-<split>-<tag>.txt`` and one ``wer-summary-<tag>.json`` for all splits
(``<tag>`` = method, epoch, avg, precision and the options that change results).

What to decode is one :class:`DecodeConfig` (the ``decode`` section of a recipe's :class:`DecodingConfig`, read by
:func:`decoding_command_line`), in the precision a :class:`~asrprec.precision.PrecisionOptions` names.
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from torch import nn

from asrprec.atomic import atomic_write_text
from asrprec.config import ConfigError, option
from asrprec.data.validate import CHECK_MODES
from asrprec.models.compile import CompileOptions
from asrprec.models.icefall import parse_icefall_source
from asrprec.models.weights import WeightsOptions
from asrprec.precision import PrecisionOptions

from .api import CTC_METHODS, METHODS, DecodingOptions
from .longform import LongFormOptions
from .label_looping import DEFAULT_GREEDY_METHOD, GREEDY_METHODS


@dataclass
class DecodeConfig(WeightsOptions, CompileOptions, LongFormOptions):
    """Which weights of an experiment to decode (:class:`~asrprec.models.weights.WeightsOptions`, shared with export), with
    which search; compiled or not (:class:`~asrprec.models.compile.CompileOptions`, shared with training). The
    ``decode`` section of a decode.py config."""

    validate_data: str = option("fast", choices=CHECK_MODES,
                                help="leave out (and report) unusable cuts; full also reads every feature file")
    decoding_method: tuple[str, ...] = option(("greedy_search",), choices=METHODS, metavar="METHOD",
                                              help="the search(es): several decode one loaded model in turn")
    beam_size: int = option(4, help="beam searches: hypotheses kept per utterance")
    # unset: 1 for an RNN-T (icefall's), 10 for TDT (NeMo's max_symbols; DecodingOptions.for_head)
    max_sym_per_frame: int | None = option(None, help="tokens per encoder frame at most (RNN-T 1, TDT 10)")
    greedy_method: str = option(DEFAULT_GREEDY_METHOD, choices=GREEDY_METHODS,
                                help="greedy_search by label looping (batched) or frame looping: the same results")
    chunk_size: int | None = option(None, help="causal Zipformer: chunk in 50 Hz frames (-1 = full context)")
    left_context_frames: int | None = option(None, help="causal Zipformer: left context in 50 Hz frames (-1 = all)")
    streaming: bool = option(False, help="causal Zipformer: decode as live streams with the encoder's caches")
    tail_padding: float = option(0.0, metavar="SECONDS",
                                 help="with --streaming: silence appended to each stream (sherpa-onnx: 0.66)")
    lm: str = option("", metavar="ARPA", help="shallow fusion with this n-gram LM over BPE pieces")
    lm_scale: float = option(0.0, help="weight of --lm's log-probabilities")
    lodr: str = option("", metavar="ARPA", help="LODR: a low-order n-gram LM whose score is subtracted")
    lodr_scale: float = option(0.0, help="weight of --lodr's log-probabilities")
    hotwords: str = option("", metavar="FILE", help="phrases to boost, one a line")
    hotword_score: float = option(0.0, help="bonus per token of a matched phrase")
    hotwords_field: str = option("hotwords", help="the cut's custom field holding its own phrases")
    long_form: bool = option(False, help="decode each cut whole, however long, in overlapping chunks from its audio")

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
        WeightsOptions.__post_init__(self)
        CompileOptions.__post_init__(self)
        LongFormOptions.__post_init__(self)
        if isinstance(self.decoding_method, str):
            self.decoding_method = (self.decoding_method,)
        self.decoding_method = tuple(dict.fromkeys(self.decoding_method))  # each once, in the order given
        if not self.decoding_method:
            raise ValueError(f"name at least one --decoding-method of {', '.join(METHODS)}")
        unknown = [m for m in self.decoding_method if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown --decoding-method {', '.join(unknown)}; valid: {', '.join(METHODS)}")
        if self.max_sym_per_frame is not None and self.max_sym_per_frame < 1:
            raise ValueError(f"--max-sym-per-frame must be >= 1, got {self.max_sym_per_frame}; fix: leave it out for "
                             "the head's default (RNN-T 1, TDT 10)")
        if self.tail_padding and not self.streaming:
            raise ValueError("--tail-padding applies to --streaming decoding (it ends each live stream with silence)")
        if self.long_form and (self.streaming or self.lm or self.lodr or self.hotwords or self.hotword_score):
            raise ValueError("--long-form decodes whole chunks without an LM or hot phrases; fix: leave out "
                             "--streaming, --lm, --lodr and --hotwords, or decode without --long-form")

    def long_form_options(self) -> LongFormOptions:
        """The chunking of ``--long-form`` (:mod:`asrprec.decoding.longform`)."""
        return LongFormOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LongFormOptions)})

    @property
    def method(self) -> str:
        """The one search of a config that names one (:meth:`per_method` splits one that names several)."""
        if len(self.decoding_method) != 1:
            raise ValueError(f"this config names {len(self.decoding_method)} searches; take them one at a time "
                             "with per_method()")
        return self.decoding_method[0]

    def per_method(self) -> list[DecodeConfig]:
        """One config per ``--decoding-method``, in the order given."""
        return [dataclasses.replace(self, decoding_method=(m,)) for m in self.decoding_method]

    def search(self) -> DecodingOptions:
        """The search options of :func:`asrprec.decoding.decode_dataset` (a config naming one search)."""
        return DecodingOptions(method=self.method, beam=self.beam_size,
                               max_sym_per_frame=self.max_sym_per_frame, greedy_method=self.greedy_method)


@dataclass(frozen=True)
class DecodingSetup:
    """A model ready to decode: ``model`` (prepared for inference by ``policy``), the ``tag`` of its result files
    (for the config's first search), ``weights`` (which checkpoints were averaged, for the log), ``streaming``
    ((chunk, left context) for real streaming, or None), ``min_input_frames`` (the fewest feature frames its
    encoder takes) and ``streaming_tag`` (the part of a tag that names the streaming setup)."""

    model: nn.Module
    policy: Any
    tag: str
    weights: str
    streaming: tuple[int, int] | None
    min_input_frames: int = 1
    streaming_tag: str = ""


@dataclass
class DecodingConfig:
    """The config of a decode.py run: ``decode`` and ``precision``; a recipe subclasses it to add its own section
    (data folder, splits, ...)."""

    decode: DecodeConfig = field(default_factory=DecodeConfig)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)


#: the plain flags of every recipe's decode.py (any other field: --section.field VALUE or a --config file)
DECODE_FLAGS: tuple[str, ...] = (
    "decode.epoch", "decode.avg", "decode.use_averaged_model", "decode.init_from", "decode.icefall_args",
    "decode.allow_nonfinite", "decode.validate_data", "decode.decoding_method", "decode.beam_size",
    "decode.max_sym_per_frame", "decode.chunk_size", "decode.left_context_frames", "decode.streaming",
    "decode.compile", "decode.tail_padding", "decode.lm", "decode.lm_scale", "decode.lodr", "decode.lodr_scale",
    "decode.hotwords", "decode.hotword_score", "decode.long_form", "precision.precision", "precision.device",
)
#: decoding's default over CompileOptions': a static graph first (a test set has few shapes per bucket)
DECODE_DEFAULTS = {"decode": {"compile_dynamic": "auto"}}


def decoding_command_line(cls: type = DecodingConfig, *, defaults: Mapping[str, Any] | None = None,
                          extra_flags: Sequence[str | tuple[str, str]] = (), description: str | None = None) -> Any:
    """The :class:`asrprec.cli.ConfigCommandLine` of a recipe's ``decode.py`` (:data:`DECODE_FLAGS` after the
    recipe's ``extra_flags``; ``defaults`` over :data:`DECODE_DEFAULTS`)."""
    from asrprec.cli import ConfigCommandLine
    from asrprec.config import merge_layer

    merged = merge_layer(cls, DECODE_DEFAULTS, dict(defaults or {}))
    return ConfigCommandLine(cls, (*extra_flags, *DECODE_FLAGS), merged, description)


def result_tag(cfg: DecodeConfig, precision: str, streaming_tag: str = "") -> str:
    """``<method>-epoch-E-avg-A-<precision>[-use-averaged-model][-beam-K][-<streaming tag>][-tail-Ss]`` (of the
    config's first search)."""
    method = cfg.decoding_method[0]
    if cfg.init_from:
        tag = f"{method}-icefall-{Path(parse_icefall_source(cfg.init_from)).stem}-{precision}"
    else:
        tag = f"{method}-epoch-{cfg.epoch}-avg-{cfg.avg}-{precision}"
        if cfg.use_averaged_model:
            tag += "-use-averaged-model"
    if method in ("modified_beam_search", "malsd_batch", "ctc_prefix_beam_search"):
        tag += f"-beam-{cfg.beam_size}"
    if cfg.max_sym_per_frame is not None and method not in CTC_METHODS:  # a choice other than the head's default
        tag += f"-max-sym-{cfg.max_sym_per_frame}"
    for flag, scale, name in ((cfg.lm, cfg.lm_scale, "lm"), (cfg.lodr, cfg.lodr_scale, "lodr"),
                              (cfg.hotwords or cfg.hotword_score, cfg.hotword_score, "hot")):
        if flag:
            tag += f"-{name}-{scale:g}"
    if streaming_tag:
        tag += f"-{streaming_tag}"
    if cfg.tail_padding:
        tag += f"-tail-{cfg.tail_padding:g}s"
    if cfg.long_form:
        tag += f"-long-{cfg.chunk_seconds:g}s-{cfg.overlap_seconds:g}s"
        if cfg.pause_seconds > 0:
            tag += f"-pause-{cfg.pause_seconds:g}s-{cfg.pause_db:g}dB"
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
    from asrprec.experiment import ExperimentError, build_experiment_model, require_folder

    exp_dir = Path(exp_dir)
    icefall = parse_icefall_source(cfg.init_from)
    if icefall is not None:  # icefall's checkpoint: its architecture and weights; results go to exp_dir
        from asrprec.models.icefall import load_icefall

        model, _ = load_icefall(icefall, cfg.icefall_args or None)
        require_folder(exp_dir, "--exp-dir", "pass a folder for the result files").mkdir(parents=True, exist_ok=True)
        weights = f"icefall checkpoint {icefall}"
    else:
        model = build_experiment_model(exp_dir)
    try:  # before loading weights: the methods must match the heads the model has
        for method in cfg.decoding_method:
            check_method(model, method)
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
                         weights=weights, streaming=streaming, min_input_frames=min_frames, streaming_tag=streaming_tag)


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
    from asrprec.decoding import decode_dataset
    from asrprec.decoding.longform import decode_long_cuts
    from asrprec.timestamps import CtmCollector, ctm_path, segments_path, write_ctm, write_segments
    from asrprec.metrics import write_error_stats, write_recogs

    exp_dir = Path(exp_dir)
    options = cfg.search()
    tag = setup.tag
    fusion = cfg.fusion(tokenizer)
    if fusion is not None:
        fusion.to(setup.policy.device)
    summary = {}
    for split, split_cuts in cuts.items():
        split_cuts, report = check_cuts(split_cuts, split=split, mode=cfg.validate_data,
                                        min_frames=setup.min_input_frames, require_transcript=False)
        if fusion is not None:  # each cut's own phrases
            fusion.with_cut_phrases(split_cuts, tokenizer, cfg.hotwords_field)
        if cfg.long_form:  # from the audio, chunk by chunk: memory bounded whatever a cut's length
            results, words, stats = decode_long_cuts(setup.model, split_cuts, tokenizer, cfg.long_form_options(),
                                                     options)
            write_ctm(ctm_path(exp_dir, split, tag), words)
            write_segments(segments_path(exp_dir, split, tag), words)
            stats["unreadable_cuts"] = 0
        else:
            ctm = CtmCollector(tokenizer.id_to_piece, {c.id: c.duration for c in split_cuts})
            results, stats = decode_dataset(setup.model, make_loader(split_cuts), tokenizer, options,
                                            setup.policy.device, streaming=setup.streaming,
                                            whole_chunks_only=bool(cfg.tail_padding), fusion=fusion, on_results=ctm)
            ctm.write(ctm_path(exp_dir, split, tag))  # word times beside the recogs (NIST CTM)
            ctm.write_segments(segments_path(exp_dir, split, tag))  # and the segments they form
        write_recogs(exp_dir / f"recogs-{split}-{tag}.txt", results)
        wer = write_error_stats(exp_dir / f"errs-{split}-{tag}.txt", results, title=f"{split} {tag}").wer_percent
        left_out = report.dropped + stats["unreadable_cuts"]
        summary[split] = {"wer": wer, **stats, "cuts": report.total, "decoded": len(results), "left_out": left_out,
                          "left_out_by_reason": report.to_dict()["dropped"]}
        note = f"; {left_out} of {report.total} cuts left out, see the log" if left_out else ""
        print(f"{split}: WER {wer:.2f}% ({tag}); RTFx {stats.get('rtfx', float('nan')):.1f}{note}")
    atomic_write_text(exp_dir / f"wer-summary-{tag}.json", json.dumps(summary, indent=1))
    return summary


def decode_experiment(cfg: DecodeConfig, precision: PrecisionOptions, *, exp_dir: str | Path,
                      tokenizer_path: str | Path | Callable[[], str | Path],
                      load_splits: Callable[[], Mapping[str, Any]], max_duration: float,
                      on_the_fly_feats: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
    """A recipe's ``decode.py`` as one call: the model of ``exp_dir`` with the weights and searches ``cfg`` names,
    in ``precision``, decoded on the splits ``load_splits()`` returns, result files written into ``exp_dir``.
    The model is loaded once; each ``--decoding-method`` then decodes every split, and with several a WER table
    (:func:`wer_table`) is printed at the end. Returns ``{tag: {split: summary}}`` (:func:`decode_splits`).

    Args:
        cfg, precision: the ``decode`` and ``precision`` sections. exp_dir: the experiment folder.
        tokenizer_path: the sentencepiece model (or a callable giving it, called once the model has loaded, so that
            a wrong ``exp_dir`` is reported first); the folder's copy is used when it has one.
        load_splits: ``{split: CutSet}`` to decode. max_duration: seconds of audio per batch.
        on_the_fly_feats: compute fbank from the audio (always so with ``tail_padding``).
    Raises:
        ConfigError: neither ``cfg.epoch`` nor an icefall checkpoint.
    """
    from asrprec.cli import setup_logging
    from asrprec.data import AsrDataModule, DataConfig
    from asrprec.experiment import experiment_tokenizer
    from asrprec.tokenizer import Tokenizer

    try:
        cfg.require_weights("decode")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    setup_logging()
    setup = load_for_decoding(exp_dir, cfg, precision)
    print("weights:", setup.weights)
    tokenizer = Tokenizer(experiment_tokenizer(exp_dir, tokenizer_path))  # the folder's copy when it has one
    cuts, padded = with_tail_padding(load_splits(), cfg)  # --tail-padding: the stream a sherpa-onnx client sends
    data = AsrDataModule(DataConfig(max_duration=max_duration, on_the_fly_feats=on_the_fly_feats or padded))
    results = {}
    for one in cfg.per_method():
        tagged = dataclasses.replace(setup, tag=result_tag(one, precision.precision, setup.streaming_tag))
        results[tagged.tag] = decode_splits(tagged, cuts, data.test_dataloader, tokenizer, one, exp_dir)
    if len(results) > 1:
        print(wer_table(results))
    return results


def wer_table(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """``{tag: {split: {"wer": ...}}}`` as a Markdown table: a row per result tag, a column per split (WER %)."""
    splits = list(dict.fromkeys(split for summary in results.values() for split in summary))
    lines = ["| WER % | " + " | ".join(splits) + " |", "|---|" + "---|" * len(splits)]
    for tag, summary in results.items():
        cells = [f"{summary[split]['wer']:.2f}" if split in summary else "" for split in splits]
        lines.append(f"| {tag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
