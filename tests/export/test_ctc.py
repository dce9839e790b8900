"""CTC exports (model.onnx + tokens.txt) against asrprec's CTC greedy search: sherpa-onnx's zipformer CTC recognisers
(offline ``from_zipformer_ctc`` on a hybrid's CTC head, streaming ``from_zipformer2_ctc`` on a CTC-only causal model)
and asrprec's onnxruntime decoding recognise espeak speech as the PyTorch model does. sherpa-onnx runs in a child
process (a model it rejects ends the process).

The models have random weights made decisive (see conftest.py): the encoder's residual branches scaled up, and a CTC
head reading the part of the encoder output that changes over time, its blank bias set so about half of the frames
are blank on this speech."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from asrprec.decoding import DecodingOptions, ctc_greedy_search, streaming_decode
from asrprec.models import build_transducer

pytestmark = pytest.mark.export

VOCAB = 64
CHUNK, LEFT = 16, 64
TAIL_S = 0.66


def _sharpen_encoder(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.encoder.named_parameters():
            if name.endswith(("out_proj.weight", "pointwise_conv2.weight")) or "chunkwise_conv_scale" in name:
                p.add_(torch.randn(p.shape, generator=g) * (p.std() * 5 + 0.05))


@torch.no_grad()
def build_ctc_model(feats: list[torch.Tensor], *, use_transducer: bool, causal: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=VOCAB, ctc={},
                             use_transducer=use_transducer, encoder_overrides={"causal": causal})
    _sharpen_encoder(model, seed + 1)
    model.eval()
    enc = torch.cat([model.encode(f[None], torch.tensor([f.shape[0]]))[0][0] for f in feats])  # (frames, D_enc)
    mean, std = enc.mean(dim=0), enc.std(dim=0)
    lin = model.ctc_output[1]
    g = torch.Generator().manual_seed(seed + 2)
    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 4.0 / enc.shape[1] ** 0.5 / std)
    lin.bias.copy_(-(lin.weight @ mean))
    logits = torch.nn.functional.linear(enc, lin.weight, lin.bias)
    lin.bias[0] = _between_middle(logits[:, 1:].max(dim=1).values - logits[:, 0])
    return model


@pytest.fixture(scope="module", autouse=True)
def _needs_export_tier():
    for name in ("onnx", "onnxscript", "onnxruntime", "sherpa_onnx"):
        pytest.importorskip(name)


@pytest.fixture(scope="module")
def ctc_models(waves, fbank):
    feats = [fbank(w) for w in waves]
    return {"hybrid": build_ctc_model(feats, use_transducer=True, causal=False),
            "streaming": build_ctc_model(feats, use_transducer=False, causal=True)}


@pytest.fixture(scope="module")
def ctc_exported(ctc_models, tokenizer, tmp_path_factory):
    from asrprec.export import convert_ctc_fp16, export_ctc_offline, export_ctc_streaming, quantize_ctc_int8

    root = tmp_path_factory.mktemp("onnx_ctc")
    out = {"hybrid": export_ctc_offline(ctc_models["hybrid"], tokenizer, root / "hybrid"),
           "streaming": export_ctc_streaming(ctc_models["streaming"], tokenizer, root / "streaming",
                                             chunk_size=CHUNK, left_context_frames=LEFT)}
    quantize_ctc_int8(out["hybrid"])
    convert_ctc_fp16(out["hybrid"])
    return out


def _sherpa(model_dir, waves, tmp_path, *, streaming, variant=None, batch=2):
    np.savez(tmp_path / "waves.npz", **{f"u{i}": w for i, w in enumerate(waves)})
    cmd = [sys.executable, "-m", "asrprec.export.sherpa", "--model-dir", str(model_dir), "--ctc", "--waves",
           str(tmp_path / "waves.npz"), "--out", str(tmp_path / "out.json"), "--batch", str(batch)]
    cmd += ["--streaming"] if streaming else []
    cmd += ["--variant", variant] if variant else []
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    return [out[f"u{i}"] for i in range(len(waves))]


def _nontrivial(hyps):
    assert sum(map(len, hyps)) >= 5 * len(hyps) and len({k for h in hyps for k in h}) >= 5, hyps


def _identical(got, want):
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(want), f"{same}/{len(want)} identical utterances: {got} vs {want}"


def test_contract(ctc_exported, ctc_models, tokenizer):
    """What sherpa-onnx reads: inputs by position, V from the static last axis of output 0, int64 lengths, the
    streaming metadata and one input per state; tokens.txt names every id, <blk> = 0."""
    import onnx

    from asrprec.export import StreamingLayout, read_metadata

    off = onnx.load(str(ctc_exported["hybrid"].model))
    assert [i.name for i in off.graph.input] == ["x", "x_lens"]
    assert [o.name for o in off.graph.output] == ["log_probs", "log_probs_len"]
    dims = off.graph.output[0].type.tensor_type.shape.dim
    assert dims[2].dim_value == VOCAB and dims[0].dim_param == "N"
    assert off.graph.output[1].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert read_metadata(ctc_exported["hybrid"].model)["model_type"] == "zipformer2_ctc"
    lines = ctc_exported["hybrid"].tokens.read_text().splitlines()
    assert len(lines) == VOCAB and lines[0] == "<blk> 0"

    st = onnx.load(str(ctc_exported["streaming"].model))
    layout = StreamingLayout.of(ctc_models["streaming"], CHUNK, LEFT)
    assert [i.name for i in st.graph.input] == ["x", *layout.state_names()]
    assert st.graph.output[0].name == "log_probs"
    assert st.graph.output[0].type.tensor_type.shape.dim[2].dim_value == VOCAB
    meta = read_metadata(ctc_exported["streaming"].model)
    assert {k: meta[k] for k in layout.metadata()} == layout.metadata()
    assert meta["model_type"] == "zipformer2"


def test_onnxruntime_log_probs_match_pytorch(ctc_exported, ctc_models):
    from asrprec.export import load_onnx_model

    model = ctc_models["hybrid"]
    runtime = load_onnx_model(ctc_exported["hybrid"].model.parent, ctc=True)
    g = torch.Generator().manual_seed(0)
    for lens in ([9], [10, 61], [150, 97, 33]):
        x = torch.randn(len(lens), max(lens), 80, generator=g)
        lp, lp_lens = runtime.log_probs(x, torch.tensor(lens))
        with torch.no_grad():
            enc, enc_lens = model.encode(x, torch.tensor(lens))
            want = model.ctc_log_probs(enc)
        assert lp_lens.tolist() == enc_lens.tolist()
        for i, n in enumerate(enc_lens.tolist()):
            np.testing.assert_allclose(lp[i, :n], want[i, :n].numpy(), atol=1e-4)


def test_offline_recognizer_gives_asrprec_ctc_greedy_search(ctc_exported, ctc_models, waves, fbank, tmp_path):
    """A hybrid's CTC head through OfflineRecognizer.from_zipformer_ctc (two streams per call) and through asrprec's
    onnxruntime decoding: every utterance identical to ctc_greedy_search on the PyTorch model."""
    from asrprec.export import load_onnx_model

    model = ctc_models["hybrid"]
    want = []
    for w in waves:
        f = fbank(w)
        with torch.no_grad():
            enc, lens = model.encode(f[None], torch.tensor([f.shape[0]]))
            want += ctc_greedy_search(model.ctc_log_probs(enc), lens)
    _nontrivial(want)
    _identical(_sherpa(ctc_exported["hybrid"].model.parent, waves, tmp_path, streaming=False), want)
    runtime = load_onnx_model(ctc_exported["hybrid"].model.parent, ctc=True)
    feats = [fbank(w) for w in waves]
    padded, lens = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([f.shape[0] for f in feats])
    _identical(runtime.decode(padded, lens), want)
    # each token's frame: the first frame of its run, as asrprec's ctc_greedy_search(return_timestamps=True)
    with torch.no_grad():
        enc, enc_lens = model.encode(padded, lens)
        tokens, frames = ctc_greedy_search(model.ctc_log_probs(enc), enc_lens, return_timestamps=True)
    timed = runtime.decode(padded, lens, return_frames=True)
    assert [r.tokens for r in timed] == tokens and [r.frames for r in timed] == frames


def test_online_recognizer_gives_asrprec_streaming_ctc_greedy_search(ctc_exported, ctc_models, waves, fbank,
                                                                     tmp_path):
    """A CTC-only causal model through OnlineRecognizer.from_zipformer2_ctc (0.66 s of tail padding, two streams per
    call: stacked states) against asrprec's streaming CTC greedy search over the chunks sherpa-onnx runs
    (whole_chunks_only) and asrprec's onnxruntime streaming decoding."""
    from asrprec.export import load_onnx_model

    model = ctc_models["streaming"]
    tail = np.zeros(int(TAIL_S * 16000), np.float32)
    feats = [fbank(np.concatenate([w, tail])) for w in waves]
    padded, lens = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([f.shape[0] for f in feats])
    want = streaming_decode(model, padded, lens, DecodingOptions(method="ctc_greedy_search"), CHUNK, LEFT,
                            whole_chunks_only=True)
    _nontrivial(want)
    _identical(_sherpa(ctc_exported["streaming"].model.parent, waves, tmp_path, streaming=True, batch=2), want)
    runtime = load_onnx_model(ctc_exported["streaming"].model.parent)  # a CTC-only folder: found without ctc=True
    _identical(runtime.decode(padded, lens), want)
    # frames counted from the stream's start across chunks, as asrprec's streaming search counts them
    mine = streaming_decode(model, padded, lens, DecodingOptions(method="ctc_greedy_search"), CHUNK, LEFT,
                            whole_chunks_only=True, return_timestamps=True)
    timed = runtime.decode(padded, lens, return_frames=True)
    assert [r.tokens for r in timed] == [list(r.tokens) for r in mine]
    assert [r.frames for r in timed] == [list(r.frames) for r in mine]
    assert max(f for r in timed for f in r.frames) >= 2 * CHUNK // 2  # tokens beyond the first chunks


