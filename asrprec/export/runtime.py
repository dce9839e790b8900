"""Decode with exported ONNX files through onnxruntime, the way sherpa-onnx runs them: the graphs fed by position,
the decoder started from ``[-1] * (C - 1) + [0]``, greedy search with one symbol per encoder frame, streaming
encoders fed ``T`` frames per call and advanced ``decode_chunk_len`` frames (k2-fsa/sherpa-onnx
``sherpa-onnx/csrc/offline-transducer-greedy-search-decoder.cc``, ``online-transducer-greedy-search-decoder.cc``,
``online-recognizer-transducer-impl.h``), with the initial states sherpa-onnx builds from the encoder's metadata
(``online-zipformer2-transducer-model.cc`` ``GetEncoderInitStates``).

Every ``decode`` takes ``return_frames=True`` to give :class:`FramedTokens` instead of token lists: each token's
encoder frame (40 ms; sherpa-onnx's ``timestamps`` are these frames x 40 ms) and a TDT token's duration, which
:func:`asrprec.timestamps.words_from_ids` turns into word times.

Legend: N utterances (streams), T feature frames, F feature bins, T' encoder frames, J joiner width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from asrprec._optional import require
from asrprec.errors import AsrprecError

#: a TDT model's tokens per frame at most, as asrprec.decoding's TDT_MAX_SYM_PER_FRAME (NeMo's max_symbols default);
#: repeated here so that this module needs numpy only
TDT_MAX_SYM_PER_FRAME = 10

#: the log-mel value of a frame of digital silence: Kaldi's fbank floors the energy at FLT_EPSILON
#: (csukuangfj/kaldi-native-fbank ``kaldi-native-fbank/csrc/feature-fbank.cc``; lhotse uses the same floor)
SILENCE_LOG_MEL = math.log(float(np.finfo(np.float32).eps))

if TYPE_CHECKING:
    import torch

ArrayLike = Union[np.ndarray, "torch.Tensor"]


@dataclass
class FramedTokens:
    """One utterance's token ids, the encoder frame that emitted each (a CTC token: the first frame of its run; a
    streaming decode: counted from the stream's start) and, for a TDT model, each token's predicted duration in
    frames (None otherwise)."""

    tokens: List[int] = field(default_factory=list)
    frames: List[int] = field(default_factory=list)
    durations: Optional[List[int]] = None


def _framed(hyps: List[List[int]], frames: List[List[int]], durations: Optional[List[List[int]]] = None
            ) -> List[FramedTokens]:
    return [FramedTokens(h, f, None if durations is None else d)
            for h, f, d in zip(hyps, frames, durations or [None] * len(hyps))]


def _numpy(x: ArrayLike, dtype) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=dtype))


class OnnxModelError(AsrprecError, ValueError):
    """An exported ONNX file that onnxruntime cannot load (truncated, corrupt, not ONNX); names the file and the fix."""


def _ort_model(path: Path | str, num_threads: int):
    ort = require("onnxruntime")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; export the model first (recipes/<recipe>/export.py)")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = num_threads
    opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own Fail / InvalidProtobuf / InvalidGraph types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxModelError(f"onnxruntime cannot load {path} ({path.stat().st_size:,} bytes): {reason[:200]}; fix: "
                             "export the model again (recipes/<recipe>/export.py); a file cut short by a full disk "
                             "or an interrupted copy looks like this") from None


def _metadata(model) -> Dict[str, str]:
    return dict(model.get_modelmeta().custom_metadata_map)


class _DecoderJoiner:
    """The decoder and joiner graphs and the greedy step shared by offline and streaming decoding."""

    def __init__(self, decoder: Path | str, joiner: Path | str, num_threads: int, unk_id: Optional[int]):
        self.decoder = _ort_model(decoder, num_threads)
        self.joiner = _ort_model(joiner, num_threads)
        meta = _metadata(self.decoder)
        missing = [k for k in ("vocab_size", "context_size") if k not in meta]
        if missing:
            raise ValueError(f"{decoder} lacks the metadata {missing} that sherpa-onnx needs; re-export it")
        self.vocab_size = int(meta["vocab_size"])
        self.context_size = int(meta["context_size"])
        self.blank_id = 0  # sherpa-onnx's fixed blank
        joiner_meta = _metadata(self.joiner)
        # a TDT joiner (asrprec.export.export_offline of a --loss tdt model) adds duration logits after the V tokens
        self.durations = tuple(int(d) for d in joiner_meta["tdt_durations"].split(",")) \
            if joiner_meta.get("tdt_durations") else ()
        # sherpa-onnx treats the token named <unk> as a blank: not emitted, not fed back to the decoder
        self.unk_id = unk_id

    def start_contexts(self, n: int) -> np.ndarray:
        """(n, C) int64 start contexts ``[-1] * (C - 1) + [blank]``."""
        ctx = np.full((n, self.context_size), -1, dtype=np.int64)
        ctx[:, -1] = self.blank_id
        return ctx

    def decoder_out(self, contexts: np.ndarray) -> np.ndarray:
        """(n, C) int64 -> (n, J) float32."""
        name = self.decoder.get_inputs()[0].name
        return self.decoder.run(None, {name: contexts})[0]

    def logits(self, encoder_out: np.ndarray, decoder_out: np.ndarray) -> np.ndarray:
        """(n, J), (n, J) -> (n, V)."""
        a, b = (i.name for i in self.joiner.get_inputs())
        return self.joiner.run(None, {a: encoder_out, b: decoder_out})[0]

    def tdt_greedy(self, encoder_out: np.ndarray, lens: np.ndarray, max_sym_per_frame: int = TDT_MAX_SYM_PER_FRAME,
                   frames: Optional[List[List[int]]] = None, token_durations: Optional[List[List[int]]] = None
                   ) -> List[List[int]]:
        """TDT greedy search over (n, T', J) ``encoder_out`` with ``lens`` valid frames per row, by the rules of
        :mod:`asrprec.decoding.tdt` (each row jumps by its predicted duration, a blank at least one frame, at most
        ``max_sym_per_frame`` tokens on one frame), ``unk_id`` counting as blank; n token-id lists. ``frames`` and
        ``token_durations`` (n lists each), when given, get each token's frame and predicted duration."""
        n, V = encoder_out.shape[0], self.vocab_size
        durations = np.asarray(self.durations, dtype=np.int64)
        hyps: List[List[int]] = [[] for _ in range(n)]
        contexts = self.start_contexts(n)
        dec = self.decoder_out(contexts) if n else None
        t = np.zeros(n, dtype=np.int64)
        sym = np.zeros(n, dtype=np.int64)
        lens = np.asarray(lens, dtype=np.int64)
        while True:
            rows = np.nonzero(t < lens)[0]
            if rows.size == 0:
                return hyps
            logits = self.logits(np.ascontiguousarray(encoder_out[rows, t[rows]]), dec[rows])
            tokens = logits[:, :V].argmax(axis=-1)
            jumps = durations[logits[:, V:].argmax(axis=-1)]
            blank = tokens == self.blank_id
            if self.unk_id is not None:
                blank |= tokens == self.unk_id
            if token_durations is not None:
                for r, d in zip(rows[~blank].tolist(), jumps[~blank].tolist()):
                    token_durations[r].append(int(d))
            emitted_at = t[rows][~blank]
            jumps = np.where(blank, np.maximum(jumps, 1), jumps)
            count = np.where(~blank & (jumps == 0), sym[rows] + 1, 0)
            capped = count >= max_sym_per_frame
            t[rows] += np.where(capped, 1, jumps)
            sym[rows] = np.where(capped, 0, count)
            self._emit(rows[~blank], tokens[~blank], hyps, contexts, dec, frames, emitted_at)

    def greedy_frames(self, encoder_out: np.ndarray, lens: np.ndarray, hyps: List[List[int]], contexts: np.ndarray,
                      dec: np.ndarray, frames: Optional[List[List[int]]] = None, offset: int = 0) -> None:
        """Greedy search over (n, T', J) ``encoder_out`` (``lens`` valid frames per row), at most one symbol per
        frame (``unk_id`` counting as blank), updating ``hyps``, ``contexts`` (n, C) and ``dec`` (n, J) in place;
        ``frames`` (n lists), when given, gets each token's frame plus ``offset``."""
        for t in range(encoder_out.shape[1]):
            rows = np.nonzero(lens > t)[0]
            if rows.size == 0:
                break
            tokens = self.logits(encoder_out[rows, t], dec[rows]).argmax(axis=-1)
            emitted = tokens != self.blank_id
            if self.unk_id is not None:
                emitted &= tokens != self.unk_id
            self._emit(rows[emitted], tokens[emitted], hyps, contexts, dec, frames,
                       np.full(int(emitted.sum()), t + offset))

    def _emit(self, rows: np.ndarray, tokens: np.ndarray, hyps: List[List[int]], contexts: np.ndarray,
              dec: np.ndarray, frames: Optional[List[List[int]]] = None, at: Optional[np.ndarray] = None) -> None:
        """Append ``tokens`` to the hypotheses of ``rows`` (and their frames ``at`` to ``frames``) and advance their
        decoder context and output in place."""
        if rows.size == 0:
            return
        for r, k in zip(rows.tolist(), tokens.tolist()):
            hyps[r].append(int(k))
        if frames is not None:
            for r, f in zip(rows.tolist(), at.tolist()):
                frames[r].append(int(f))
        contexts[rows] = np.concatenate([contexts[rows, 1:], tokens[:, None].astype(np.int64)], axis=1)
        dec[rows] = self.decoder_out(contexts[rows])


class OnnxOfflineModel(_DecoderJoiner):
    """Offline exported transducer (``export_offline``): ``encode`` whole utterances, ``greedy_search``."""

    streaming = False

    def __init__(self, encoder: Path | str, decoder: Path | str, joiner: Path | str, num_threads: int = 1,
                 unk_id: Optional[int] = None):
        super().__init__(decoder, joiner, num_threads, unk_id)
        self.encoder = _ort_model(encoder, num_threads)
        self.metadata = _metadata(self.encoder)
        if "decode_chunk_len" in self.metadata:
            raise ValueError(f"{encoder} is a streaming encoder; load it with OnnxStreamingModel")

    def encode(self, features: ArrayLike, feature_lens: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(N, T, F) float features and (N,) lengths -> ((N, T', J) float32, (N,) int64)."""
        x, x_lens = (i.name for i in self.encoder.get_inputs())
        out, out_lens = self.encoder.run(None, {x: _numpy(features, np.float32), x_lens: _numpy(feature_lens, np.int64)})
        return out, out_lens.astype(np.int64)

    def greedy_search(self, encoder_out: np.ndarray, encoder_out_lens: np.ndarray, return_frames: bool = False
                      ) -> Union[List[List[int]], List[FramedTokens]]:
        """Greedy search, one symbol per frame (a TDT model: :meth:`tdt_greedy`, up to :data:`TDT_MAX_SYM_PER_FRAME`);
        returns N token-id lists (no blanks), or with ``return_frames`` N :class:`FramedTokens`."""
        n = encoder_out.shape[0]
        hyps: List[List[int]] = [[] for _ in range(n)]
        frames = [[] for _ in range(n)] if return_frames else None
        if self.durations:
            durations = [[] for _ in range(n)] if return_frames else None
            hyps = self.tdt_greedy(encoder_out, encoder_out_lens, frames=frames, token_durations=durations)
            return _framed(hyps, frames, durations) if return_frames else hyps
        contexts = self.start_contexts(n)
        dec = self.decoder_out(contexts) if n else None
        self.greedy_frames(encoder_out, np.asarray(encoder_out_lens), hyps, contexts, dec, frames)
        return _framed(hyps, frames) if return_frames else hyps

    def decode(self, features: ArrayLike, feature_lens: ArrayLike, return_frames: bool = False
               ) -> Union[List[List[int]], List[FramedTokens]]:
        """Encode and greedy-search a padded batch: N token-id lists in the input order (with ``return_frames``,
        N :class:`FramedTokens`)."""
        return self.greedy_search(*self.encode(features, feature_lens), return_frames=return_frames)


class OnnxStreamingModel(_DecoderJoiner):
    """Streaming exported transducer (``export_streaming``): chunk-by-chunk encoding with the states in sherpa-onnx's
    layout, greedy search after every chunk."""

    streaming = True

    def __init__(self, encoder: Path | str, decoder: Path | str, joiner: Path | str, num_threads: int = 1,
                 unk_id: Optional[int] = None):
        super().__init__(decoder, joiner, num_threads, unk_id)
        if self.durations:
            raise ValueError(f"{joiner} is a TDT joiner; streaming onnxruntime decoding handles RNN-T joiners only "
                             "(export TDT models offline)")
        self._load_encoder(encoder, num_threads)

    def _load_encoder(self, encoder: Path | str, num_threads: int) -> None:
        """The streaming step graph and the per-stack lists of its metadata."""
        self.encoder = _ort_model(encoder, num_threads)
        meta = self.metadata = _metadata(self.encoder)
        keys = ("encoder_dims", "num_encoder_layers", "query_head_dims", "value_head_dims", "num_heads",
                "cnn_module_kernels", "left_context_len", "T", "decode_chunk_len")
        missing = [k for k in keys if k not in meta]
        if missing:
            raise ValueError(f"{encoder} lacks the streaming metadata {missing}; is it an offline encoder? "
                             "(load it with OnnxOfflineModel)")
        self.lists = {k: [int(v) for v in meta[k].split(",")] for k in keys[:7]}
        self.T = int(meta["T"])
        self.decode_chunk_len = int(meta["decode_chunk_len"])
        self.num_features = int(self.encoder.get_inputs()[0].shape[2])

    def init_states(self, n: int) -> List[np.ndarray]:
        """Zero states for n streams, from the metadata alone (as sherpa-onnx creates them)."""
        m = self.lists
        states = []
        for i, layers in enumerate(m["num_encoder_layers"]):
            L, D = m["left_context_len"][i], m["encoder_dims"][i]
            key, val = m["query_head_dims"][i] * m["num_heads"][i], m["value_head_dims"][i] * m["num_heads"][i]
            for _ in range(layers):
                states += [np.zeros((L, n, key), np.float32), np.zeros((1, n, L, 3 * D // 4), np.float32),
                           np.zeros((L, n, val), np.float32), np.zeros((L, n, val), np.float32),
                           np.zeros((n, D, m["cnn_module_kernels"][i] // 2), np.float32),
                           np.zeros((n, D, m["cnn_module_kernels"][i] // 2), np.float32)]
        states.append(np.zeros((n, 128, 3, ((self.num_features - 1) // 2 - 1) // 2), np.float32))
        states.append(np.zeros((n,), np.int64))
        return states

    def batch_dims(self) -> List[int]:
        return [1, 1, 1, 1, 0, 0] * sum(self.lists["num_encoder_layers"]) + [0, 0]

    def run_encoder(self, x: np.ndarray, states: Sequence[np.ndarray]) -> tuple[np.ndarray, List[np.ndarray]]:
        """One step: x (N, T, F) float32 -> ((N, chunk/2, J), new states)."""
        names = [i.name for i in self.encoder.get_inputs()]
        outs = self.encoder.run(None, dict(zip(names, [x, *states])))
        return outs[0], list(outs[1:])

    def num_chunks(self, num_frames: int) -> int:
        """Steps sherpa-onnx runs for ``num_frames`` feature frames: a step needs ``T`` frames beyond what it has
        processed (strictly more), and the last partial chunk is never run."""
        if num_frames <= self.T:
            return 0
        return -(-(num_frames - self.T) // self.decode_chunk_len)

    def stream_chunks(self, features: ArrayLike, feature_lens: ArrayLike, tail_padding_frames: int = 0
                      ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Run the encoder over a padded batch as streams, each for the steps sherpa-onnx would run for it (whole
        chunks only): yields ``(rows, encoder_out)`` per step, ``rows`` the utterances (input order) still streaming
        and ``encoder_out`` (len(rows), chunk/2, J) their output for this chunk."""
        feats = _numpy(features, np.float32)
        lens = _numpy(feature_lens, np.int64)
        n = feats.shape[0]
        chunks = np.array([self.num_chunks(int(t)) for t in lens + int(tail_padding_frames)])
        width = max(int(chunks.max()) * self.decode_chunk_len + self.T, feats.shape[1]) if n else 0
        x = np.full((n, width, feats.shape[2]), SILENCE_LOG_MEL, dtype=np.float32)
        for i in range(n):
            x[i, : lens[i]] = feats[i, : lens[i]]
        states, dims = self.init_states(n), self.batch_dims()
        for k in range(int(chunks.max()) if n else 0):
            rows = np.nonzero(chunks > k)[0]
            start = k * self.decode_chunk_len
            sub = [np.take(s, rows, axis=d) for s, d in zip(states, dims)]
            out, new = self.run_encoder(np.ascontiguousarray(x[rows, start: start + self.T]), sub)
            for s, v, d in zip(states, new, dims):
                index = [slice(None)] * s.ndim
                index[d] = rows
                s[tuple(index)] = v
            yield rows, out

    def decode(self, features: ArrayLike, feature_lens: ArrayLike, tail_padding_frames: int = 0,
               return_frames: bool = False) -> Union[List[List[int]], List[FramedTokens]]:
        """Decode a padded batch as streams, each running the steps sherpa-onnx would run for it (whole chunks only).

        The features should be those of the audio a client sends, silence at the end included (sherpa-onnx's
        examples append 0.66 s; :func:`asrprec.data.features.pad_with_silence` pads cuts so). Without it,
        ``tail_padding_frames`` appends frames of digital silence (:data:`SILENCE_LOG_MEL`) to the features, close to
        that but not equal at the last frames of speech. Returns N token-id lists in the input order (with
        ``return_frames``, N :class:`FramedTokens`)."""
        n = len(feature_lens)
        hyps: List[List[int]] = [[] for _ in range(n)]
        frames = [[] for _ in range(n)] if return_frames else None
        contexts = self.start_contexts(n)
        dec = self.decoder_out(contexts) if n else None
        done = 0  # encoder frames of the chunks before this one
        for rows, out in self.stream_chunks(features, feature_lens, tail_padding_frames):
            sub_hyps = [hyps[r] for r in rows]
            sub_frames = None if frames is None else [frames[r] for r in rows]
            sub_ctx, sub_dec = contexts[rows], dec[rows]
            self.greedy_frames(out, np.full(len(rows), out.shape[1]), sub_hyps, sub_ctx, sub_dec, sub_frames, done)
            contexts[rows], dec[rows] = sub_ctx, sub_dec
            done += out.shape[1]
        return _framed(hyps, frames) if return_frames else hyps


class OnnxCtcOfflineModel:
    """Offline CTC export (``export_ctc_offline``, ``model.onnx``): log-probabilities of whole utterances and greedy
    search, as sherpa-onnx's ``offline-ctc-greedy-search-decoder.cc`` (blank 0, every other token emitted)."""

    streaming = False
    blank_id = 0

    def __init__(self, model: Path | str, num_threads: int = 1):
        self.model = _ort_model(model, num_threads)
        self.metadata = _metadata(self.model)
        if "decode_chunk_len" in self.metadata:
            raise ValueError(f"{model} is a streaming model; load it with OnnxCtcStreamingModel")
        self.vocab_size = int(self.model.get_outputs()[0].shape[2])

    def log_probs(self, features: ArrayLike, feature_lens: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(N, T, F) features and (N,) lengths -> ((N, T', V) float32 log-probabilities, (N,) int64 lengths)."""
        x, x_lens = (i.name for i in self.model.get_inputs())
        lp, lens = self.model.run(None, {x: _numpy(features, np.float32), x_lens: _numpy(feature_lens, np.int64)})
        return lp, lens.astype(np.int64)

    def decode(self, features: ArrayLike, feature_lens: ArrayLike, return_frames: bool = False
               ) -> Union[List[List[int]], List[FramedTokens]]:
        """Greedy CTC search of a padded batch: N token-id lists in the input order (with ``return_frames``, N
        :class:`FramedTokens`)."""
        lp, lens = self.log_probs(features, feature_lens)
        found = [_ctc_greedy(lp[i, : lens[i]], -1, self.blank_id) for i in range(lp.shape[0])]
        if return_frames:
            return [FramedTokens(tokens, frames) for tokens, frames, _ in found]
        return [tokens for tokens, _, _ in found]


def _ctc_greedy(log_probs: np.ndarray, prev: int, blank_id: int, offset: int = 0
                ) -> tuple[List[int], List[int], int]:
    """(T, V): argmax per frame, a token emitted when it is not blank and not the previous frame's argmax ``prev``;
    returns the tokens, the frame (plus ``offset``) where each one's run starts, and the last frame's argmax."""
    tokens, frames = [], []
    for t, k in enumerate(log_probs.argmax(axis=-1).tolist()):
        if k != blank_id and k != prev:
            tokens.append(int(k))
            frames.append(t + offset)
        prev = k
    return tokens, frames, prev


class OnnxCtcStreamingModel(OnnxStreamingModel):
    """Streaming CTC export (``export_ctc_streaming``, ``model.onnx``): the chunks sherpa-onnx runs, with its states,
    and greedy search carried across chunks (k2-fsa/sherpa-onnx ``online-ctc-greedy-search-decoder.cc``)."""

    blank_id = 0

    def __init__(self, model: Path | str, num_threads: int = 1):  # no decoder or joiner
        self._load_encoder(model, num_threads)
        self.vocab_size = int(self.encoder.get_outputs()[0].shape[2])

    def decode(self, features: ArrayLike, feature_lens: ArrayLike, tail_padding_frames: int = 0,
               return_frames: bool = False) -> Union[List[List[int]], List[FramedTokens]]:
        """Decode a padded batch as streams, whole chunks only (see :meth:`OnnxStreamingModel.decode` for the
        features to pass). Returns N token-id lists in the input order (with ``return_frames``, N
        :class:`FramedTokens`)."""
        n = len(feature_lens)
        hyps: List[List[int]] = [[] for _ in range(n)]
        frames: List[List[int]] = [[] for _ in range(n)]
        prev = [-1] * n
        done = 0  # encoder frames of the chunks before this one
        for rows, out in self.stream_chunks(features, feature_lens, tail_padding_frames):
            for j, r in enumerate(rows.tolist()):
                tokens, at, prev[r] = _ctc_greedy(out[j], prev[r], self.blank_id, done)
                hyps[r] += tokens
                frames[r] += at
            done += out.shape[1]
        return _framed(hyps, frames) if return_frames else hyps


def load_onnx_model(model_dir: Path | str, variant: Optional[str] = None, num_threads: int = 1,
                    unk_as_blank: bool = True, ctc: bool = False
                    ) -> Union[OnnxOfflineModel, OnnxStreamingModel, OnnxCtcOfflineModel, OnnxCtcStreamingModel]:
    """The exported model in ``model_dir`` (``encoder.onnx`` ... or, with ``variant="int8"``/``"fp16"``,
    ``encoder.int8.onnx`` ...), offline or streaming as its encoder's metadata says. ``unk_as_blank``: the token
    tokens.txt names ``<unk>`` counts as a blank in the search, as in sherpa-onnx. ``ctc``: the CTC export
    ``model.onnx`` instead (taken without asking when the folder holds no transducer)."""
    require("onnxruntime")
    model_dir = Path(model_dir)
    suffix = f".{variant}" if variant else ""
    ctc_path = model_dir / f"model{suffix}.onnx"
    if ctc or (ctc_path.is_file() and not (model_dir / f"encoder{suffix}.onnx").is_file()):
        if not ctc_path.is_file():
            raise FileNotFoundError(f"{model_dir} lacks {ctc_path.name}; export the CTC head first (the recipe's "
                                    "export.py --ctc, or a CTC-only model)")
        streaming = "decode_chunk_len" in _metadata(_ort_model(ctc_path, 1))
        return (OnnxCtcStreamingModel if streaming else OnnxCtcOfflineModel)(ctc_path, num_threads=num_threads)
    paths = [model_dir / f"{part}{suffix}.onnx" for part in ("encoder", "decoder", "joiner")]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks {', '.join(missing)}; export the model first (the recipe's "
                                f"export.py{' --' + variant if variant else ''})")
    encoder_meta = _metadata(_ort_model(paths[0], 1))
    cls = OnnxStreamingModel if "decode_chunk_len" in encoder_meta else OnnxOfflineModel
    unk_id = None
    tokens = model_dir / "tokens.txt"
    if unk_as_blank and tokens.is_file():
        for line in tokens.read_text(encoding="utf-8").splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == "<unk>":
                unk_id = int(fields[1])
    return cls(*paths, num_threads=num_threads, unk_id=unk_id)
