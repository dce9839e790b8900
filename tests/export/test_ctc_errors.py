"""CTC export refuses what sherpa-onnx's zipformer CTC recognisers cannot serve, with the reason and the fix (default
tier: every refusal comes before onnx is imported)."""

from __future__ import annotations

import pytest
import torch

from asrprec.export import export_ctc_offline, export_ctc_streaming
from asrprec.models import build_transducer


class _Tokens:
    vocab_size = 12

    def id_to_piece(self, i):
        return "<blk>" if i == 0 else f"t{i}"


def test_a_model_without_ctc_head_is_refused(tmp_path):
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=12)
    with pytest.raises(ValueError, match="no CTC head.*--use-ctc.*without --ctc"):
        export_ctc_offline(model, _Tokens(), tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_conformer_ctc_head_is_refused(tmp_path):
    model = build_transducer(encoder="conformer", size="tiny", vocab_size=12, ctc={})
    with pytest.raises(ValueError, match="zipformer CTC recognisers.*Conformer"):
        export_ctc_offline(model, _Tokens(), tmp_path)


def test_streaming_needs_a_causal_model_and_trained_chunking(tmp_path):
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={}, use_transducer=False)
    with pytest.raises(ValueError, match="causal Zipformer"):
        export_ctc_streaming(model, _Tokens(), tmp_path, chunk_size=16, left_context_frames=64)
    causal = build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={}, use_transducer=False,
                              encoder_overrides={"causal": True})
    with pytest.raises(ValueError, match="--chunk-size 17 was not trained"):
        export_ctc_streaming(causal, _Tokens(), tmp_path, chunk_size=17, left_context_frames=64)


def test_a_bf16_model_is_refused(tmp_path):
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={}).to(torch.bfloat16)
    with pytest.raises(ValueError, match="export from fp32 weights"):
        export_ctc_offline(model, _Tokens(), tmp_path)
