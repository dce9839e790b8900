"""Word times from the deployment runtime: the CTM and segments files that ``python -m asrprec.export.sherpa --ctm
--segments`` writes from sherpa-onnx's token times (its recognisers' ``timestamps``), checked for form (one line per
recognised word, in the recognised text's order, times ordered and inside the audio) and against the word starts of
asrprec's own greedy search on the PyTorch model's encoder frames (offline, and streaming as sherpa-onnx streams: the
audio, then tail padding, whole chunks only), and of its CTC greedy search for a CTC head. sherpa-onnx runs in a child
process (a model it rejects ends the process)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

SAMPLE_RATE = 16000
TAIL_S = 0.66  # the silence asrprec.export.sherpa appends to a stream (its TAIL_PADDING_S)
FRAME_S = 0.04  # one encoder frame: 10 ms features subsampled 4x, the grid of sherpa-onnx's times and asrprec's
ROUND_S = 0.005  # the files hold seconds with 2 decimals


@pytest.fixture(scope="module")
def _needs_sherpa():
    pytest.importorskip("sherpa_onnx")


def test_timed_tokens_give_word_spans_and_refuse_missing_times():
    from asrprec.export.sherpa import TimedTokens

    # tokens at 0.0, 0.4, 0.52 s: frames 0, 10, 13 of 25 (1 s); HI reaches THERE's start, THERE ends 10 frames past
    # its last piece's frame + 1 (14 -> 24)
    got = TimedTokens([5, 6, 7], ["\u2581HI", "\u2581THE", "RE"], [0.0, 0.4, 0.52], " HI THERE").words(1.0)
    assert [(w.word, w.start, w.end) for w in got] == [("HI", 0.0, pytest.approx(0.4)),
                                                     ("THERE", pytest.approx(0.4), pytest.approx(0.96))]
    assert TimedTokens().words(1.0) == []
    with pytest.raises(ValueError, match="0 token times for 2 tokens"):
        TimedTokens([5, 6], ["\u2581HI", "\u2581THE"], []).words(1.0)


def _sherpa_files(model_dir, waves, tmp_path, streaming, ctc=False):
    """``(ids, ctm, segments)`` of the child process: ``{utt: token ids}``, ``{utt: [(start, duration, word)]}`` and
    ``{utt: [(start, end, text)]}``."""
    np.savez(tmp_path / "waves.npz", **{f"u{i}": w for i, w in enumerate(waves)})
    cmd = [sys.executable, "-m", "asrprec.export.sherpa", "--model-dir", str(model_dir), "--waves",
           str(tmp_path / "waves.npz"), "--out", str(tmp_path / "out.json"), "--batch", "2",
           "--ctm", str(tmp_path / "ctm.txt"), "--segments", str(tmp_path / "segments.txt")]
    cmd += ["--streaming"] if streaming else []
    cmd += ["--ctc"] if ctc else []
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ctm, segments = {}, {}
    for line in (tmp_path / "ctm.txt").read_text().splitlines():
        utt, channel, start, dur, word = line.split(" ")
        assert channel == "1"
        ctm.setdefault(utt, []).append((float(start), float(dur), word))
    for line in (tmp_path / "segments.txt").read_text().splitlines():
        utt, start, end, text = line.split(" ", 3)
        segments.setdefault(utt, []).append((float(start), float(end), text))
    return json.loads((tmp_path / "out.json").read_text()), ctm, segments


def _asrprec_frames(model, exported, wave, fbank, streaming):
    """Token ids and encoder frames of asrprec's greedy search, one symbol per frame as sherpa-onnx's."""
    from asrprec.decoding import DecodingOptions, greedy_search, streaming_decode
    from asrprec.export import read_metadata

    if streaming:
        meta = read_metadata(exported.encoder)
        f = fbank(np.concatenate([wave, np.zeros(int(TAIL_S * SAMPLE_RATE), np.float32)]))
        with torch.no_grad():
            r = streaming_decode(model, f[None], torch.tensor([f.shape[0]]), DecodingOptions(),
                                 int(meta["chunk_size"]), int(meta["left_context_frames"]), whole_chunks_only=True,
                                 return_timestamps=True)[0]
        return list(r.tokens), list(r.frames)
    f = fbank(wave)
    with torch.no_grad():
        enc, lens = model.encode(f[None], torch.tensor([f.shape[0]]))
        tokens, frames = greedy_search(model, enc, lens, max_sym_per_frame=1, return_timestamps=True)
    return tokens[0], frames[0]


def _check_ctm(ids, ctm, segments, waves, tokenizer, asrprec_frames):
    """Checks the child's files on every utterance; ``asrprec_frames(i)``: asrprec's token ids and encoder frames of
    waveform i."""
    from asrprec.timestamps import FRAME_SHIFT_S, words_from_token_times

    total = 0
    for i, wave in enumerate(waves):
        utt, duration = f"u{i}", len(wave) / SAMPLE_RATE
        rows = ctm.get(utt, [])
        words = tokenizer.decode(ids[utt]).split()
        total += len(words)
        # one line per recognised word, in the text's order; times ordered, inside the audio
        assert [w for _, _, w in rows] == words, utt
        starts = [s for s, _, _ in rows]
        assert starts == sorted(starts) and all(s >= 0 and d >= 0 for s, d, _ in rows), rows
        assert all(s + d <= duration + ROUND_S for s, d, _ in rows), (rows, duration)
        # the segments cover the words in order, each from its first word's start to its last word's end
        segs = segments.get(utt, [])
        assert " ".join(t for _, _, t in segs) == " ".join(words)
        k = 0
        for start, end, text in segs:
            n = len(text.split())
            first, last = rows[k], rows[k + n - 1]
            assert start == pytest.approx(first[0], abs=ROUND_S)
            assert end == pytest.approx(last[0] + last[1], abs=2 * ROUND_S)
            k += n
        # asrprec's search on the PyTorch model: the same tokens, and each word starting within one encoder frame of
        # sherpa-onnx's (both time a token by the frame that emits it, x 40 ms), the frames taken to words by the
        # same rules (a token emitted in a streaming decode's tail padding on the audio's last frame)
        tokens, frames = asrprec_frames(i)
        assert tokens == ids[utt], utt
        mine = words_from_token_times([tokenizer.id_to_piece(t) for t in tokens], [f * FRAME_SHIFT_S for f in frames],
                                      duration)
        assert [w.word for w in mine] == words
        for (start, _, word), span in zip(rows, mine):
            assert abs(start - span.start) <= FRAME_S + ROUND_S, (utt, word, start, span)
    assert total >= 2 * len(waves), ids  # enough words that the checks above mean something


@pytest.mark.export
@pytest.mark.usefixtures("_needs_sherpa")
@pytest.mark.parametrize("kind", ["zipformer", "conformer", "causal"])
def test_sherpa_onnx_ctm_has_the_recognised_words_at_asrprec_greedy_search_times(exported, models, waves, fbank,
                                                                                 tokenizer, kind, tmp_path):
    streaming = kind == "causal"
    ids, ctm, segments = _sherpa_files(exported[kind].encoder.parent, waves, tmp_path, streaming)
    _check_ctm(ids, ctm, segments, waves, tokenizer,
               lambda i: _asrprec_frames(models[kind], exported[kind], waves[i], fbank, streaming))


@torch.no_grad()
def _decisive_ctc_model(feats, seed=3):
    """A tiny Zipformer with a CTC head whose argmax varies over this speech, built as test_ctc.py builds its models:
    the encoder's residual branches scaled up, the head reading the encoder output's deviation from its mean, the blank
    bias at the median margin of the best non-blank (about half of the frames blank)."""
    from asrprec.models import build_transducer

    torch.manual_seed(seed)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=64, ctc={}).eval()
    for name, p in model.encoder.named_parameters():
        if name.endswith(("out_proj.weight", "pointwise_conv2.weight")):
            p.add_(torch.randn(p.shape) * (p.std() * 5 + 0.05))
    enc = torch.cat([model.encode(f[None], torch.tensor([f.shape[0]]))[0][0] for f in feats])  # (frames, D_enc)
    lin = model.ctc_output[1]
    lin.weight.copy_(torch.randn(lin.weight.shape) * 4.0 / enc.shape[1] ** 0.5 / enc.std(dim=0))
    lin.bias.copy_(-(lin.weight @ enc.mean(dim=0)))
    logits = torch.nn.functional.linear(enc, lin.weight, lin.bias)
    lin.bias[0] = _between_middle(logits[:, 1:].max(dim=1).values - logits[:, 0])
    return model


@pytest.mark.export
@pytest.mark.usefixtures("_needs_sherpa")
def test_sherpa_onnx_ctc_ctm_has_the_words_at_asrprec_ctc_greedy_search_times(waves, fbank, tokenizer, tmp_path):
    """sherpa-onnx's zipformer CTC recogniser times a token by the first frame of its run, as asrprec's
    ctc_greedy_search(return_timestamps=True) does (k2-fsa/sherpa-onnx
    sherpa-onnx/csrc/offline-ctc-greedy-search-decoder.cc)."""
    pytest.importorskip("onnxruntime")
    from asrprec.decoding import ctc_greedy_search
    from asrprec.export import export_ctc_offline

    feats = [fbank(w) for w in waves]
    model = _decisive_ctc_model(feats)
    folder = export_ctc_offline(model, tokenizer, tmp_path / "onnx").model.parent
    ids, ctm, segments = _sherpa_files(folder, waves, tmp_path, streaming=False, ctc=True)

    def asrprec_frames(i):
        with torch.no_grad():
            enc, lens = model.encode(feats[i][None], torch.tensor([feats[i].shape[0]]))
            tokens, frames = ctc_greedy_search(model.ctc_log_probs(enc), lens, return_timestamps=True)
        return tokens[0], frames[0]

    _check_ctm(ids, ctm, segments, waves, tokenizer, asrprec_frames)


def _between_middle(values):
    """Halfway between the two middle values: a threshold at the median with no value exactly on it (an exact tie
    between blank and a token would let two runtimes' last digits pick differently)."""
    v = values.flatten().sort().values
    k = max(1, len(v) // 2)
    return (v[k - 1] + v[min(k, len(v) - 1)]) / 2
