"""Fixtures for the export tests: tiny transducers whose greedy search emits varied tokens, a matching tokenizer, a
handful of espeak utterances, and (export tier) the models exported once per test run.

The models have random weights, made decisive on purpose: the encoders' residual branches are scaled up (a fresh
model's branches start tiny, so a wrong cache or layout would change its output by ~1e-4 only), the joiner's
projections get their training-time 4x shrink undone, its output is sharpened, ``<unk>`` is never chosen (sherpa-onnx
treats it as a blank, asrprec's greedy search emits it), and the blank bias is set so about half of the frames are
blank on real speech. Token sequences then depend on every part of the pipeline: features, encoder, the decoder's
start context, the joiner and the one-symbol-per-frame rule.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from asrprec._optional import is_available

VOCAB = 64
UNK = 1
CHUNK, LEFT = 16, 64  # the streaming export's chunk size and left context (50 Hz frames), trained values


def _sharpen_encoder(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.encoder.named_parameters():
            if name.endswith(("out_proj.weight", "pointwise_conv2.weight")) or "chunkwise_conv_scale" in name:
                p.add_(torch.randn(p.shape, generator=g) * (p.std() * 5 + 0.05))


def _decisive_joiner(model: torch.nn.Module) -> None:
    j = model.joiner
    with torch.no_grad():
        for lin in (j.encoder_proj, j.decoder_proj):
            lin.weight.mul_(4.0)
            lin.bias.mul_(4.0)
        j.output_linear.weight.mul_(6.0)
        j.output_linear.bias.zero_()
        j.output_linear.bias[UNK] = -100.0


@torch.no_grad()
def _calibrate_blank(model: torch.nn.Module, feats: list[torch.Tensor]) -> None:
    """Blank bias = the median margin of the best non-blank over the blank, at the start context, over the frames
    of ``feats``: about half of the frames are blank."""
    margins = []
    dec = model.joiner.decoder_proj(model.predict(torch.zeros(1, model.decoder.context_size, dtype=torch.int64)))
    for f in feats:
        enc, n = model.encode(f[None], torch.tensor([f.shape[0]]))
        logits = model.joiner(model.joiner.encoder_proj(enc[0, : int(n[0])]), dec[0], project_input=False)
        margins.append(logits[:, 1:].max(dim=-1).values - logits[:, 0])
    model.joiner.output_linear.bias[0] = _between_middle(torch.cat(margins))


def build_model(kind: str, feats: list[torch.Tensor] | None = None, seed: int = 0) -> torch.nn.Module:
    """``kind``: ``zipformer`` (tiny, offline), ``conformer`` (tiny, 2 layers) or ``causal`` (tiny causal Zipformer)."""
    from asrprec.models import build_transducer

    torch.manual_seed(seed)
    if kind == "conformer":
        model = build_transducer(encoder="conformer", size="tiny", vocab_size=VOCAB,
                                 encoder_overrides={"num_encoder_layers": 2})
    else:
        model = build_transducer(encoder="zipformer", size="tiny", vocab_size=VOCAB,
                                 encoder_overrides={"causal": kind == "causal"})
        _sharpen_encoder(model, seed + 1)
    _decisive_joiner(model)
    model.eval()
    if feats:
        _calibrate_blank(model, feats)
    return model


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from asrprec.data.synthetic import CorpusConfig, random_text
    from asrprec.tokenizer import Tokenizer

    rng = np.random.default_rng(0)
    texts = [random_text(rng, CorpusConfig()) for _ in range(600)]
    return Tokenizer.train(texts, tmp_path_factory.mktemp("tok") / "bpe", VOCAB)


@pytest.fixture(scope="session")
def waves():
    """Five espeak utterances at 16 kHz (float32 in [-1, 1], on the int16 grid as the corpus stores them)."""
    if not is_available("espeakng_loader"):
        pytest.skip("needs espeakng-loader (asrprec[synth])")
    from asrprec.data.synthetic import CorpusConfig, plan_corpus, render_utterance

    specs = plan_corpus(CorpusConfig(num_train=0, num_dev=0, num_test=5, seed=7))
    # unwarped voices at a moderate rate: long enough for the untrained models' tests to emit varied tokens
    specs = [{**s, "source_hz": 22050, "espeak_rate": 160} for s in specs]
    return [np.round(render_utterance(s) * 32767.0).astype(np.float32) / 32767.0 for s in specs]


@pytest.fixture(scope="session")
def fbank():
    """lhotse fbank of a waveform, (T, 80) float32 (asrprec's features)."""
    from asrprec.data.features import fbank_extractor

    extractor = fbank_extractor()
    return lambda wave: torch.from_numpy(extractor.extract(np.asarray(wave, np.float32), 16000))


@pytest.fixture(scope="session")
def models(waves, fbank):
    feats = [fbank(w) for w in waves]
    return {kind: build_model(kind, feats) for kind in ("zipformer", "conformer", "causal")}


def _require_export_tier():
    missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {missing} (pip install 'asrprec[export]')")


@pytest.fixture(scope="session")
def exported(models, tokenizer, tmp_path_factory):
    """{kind: ExportedModel}: each model exported once (offline for zipformer/conformer, streaming for causal), with
    int8 and fp16 variants of the Zipformers."""
    _require_export_tier()
    from asrprec.export import convert_fp16, export_offline, export_streaming, quantize_int8

    root = Path(tmp_path_factory.mktemp("onnx"))
    out = {
        "zipformer": export_offline(models["zipformer"], tokenizer, root / "zipformer"),
        "conformer": export_offline(models["conformer"], tokenizer, root / "conformer"),
        "causal": export_streaming(models["causal"], tokenizer, root / "causal", chunk_size=CHUNK,
                                   left_context_frames=LEFT),
    }
    for kind in ("zipformer", "causal"):
        quantize_int8(out[kind])
        convert_fp16(out[kind])
    return out


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield


def _between_middle(values):
    """Halfway between the two middle values: a threshold at the median with no value exactly on it (an exact tie
    between blank and a token would let two runtimes' last digits pick differently)."""
    v = values.flatten().sort().values
    k = max(1, len(v) // 2)
    return (v[k - 1] + v[min(k, len(v) - 1)]) / 2
