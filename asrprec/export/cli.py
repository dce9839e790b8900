"""A recipe's export command as one config: which weights of an experiment, offline or streaming, which variants
(:class:`ExportConfig`, the ``export`` section read by :func:`exporting_command_line`); a recipe's ``export.py``
only names its tokenizer and default folder."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from asrprec.atomic import atomic_write_text
from asrprec.config import ConfigError, option
from asrprec.models.icefall import parse_icefall_source
from asrprec.models.weights import WeightsOptions

__all__ = ["EXPORT_FLAGS", "ExportConfig", "ExportingConfig", "export_experiment", "exporting_command_line"]

log = logging.getLogger(__name__)


@dataclass
class ExportConfig(WeightsOptions):
    """What :func:`export_experiment` writes: which weights (:class:`~asrprec.models.weights.WeightsOptions`, shared with
    decoding), offline or streaming, which variants."""

    exp_dir: str = option(help="the experiment folder training wrote", kw_only=True)
    out_dir: str | None = option(None, help="where the files go (default: a folder in --exp-dir named after them)")
    streaming: bool = option(False, help="causal Zipformer: a streaming encoder (sherpa-onnx OnlineRecognizer)")
    chunk_size: int | None = option(None, help="50 Hz frames per chunk, one the causal model was trained with")
    left_context_frames: int | None = option(None, help="left context in 50 Hz frames, one it was trained with")
    int8: bool = option(False, help="also write the int8 (dynamically quantised) variant")
    fp16: bool = option(False, help="also write the fp16 variant (float32 inputs and outputs)")
    ctc: bool = option(False, help="a hybrid model: also export its CTC head as model.onnx")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.streaming and (self.chunk_size is None or self.left_context_frames is None):
            raise ValueError("--streaming needs --chunk-size and --left-context-frames (values the model was "
                             "trained with, e.g. --chunk-size 32 --left-context-frames 128)")

    def tag(self) -> str:
        tag = self.weights_tag()
        if self.streaming:
            tag += f"-streaming-chunk-{self.chunk_size}-left-{self.left_context_frames}"
        return tag


@dataclass
class ExportingConfig:
    """The config of an export.py run: the ``export`` section; a recipe subclasses it to add its own."""

    export: ExportConfig = field(default_factory=lambda: ExportConfig(exp_dir="exp"))


#: the plain flags of every recipe's export.py
EXPORT_FLAGS = tuple(f"export.{name}" for name in (
    "exp_dir", "epoch", "avg", "use_averaged_model", "init_from", "icefall_args", "allow_nonfinite", "out_dir",
    "streaming", "chunk_size", "left_context_frames", "int8", "fp16", "ctc"))


def exporting_command_line(cls: type = ExportingConfig, *, defaults: Mapping[str, Any] | None = None,
                           extra_flags: Sequence[str | tuple[str, str]] = (), description: str | None = None) -> Any:
    """The :class:`asrprec.cli.ConfigCommandLine` of a recipe's ``export.py``."""
    from asrprec.cli import ConfigCommandLine

    return ConfigCommandLine(cls, (*extra_flags, *EXPORT_FLAGS), dict(defaults or {}), description)


