"""End to end with the real sherpa-onnx wheel: its recognisers load the exported files and decode espeak speech to
the token ids of asrprec's greedy search (max_sym_per_frame=1) on the PyTorch model. sherpa-onnx computes its own
features from the audio (kaldi-native-fbank); asrprec's come from lhotse. sherpa-onnx runs in a child process,
since a model it rejects ends the process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.export

TAIL_S = 0.66


@pytest.fixture(scope="module", autouse=True)
def _needs_sherpa():
    pytest.importorskip("sherpa_onnx")


def _sherpa(model_dir, waves, tmp_path, *, streaming, variant=None, batch=2, sample_rate=16000):
    """Token ids per waveform from ``python -m asrprec.export.sherpa`` (``batch`` streams per decode_streams)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    np.savez(tmp_path / "waves.npz", **{f"u{i}": w for i, w in enumerate(waves)})
    cmd = [sys.executable, "-m", "asrprec.export.sherpa", "--model-dir", str(model_dir), "--waves",
           str(tmp_path / "waves.npz"), "--out", str(tmp_path / "out.json"), "--batch", str(batch),
           "--sample-rate", str(sample_rate)]
    cmd += ["--streaming"] if streaming else []
    cmd += ["--variant", variant] if variant else []
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    return [out[f"u{i}"] for i in range(len(waves))]


def _nontrivial(hyps):
    assert sum(map(len, hyps)) >= 5 * len(hyps) and len({k for h in hyps for k in h}) >= 5, hyps


@pytest.mark.parametrize("kind", ["zipformer", "conformer"])
def test_offline_recognizer_gives_asrprec_greedy_search(exported, models, waves, fbank, kind, tmp_path):
    from asrprec.decoding import greedy_search

    model = models[kind]
    want = []
    for w in waves:
        f = fbank(w)
        with torch.no_grad():
            want += greedy_search(model, *model.encode(f[None], torch.tensor([f.shape[0]])), max_sym_per_frame=1)
    _nontrivial(want)
    assert _sherpa(exported[kind].encoder.parent, waves, tmp_path, streaming=False) == want


def _asrprec_streaming(model, feats, chunk, left, t, shift):
    """asrprec's streaming encoder and greedy search over the chunks sherpa-onnx runs: a step whenever more than T
    frames are left past what it has processed (k2-fsa/sherpa-onnx online-recognizer-transducer-impl.h), every
    frame of the step valid."""
    from asrprec.decoding import StreamingGreedySearch

    search = StreamingGreedySearch(model, 1, max_sym_per_frame=1)
    states = model.encoder.get_init_states(1, chunk, left)
    start = 0
    with torch.no_grad():
        while start + t < feats.shape[0]:
            out, lens, states = model.encoder.streaming_forward(feats[None, start: start + t], torch.tensor([t]),
                                                                states)
            search.accept(out, lens)
            start += shift
    return search.hyps[0]


def test_online_recognizer_gives_asrprec_streaming_greedy_search(exported, models, waves, fbank, tmp_path):
    from asrprec.export import read_metadata

    ex, model = exported["causal"], models["causal"]
    meta = read_metadata(ex.encoder)
    chunk, left, t, shift = (int(meta[k]) for k in ("chunk_size", "left_context_frames", "T", "decode_chunk_len"))
    tail = np.zeros(int(TAIL_S * 16000), np.float32)
    feats = [fbank(np.concatenate([w, tail])) for w in waves]
    want = [_asrprec_streaming(model, f, chunk, left, t, shift) for f in feats]
    _nontrivial(want)
    # two streams per decode_streams call: sherpa-onnx stacks their states along the batch axes
    assert _sherpa(ex.encoder.parent, waves, tmp_path, streaming=True, batch=2) == want
    # asrprec's batched streaming decoding, ending streams as sherpa-onnx does, agrees
    from asrprec.decoding import DecodingOptions, streaming_decode

    lens = torch.tensor([f.shape[0] for f in feats])
    batched = streaming_decode(model, torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), lens,
                               DecodingOptions(), chunk, left, whole_chunks_only=True)
    assert batched == want


