"""Deployment: export transducers (and CTC heads, :mod:`.ctc`) to the ONNX files sherpa-onnx (k2-fsa/sherpa-onnx)
runs, offline and streaming, and decode the exported files with onnxruntime. Needs the ``export`` extra (onnx,
onnxscript, onnxruntime)."""

from .exporter import (
    ExportedModel, add_metadata, convert_fp16, export_offline, export_streaming, quantize_int8, read_metadata,
    write_tokens,
)
from .ctc import ExportedCtcModel, convert_ctc_fp16, export_ctc_offline, export_ctc_streaming, quantize_ctc_int8
from asrprec.experiment import load_experiment_model
from .runtime import FramedTokens, OnnxCtcOfflineModel, OnnxCtcStreamingModel, OnnxOfflineModel, OnnxStreamingModel, load_onnx_model
from .wrappers import StreamingLayout

__all__ = [
    "ExportedModel", "FramedTokens", "OnnxOfflineModel", "OnnxStreamingModel", "StreamingLayout", "add_metadata", "convert_fp16",
    "export_offline", "export_streaming", "load_experiment_model", "load_onnx_model", "quantize_int8",
    "read_metadata", "write_tokens",
    "ExportedCtcModel", "OnnxCtcOfflineModel", "OnnxCtcStreamingModel", "convert_ctc_fp16", "export_ctc_offline",
    "export_ctc_streaming", "quantize_ctc_int8",
]
