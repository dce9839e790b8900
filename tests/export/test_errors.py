"""Export refuses what it cannot serve, with the reason and the fix (default tier: every refusal comes before
onnx is imported)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asrprec.export import export_offline, export_streaming, load_experiment_model
from asrprec.models import build_transducer

ROOT = Path(__file__).resolve().parents[2]


def _model(encoder="zipformer", **overrides):
    torch.manual_seed(0)
    return build_transducer(encoder=encoder, size="tiny", vocab_size=32, encoder_overrides=overrides).eval()


def test_streaming_export_needs_a_causal_zipformer(tmp_path):
    for model in (_model(), _model("conformer")):
        with pytest.raises(ValueError, match="needs a causal Zipformer.*export it offline"):
            export_streaming(model, None, tmp_path, chunk_size=16, left_context_frames=64)
    assert not any(tmp_path.iterdir())


def test_streaming_export_refuses_untrained_chunking(tmp_path):
    model = _model(causal=True, chunk_size=[16, 32, -1], left_context_frames=[64, 128, -1])
    with pytest.raises(ValueError, match=r"--chunk-size 64 was not trained.*\[16, 32\]"):
        export_streaming(model, None, tmp_path, chunk_size=64, left_context_frames=64)
    with pytest.raises(ValueError, match=r"--left-context-frames 256 was not trained.*\[64, 128\]"):
        export_streaming(model, None, tmp_path, chunk_size=16, left_context_frames=256)
    with pytest.raises(ValueError, match="not trained"):
        export_offline(model, None, tmp_path, chunk_size=64, left_context_frames=64)
    with pytest.raises(ValueError, match="causal Zipformer models only"):
        export_offline(_model(), None, tmp_path, chunk_size=16, left_context_frames=64)


def test_export_from_reduced_precision_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fp32 weights"):
        export_offline(_model().to(torch.bfloat16), None, tmp_path)


def test_missing_onnx_names_the_extra(tmp_path, monkeypatch):
    real = importlib.import_module

    def fake(name, *a, **k):
        if name.split(".")[0] in ("onnx", "onnxscript", "onnxruntime"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"asrprec\[export\]"):
        export_offline(_model(), None, tmp_path)
    from asrprec.export import load_onnx_model

    with pytest.raises(ImportError, match=r"asrprec\[export\]"):
        load_onnx_model(tmp_path)


def test_experiment_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_experiment_model(tmp_path / "nope", epoch=3)
    with pytest.raises(FileNotFoundError, match="model.json does not exist"):
        load_experiment_model(tmp_path, epoch=3)
    (tmp_path / "model.json").write_text(json.dumps(
        {"encoder": "zipformer", "size": "tiny", "vocab_size": 32, "blank_id": 0, "context_size": 2}))
    with pytest.raises(FileNotFoundError, match=r"missing epoch-2\.pt, epoch-3\.pt.*present: none"):
        load_experiment_model(tmp_path, epoch=3, avg=2)


def test_recipe_export_reports_a_missing_experiment(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "recipes/espeak/export.py"), "--exp-dir", str(tmp_path),
                          "--epoch", "1"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0
    assert "model.json does not exist" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_onnx_file_is_one_error_naming_it(tmp_path, keep):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from asrprec.export.runtime import OnnxModelError, _ort_model

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    path = tmp_path / "encoder.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert _ort_model(path, 1).run(None, {"x": np.ones((1, 64), np.float32)})[0][0, 0] == 64.0  # whole: it runs
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    with pytest.raises(OnnxModelError, match=rf"onnxruntime cannot load {path} .* fix: export the model again") as e:
        _ort_model(path, 1)
    assert "\n" not in str(e.value)
