"""Recognise audio with sherpa-onnx (PyPI ``sherpa-onnx``) from exported files: the deployment runtime itself,
to check an export end to end. sherpa-onnx computes its own features (kaldi-native-fbank, 80 bins, the settings
lhotse's Fbank uses) from float samples in [-1, 1].

sherpa-onnx ends the whole process on a model it rejects (e.g. missing metadata), so callers that must survive a
bad model run :func:`main` in a child process::

    python -m asrprec.export.sherpa --model-dir DIR [--variant int8] [--ctc] --waves waves.npz --out result.json

``waves.npz`` holds 16 kHz float32 arrays; ``result.json`` maps each array's name to its token ids; ``--ctm`` and
``--segments`` also write the recognised words' times (:mod:`asrprec.timestamps`), utterance = array name.

Token times: sherpa-onnx's results carry each token's start (``timestamps``, seconds) for transducer and CTC models,
the encoder frame that emitted it times 40 ms (10 ms features, subsampling 4: k2-fsa/sherpa-onnx
``sherpa-onnx/csrc/offline-recognizer-transducer-impl.h``, ``offline-transducer-model.cc``), asrprec's grid
(:data:`asrprec.timestamps.FRAME_SHIFT_S`); :func:`recognize_timed` returns them, and
:meth:`TimedTokens.words` turns them into word spans as asrprec's own decoding does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from asrprec._optional import require
from asrprec.atomic import atomic_write_text
from asrprec.config import option
from asrprec.timestamps import WordSpan, words_from_token_times, write_ctm, write_segments

SAMPLE_RATE = 16000
#: silence appended to a stream before ``input_finished`` so its last frames are decoded, as sherpa-onnx's examples
#: do (k2-fsa/sherpa-onnx ``python-api-examples/online-decode-files.py``)
TAIL_PADDING_S = 0.66


def _paths(model_dir: Path, variant: Optional[str], ctc: bool = False) -> Dict[str, str]:
    suffix = f".{variant}" if variant else ""
    parts = ("model",) if ctc else ("encoder", "decoder", "joiner")  # model.onnx: a CTC head (asrprec.export.ctc)
    paths = {part: model_dir / f"{part}{suffix}.onnx" for part in parts}
    paths["tokens"] = model_dir / "tokens.txt"
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks {', '.join(missing)}; export the model first")
    return {k: str(v) for k, v in paths.items()}


def _read_symbols(path: Path | str) -> List[Tuple[str, int]]:
    """tokens.txt's ``(symbol, id)`` lines; a line of an id alone is a space (sherpa-onnx's ``symbol-table.cc``)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        fields = line.split()
        rows.append((fields[0], int(fields[1])) if len(fields) == 2 else (" ", int(fields[0])))
    return rows


def read_tokens(path: Path | str) -> Dict[str, int]:
    """tokens.txt as {symbol: id}, each symbol also under the spelling sherpa-onnx reports it with (a leading
    sentencepiece ``\u2581`` turned into a space, k2-fsa/sherpa-onnx ``sherpa-onnx/csrc/symbol-table.cc``)."""
    table: Dict[str, int] = {}
    for sym, i in _read_symbols(path):
        table[sym] = i
        table.setdefault(sym.replace("\u2581", " "), i)
    return table


@dataclass
class TimedTokens:
    """What sherpa-onnx recognised in one waveform: token ids, their pieces as tokens.txt spells them (``\u2581``
    kept), each one's start time (s, as sherpa-onnx reports it) and sherpa-onnx's text."""

    ids: List[int] = field(default_factory=list)
    pieces: List[str] = field(default_factory=list)
    times: List[float] = field(default_factory=list)
    text: str = ""

    def words(self, duration: Optional[float] = None) -> List[WordSpan]:
        """Word spans (:func:`~asrprec.timestamps.words_from_token_times`); ``duration``: the audio's
        seconds (a streaming decode's tail padding excluded), which the words stay within. ValueError when
        sherpa-onnx gave no time for each token."""
        if len(self.times) != len(self.pieces):
            raise ValueError(f"sherpa-onnx gave {len(self.times)} token times for {len(self.pieces)} tokens; word "
                             "times need one per token (transducer and CTC models give them)")
        return words_from_token_times(self.pieces, self.times, duration)


def recognize(model_dir: Path | str, waves: Sequence[np.ndarray], *, streaming: bool, variant: Optional[str] = None,
              num_threads: int = 1, batch: int = 8, tail_padding_s: float = TAIL_PADDING_S,
              ctc: bool = False, sample_rates: int | Sequence[int] = SAMPLE_RATE) -> List[List[int]]:
    """Token ids sherpa-onnx recognises in each mono float waveform (:func:`recognize_timed`'s ids)."""
    return [r.ids for r in recognize_timed(model_dir, waves, streaming=streaming, variant=variant,
                                           num_threads=num_threads, batch=batch, tail_padding_s=tail_padding_s,
                                           ctc=ctc, sample_rates=sample_rates)]


