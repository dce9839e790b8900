"""An icefall checkpoint exports to sherpa-onnx's files (``export.py --init-from icefall:FILE``), and the exported
encoder, run by onnxruntime, computes what icefall's own code computed for the fixture (``io.pt``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.export
FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "icefall_zipformer"


@pytest.fixture(scope="module")
def tokenizer50(tmp_path_factory):
    """A 50-piece tokenizer, the fixture's vocabulary size (its pieces do not matter to the numbers checked)."""
    from asrprec.tokenizer import Tokenizer

    words = "the quick brown fox jumps over a lazy dog while seven zebras quietly wander past".split()
    texts = [" ".join(words[i:] + words[:i]).upper() for i in range(len(words))] * 20
    return Tokenizer.train(texts, tmp_path_factory.mktemp("tok") / "bpe", 50)


@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"icefall fixtures not found at {FIXTURES}")
def test_icefall_checkpoint_exports_and_onnx_encoder_matches_icefall(tmp_path, tokenizer50):
    pytest.importorskip("onnxruntime")
    from asrprec.export import load_onnx_model
    from asrprec.export.cli import ExportConfig, export_experiment

    ckpt = FIXTURES / "offline" / "pretrained.pt"
    cfg = ExportConfig(exp_dir=str(tmp_path), init_from=f"icefall:{ckpt}",
                       icefall_args=str(FIXTURES / "offline" / "icefall_args.json"))
    out = export_experiment(cfg, tokenizer50)
    assert out == tmp_path / "onnx-icefall-pretrained"
    for name in ("encoder.onnx", "decoder.onnx", "joiner.onnx", "tokens.txt"):
        assert (out / name).is_file(), name
    io = torch.load(FIXTURES / "offline" / "io.pt", weights_only=False)
    model = load_onnx_model(out)
    enc, enc_lens = model.encode(io["x"].numpy(), io["x_lens"].numpy())
    assert enc_lens.tolist() == io["encoder_out_lens"].tolist()
    # sherpa-onnx's encoder.onnx ends with the joiner's encoder projection: icefall's encoder output projected by the
    # checkpoint's own weights
    state = torch.load(ckpt, weights_only=False)["model"]
    want = torch.nn.functional.linear(io["encoder_out"], state["joiner.encoder_proj.weight"],
                                      state["joiner.encoder_proj.bias"]).numpy()
    for b, n in enumerate(enc_lens.tolist()):
        err = np.abs(enc[b, :n] - want[b, :n]).max()
        assert err <= 1e-4 * np.abs(want).max(), (b, err)