@pytest.mark.parametrize("variant", ["fp16", "int8"])
def test_variants_load_in_sherpa_onnx(ctc_exported, waves, fbank, variant, tmp_path):
    """model.fp16.onnx and model.int8.onnx keep the metadata, load in sherpa-onnx and decode close to the fp32 export
    run by onnxruntime (at most 10 % token edit distance: reduced precision moves near-ties)."""
    import kaldialign

    from asrprec.export import load_onnx_model

    folder = ctc_exported["hybrid"].model.parent
    runtime = load_onnx_model(folder, ctc=True)
    want = [runtime.decode(fbank(w)[None], torch.tensor([fbank(w).shape[0]]))[0] for w in waves]
    got = _sherpa(folder, waves, tmp_path, streaming=False, variant=variant, batch=1)
    errors = sum(kaldialign.edit_distance(w, g)["total"] for w, g in zip(want, got))
    assert errors <= 0.1 * sum(map(len, want)), (errors, want, got)


def _between_middle(values):
    """Halfway between the two middle values: a threshold at the median with no value exactly on it (an exact tie
    between blank and a token would let two runtimes' last digits pick differently)."""
    v = values.flatten().sort().values
    k = max(1, len(v) // 2)
    return (v[k - 1] + v[min(k, len(v) - 1)]) / 2
