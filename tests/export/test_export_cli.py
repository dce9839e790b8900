"""A recipe's export command: its flags are ExportConfig's fields, a bad combination is named, and the files it
writes from an experiment folder are the ones the library exports directly from the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from asrprec.config import ConfigError
from asrprec.export.cli import ExportConfig, exporting_command_line


def test_flags_build_the_config_and_streaming_needs_its_chunking():
    cl = exporting_command_line(defaults={"export": {"exp_dir": "exp/x"}})
    cfg = cl.parse(["--epoch", "3", "--avg", "2", "--int8"]).export
    assert cfg == ExportConfig(exp_dir="exp/x", epoch=3, avg=2, int8=True)
    assert cfg.tag() == "epoch-3-avg-2"
    with pytest.raises(ConfigError, match="--streaming needs --chunk-size and --left-context-frames"):
        cl.build(flags={"export.epoch": 3, "export.streaming": True, "export.chunk_size": 32})


@pytest.mark.export
def test_export_experiment_writes_what_the_library_exports(tokenizer, tmp_path):
    import onnxruntime as ort

    from asrprec.checkpoint import TrainingObjects, save_checkpoint
    from asrprec.export import export_offline
    from asrprec.models import build_transducer

    config = {"encoder": "conformer", "size": "tiny", "vocab_size": tokenizer.vocab_size,
              "encoder_overrides": {"num_encoder_layers": 2}}
    torch.manual_seed(0)
    model = build_transducer(**config).eval()
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "model.json").write_text(json.dumps(config))
    save_checkpoint(exp / "epoch-1.pt", TrainingObjects(model=model), extra={"epoch": 1, "batch_idx_train": 1})

    from asrprec.export.cli import export_experiment

    out = export_experiment(ExportConfig(exp_dir=str(exp), epoch=1, int8=True), tokenizer)
    assert out == exp / "onnx-epoch-1-avg-1"
    assert {"encoder.onnx", "encoder.int8.onnx", "decoder.onnx", "joiner.onnx", "tokens.txt"} <= \
        {p.name for p in out.iterdir()}
    assert json.loads((out / "export.json").read_text())["weights"] == "average of epoch-1.pt"
    direct = export_offline(model, tokenizer, tmp_path / "direct")
    x = torch.randn(1, 120, 80, generator=torch.Generator().manual_seed(3)).numpy() * 3 - 8
    lens = np.array([120])
    runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x, "x_lens": lens})[0]
            for p in (out / "encoder.onnx", direct.encoder)]
    np.testing.assert_allclose(runs[0], runs[1], rtol=0, atol=1e-6)
    assert (out / "tokens.txt").read_text() == (tmp_path / "direct" / "tokens.txt").read_text()