def recognize_timed(model_dir: Path | str, waves: Sequence[np.ndarray], *, streaming: bool,
                    variant: Optional[str] = None, num_threads: int = 1, batch: int = 8,
                    tail_padding_s: float = TAIL_PADDING_S, ctc: bool = False,
                    sample_rates: int | Sequence[int] = SAMPLE_RATE) -> List[TimedTokens]:
    """What sherpa-onnx recognises in each mono float waveform, token times included, ``batch`` streams per
    ``decode_streams`` call; greedy search. ``sample_rates``: each waveform's rate (one for all, or one each), told
    to sherpa-onnx, which resamples to the model's 16 kHz itself. ``streaming``: ``OnlineRecognizer`` (each stream
    followed by ``tail_padding_s`` of silence) instead of ``OfflineRecognizer``. ``ctc``: the CTC export
    ``model.onnx`` (``from_zipformer_ctc`` / ``from_zipformer2_ctc``) instead of the transducer's three files."""
    rates = [int(sample_rates)] * len(waves) if isinstance(sample_rates, (int, np.integer)) else list(sample_rates)
    if len(rates) != len(waves):
        raise ValueError(f"{len(waves)} waveforms but {len(rates)} sample rates; give one rate, or one per waveform")
    sherpa_onnx = require("sherpa_onnx")
    paths = _paths(Path(model_dir), variant, ctc)
    if not ctc:
        from .exporter import SHERPA_TDT_REASON, read_metadata

        if "tdt_durations" in read_metadata(paths["joiner"]):
            raise ValueError(f"{paths['joiner']} is the joiner of a TDT model: {SHERPA_TDT_REASON}")
    to_id = read_tokens(paths["tokens"])
    to_piece = {i: sym for sym, i in _read_symbols(paths["tokens"])}
    if ctc and streaming:
        rec = sherpa_onnx.OnlineRecognizer.from_zipformer2_ctc(
            tokens=paths["tokens"], model=paths["model"], num_threads=num_threads, sample_rate=SAMPLE_RATE,
            feature_dim=80, decoding_method="greedy_search")
    elif ctc:
        rec = sherpa_onnx.OfflineRecognizer.from_zipformer_ctc(
            model=paths["model"], tokens=paths["tokens"], num_threads=num_threads, sample_rate=SAMPLE_RATE,
            feature_dim=80, decoding_method="greedy_search")
    elif streaming:
        rec = sherpa_onnx.OnlineRecognizer.from_transducer(
            tokens=paths["tokens"], encoder=paths["encoder"], decoder=paths["decoder"], joiner=paths["joiner"],
            num_threads=num_threads, sample_rate=SAMPLE_RATE, feature_dim=80, decoding_method="greedy_search")
    else:
        rec = sherpa_onnx.OfflineRecognizer.from_transducer(
            encoder=paths["encoder"], decoder=paths["decoder"], joiner=paths["joiner"], tokens=paths["tokens"],
            num_threads=num_threads, sample_rate=SAMPLE_RATE, feature_dim=80, decoding_method="greedy_search")
    results: List[TimedTokens] = []
    for start in range(0, len(waves), batch):
        streams = []
        for w, rate in zip(waves[start: start + batch], rates[start: start + batch]):
            s = rec.create_stream()
            s.accept_waveform(rate, np.ascontiguousarray(w, dtype=np.float32))
            if streaming:
                s.accept_waveform(rate, np.zeros(int(tail_padding_s * rate), dtype=np.float32))
                s.input_finished()
            streams.append(s)
        if streaming:
            while True:
                ready = [s for s in streams if rec.is_ready(s)]
                if not ready:
                    break
                rec.decode_streams(ready)
            found = [rec.get_result_all(s) for s in streams]
        else:
            rec.decode_streams(streams)
            found = [s.result for s in streams]
        for r in found:
            ids = [to_id[t] for t in r.tokens]
            times = [float(t) for t in getattr(r, "timestamps", None) or []]  # empty where a runtime gives none
            results.append(TimedTokens(ids, [to_piece[i] for i in ids], times, getattr(r, "text", "")))
    return results


@dataclass
class _Job:
    """The child process's command line (``python -m asrprec.export.sherpa``)."""

    model_dir: str = option(help="the exported files")
    waves: str = option(help="an .npz of float32 arrays")
    out: str = option(help="where the JSON of token ids goes")
    sample_rate: int = option(SAMPLE_RATE, help="the arrays' sample rate (sherpa-onnx resamples to 16 kHz)")
    variant: Optional[str] = option(None, help="int8 or fp16: encoder.int8.onnx ...")
    streaming: bool = option(False, help="OnlineRecognizer instead of OfflineRecognizer")
    ctc: bool = option(False, help="decode the CTC export model.onnx")
    batch: int = option(8, help="streams per decode_streams call")
    ctm: Optional[str] = option(None, help="also write the words' times there as a NIST CTM")
    segments: Optional[str] = option(None, help="also write the segments the words form there")


def main(argv: Optional[Sequence[str]] = None) -> None:
    from asrprec.cli import parse_flat

    job = parse_flat(_Job, argv, description=__doc__)
    data = np.load(job.waves)
    names = list(data.files)
    found = recognize_timed(job.model_dir, [data[n] for n in names], streaming=job.streaming, variant=job.variant,
                            batch=job.batch, ctc=job.ctc, sample_rates=job.sample_rate)
    atomic_write_text(job.out, json.dumps({n: r.ids for n, r in zip(names, found)}))
    words = [(n, r.words(len(data[n]) / job.sample_rate)) for n, r in zip(names, found)]
    if job.ctm:
        write_ctm(job.ctm, words)
    if job.segments:
        write_segments(job.segments, words)


if __name__ == "__main__":
    main()