@pytest.mark.parametrize("kind", ["zipformer", "causal"])
@pytest.mark.parametrize("variant", ["fp16", "int8"])
def test_variants_load_and_decode_as_onnxruntime(exported, waves, fbank, kind, variant, tmp_path):
    """fp16 and int8 files load in sherpa-onnx and decode as asrprec's onnxruntime decoding of the same files, one
    stream per call (int8 quantises activations with a scale over the whole batch, so results depend on which
    streams share a call). fp16: nearly the same token ids (at most 2 % token edit distance): the two feature
    extractors differ in their last digits, which fp16's 11-bit significand can turn into another argmax where these
    untrained models have near ties. int8: sherpa-onnx bundles another onnxruntime release, whose integer kernels and
    rounding of the activations' quantisation differ, and the two feature extractors' last digits move values across
    quantisation steps, so a few tokens of these deliberately sensitive models may differ: at most 10 % token edit
    distance."""
    from asrprec.export import load_onnx_model

    ex = exported[kind]
    runtime = load_onnx_model(ex.encoder.parent, variant)
    streaming = kind == "causal"
    tail = np.zeros(int(TAIL_S * 16000), np.float32)
    want = []
    for w in waves:
        f = fbank(np.concatenate([w, tail]) if streaming else w)
        lens = torch.tensor([f.shape[0]])
        want += runtime.decode(f[None], lens)
    _nontrivial(want)
    got = _sherpa(ex.encoder.parent, waves, tmp_path, streaming=streaming, variant=variant, batch=1)
    import kaldialign

    errors = sum(kaldialign.edit_distance(w, g)["total"] for w, g in zip(want, got))
    assert errors <= (0.02 if variant == "fp16" else 0.1) * sum(map(len, want)), (errors, want, got)


def test_decoder_without_vocab_size_ends_the_process(exported, waves, tmp_path):
    """The decoder metadata is what sherpa-onnx needs: without vocab_size it exits (status 255), which is why every
    test here runs it in a child process."""
    import onnx

    src = exported["zipformer"].encoder.parent
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    model = onnx.load(str(bad / "decoder.onnx"))
    keep = [p for p in model.metadata_props if p.key != "vocab_size"]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    onnx.save(model, str(bad / "decoder.onnx"))
    np.savez(tmp_path / "waves.npz", u0=waves[0])
    run = subprocess.run([sys.executable, "-m", "asrprec.export.sherpa", "--model-dir", str(bad), "--waves",
                          str(tmp_path / "waves.npz"), "--out", str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "vocab_size" in run.stderr + run.stdout
    assert not (tmp_path / "out.json").exists()


def test_each_waveform_reaches_sherpa_onnx_with_its_own_rate(exported, waves, monkeypatch):
    """sherpa-onnx resamples to the model's 16 kHz itself when told a stream's rate (``accept_waveform(rate,
    samples)``); onnx_decode.py told it 16 kHz for every file, and 8 kHz audio decoded at 94 % WER. A recording
    recognizer in place of sherpa-onnx's shows the rate each stream is given, streaming tail padding included."""
    import asrprec.export.sherpa as sherpa

    given = []

    class Stream:
        def __init__(self):
            self.result = type("R", (), {"tokens": []})()

        def accept_waveform(self, rate, samples):
            given.append((rate, len(samples)))

        def input_finished(self):
            pass

    class Recognizer:
        @classmethod
        def from_transducer(cls, **kw):
            assert kw["sample_rate"] == 16000  # the model's feature rate
            return cls()

        def create_stream(self):
            return Stream()

        def decode_streams(self, streams):
            pass

        def is_ready(self, s):
            return False

        def get_result_all(self, s):
            return s.result

    fake = type("sherpa_onnx", (), {"OfflineRecognizer": Recognizer, "OnlineRecognizer": Recognizer})
    monkeypatch.setattr(sherpa, "require", lambda name: fake)
    model_dir = exported["zipformer"].encoder.parent
    rates = [8000, 16000, 44100]
    sherpa.recognize(model_dir, [np.zeros(r, np.float32) for r in rates], streaming=False, sample_rates=rates)
    assert given == [(8000, 8000), (16000, 16000), (44100, 44100)]
    given.clear()
    sherpa.recognize(model_dir, [np.zeros(8000, np.float32)], streaming=True, sample_rates=8000, tail_padding_s=0.5)
    assert given == [(8000, 8000), (8000, 4000)]  # the tail's silence at the stream's rate
    with pytest.raises(ValueError, match="2 waveforms but 3 sample rates"):
        sherpa.recognize(model_dir, [np.zeros(1)] * 2, streaming=False, sample_rates=rates)