def export_experiment(cfg: ExportConfig, tokenizer: Any) -> Path:
    """Export the weights ``cfg`` names to the ONNX files sherpa-onnx runs (encoder, decoder, joiner, tokens.txt;
    :mod:`asrprec.export.exporter`; a CTC head, with ``cfg.ctc`` or for a CTC-only model, as model.onnx;
    :mod:`asrprec.export.ctc`), plus ``export.json`` saying what was exported; return the folder.
    ``tokenizer`` may be a function returning it, called once the experiment's model has loaded (so that a wrong
    ``--exp-dir`` is reported before a missing tokenizer)."""
    from asrprec.experiment import require_folder

    from . import convert_fp16, export_offline, export_streaming, load_experiment_model, quantize_int8

    try:
        cfg.require_weights("export")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # a file where a folder goes is named before the model loads
    require_folder(cfg.exp_dir, "--exp-dir", "pass the folder training wrote (model.json, epoch-N.pt)")
    out_dir = require_folder(cfg.out_dir or Path(cfg.exp_dir) / f"onnx-{cfg.tag()}", "--out-dir")
    icefall = parse_icefall_source(cfg.init_from)
    if icefall is not None:
        from asrprec.models.icefall import load_icefall

        model, _ = load_icefall(icefall, cfg.icefall_args or None)
        source = f"icefall checkpoint {icefall}"
    else:
        model, _, source = load_experiment_model(Path(cfg.exp_dir), cfg.epoch, cfg.avg, cfg.use_averaged_model,
                                                 allow_nonfinite=cfg.allow_nonfinite)
    if icefall is None:  # the folder's copy of the tokenizer when it has one
        tokenizer = _experiment_tokenizer(Path(cfg.exp_dir), tokenizer)
    elif callable(tokenizer):
        tokenizer = tokenizer()
    print("weights:", source)
    if cfg.ctc or not model.use_transducer:
        _export_ctc(cfg, model, tokenizer, out_dir)
    if not model.use_transducer:
        atomic_write_text(out_dir / "export.json", json.dumps({**asdict(cfg), "weights": source}, indent=1))
        print(f"in {out_dir} with tokens.txt")
        return out_dir
    if cfg.streaming:
        exported = export_streaming(model, tokenizer, out_dir, chunk_size=cfg.chunk_size,
                                    left_context_frames=cfg.left_context_frames)
    else:
        chunking = {"chunk_size": cfg.chunk_size, "left_context_frames": cfg.left_context_frames}
        exported = export_offline(model, tokenizer, out_dir, **{k: -1 if v is None else v for k, v in chunking.items()})
    written = [exported]
    if cfg.int8:
        written.append(quantize_int8(exported))
    if cfg.fp16:
        written.append(convert_fp16(exported))
    atomic_write_text(out_dir / "export.json", json.dumps({**asdict(cfg), "weights": source}, indent=1))
    for e in written:
        print(f"wrote {e.encoder.name}, {e.decoder.name}, {e.joiner.name}")
    print(f"in {out_dir} with tokens.txt")
    return out_dir


def _experiment_tokenizer(exp_dir: Path, given: Any) -> Any:
    """The folder's copy of the tokenizer when it has one (``given``, a tokenizer or a function returning one, must
    then be the same file, or be missing), else ``given`` (:func:`asrprec.experiment.experiment_tokenizer`)."""
    from asrprec.experiment import TOKENIZER_NAME, experiment_tokenizer
    from asrprec.tokenizer import Tokenizer

    if (exp_dir / TOKENIZER_NAME).is_file():
        return Tokenizer(experiment_tokenizer(exp_dir, given))
    given = given() if callable(given) else given
    log.info("%s holds no copy of its tokenizer (trained before runs kept one): using %s", exp_dir,
             getattr(given, "model_path", given))
    return given


def _export_ctc(cfg: ExportConfig, model: Any, tokenizer: Any, out_dir: Path) -> None:
    """The CTC head as ``model.onnx`` (and its variants) in ``out_dir`` (:mod:`asrprec.export.ctc`)."""
    from .ctc import convert_ctc_fp16, export_ctc_offline, export_ctc_streaming, quantize_ctc_int8

    if cfg.streaming:
        exported = export_ctc_streaming(model, tokenizer, out_dir, chunk_size=cfg.chunk_size,
                                        left_context_frames=cfg.left_context_frames)
    else:
        exported = export_ctc_offline(model, tokenizer, out_dir,
                                      chunk_size=-1 if cfg.chunk_size is None else cfg.chunk_size,
                                      left_context_frames=-1 if cfg.left_context_frames is None
                                      else cfg.left_context_frames)
    written = [exported]
    if cfg.int8:
        written.append(quantize_ctc_int8(exported))
    if cfg.fp16:
        written.append(convert_ctc_fp16(exported))
    for e in written:
        print(f"wrote {e.model.name} (CTC head)")
