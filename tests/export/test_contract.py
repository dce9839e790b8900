"""The static contract of the exported files, read back with onnx: input and output names, order, dtypes and
dynamic axes, the metadata sherpa-onnx reads and its consistency (k2-fsa/sherpa-onnx
sherpa-onnx/csrc/offline-transducer-model.cc, online-zipformer2-transducer-model.cc, symbol-table.cc)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.export

FLOAT, INT64 = 1, 7  # onnx.TensorProto.FLOAT, INT64


def _io(path):
    import onnx

    model = onnx.load(str(path))

    def spec(v):
        t = v.type.tensor_type
        return v.name, t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim]

    meta = {p.key: p.value for p in model.metadata_props}
    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output], meta


def _tokens(path):
    return [line.split() for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("kind,model_type", [("zipformer", "zipformer2"), ("conformer", "conformer")])
def test_offline_graphs(exported, models, kind, model_type):
    ex, model = exported[kind], models[kind]
    ins, outs, meta = _io(ex.encoder)
    assert [(n, t) for n, t, _ in ins] == [("x", FLOAT), ("x_lens", INT64)]
    assert ins[0][2] == ["N", "T", 80] and ins[1][2] == ["N"]
    assert [(n, t) for n, t, _ in outs] == [("encoder_out", FLOAT), ("encoder_out_lens", INT64)]
    j = model.joiner.joiner_dim
    assert outs[0][2][0] == "N" and isinstance(outs[0][2][1], str) and "T" in outs[0][2][1] and outs[0][2][2] == j
    assert meta["model_type"] == model_type

    ins, outs, meta = _io(ex.decoder)
    c = int(meta["context_size"])
    assert c == model.decoder.context_size
    assert ins == [("y", INT64, ["N", c])] and outs == [("decoder_out", FLOAT, ["N", j])]
    vocab = int(meta["vocab_size"])

    ins, outs, meta = _io(ex.joiner)
    assert ins == [("encoder_out", FLOAT, ["N", j]), ("decoder_out", FLOAT, ["N", j])]
    assert outs == [("logit", FLOAT, ["N", vocab])]
    assert int(meta["joiner_dim"]) == j

    tokens = _tokens(ex.tokens)
    assert len(tokens) == vocab == model.decoder.vocab_size
    assert [int(i) for _, i in tokens] == list(range(vocab))
    assert tokens[0][0] == "<blk>" and tokens[1][0] == "<unk>"


def test_streaming_graph(exported, models):
    ex, model = exported["causal"], models["causal"]
    ins, outs, meta = _io(ex.encoder)
    lists = {k: [int(v) for v in meta[k].split(",")] for k in (
        "encoder_dims", "num_encoder_layers", "query_head_dims", "value_head_dims", "num_heads",
        "cnn_module_kernels", "left_context_len")}
    n_stacks = len(model.encoder.encoder.downsampling_factor)
    assert meta["model_type"] == "zipformer2"
    assert all(len(v) == n_stacks for v in lists.values()), lists
    n_layers = sum(lists["num_encoder_layers"])
    assert len(ins) == 1 + 6 * n_layers + 2 and len(outs) == len(ins)
    t, shift = int(meta["T"]), int(meta["decode_chunk_len"])
    assert ins[0] == ("x", FLOAT, ["N", t, 80])
    assert outs[0] == ("encoder_out", FLOAT, ["N", shift // 4, model.joiner.joiner_dim])
    # the states: sherpa-onnx's shapes rebuilt from the metadata, batch axis N (GetEncoderInitStates)
    want = []
    for i in range(n_stacks):
        L, D = lists["left_context_len"][i], lists["encoder_dims"][i]
        key = lists["query_head_dims"][i] * lists["num_heads"][i]
        val = lists["value_head_dims"][i] * lists["num_heads"][i]
        k = lists["cnn_module_kernels"][i] // 2
        for _ in range(lists["num_encoder_layers"][i]):
            want += [[L, "N", key], [1, "N", L, 3 * D // 4], [L, "N", val], [L, "N", val], ["N", D, k], ["N", D, k]]
    want += [["N", 128, 3, 19], ["N"]]
    assert [shape for _, _, shape in ins[1:]] == want
    assert [shape for _, _, shape in outs[1:]] == want
    assert [dtype for _, dtype, _ in ins[1:]] == [FLOAT] * (len(want) - 1) + [INT64]
    assert [dtype for _, dtype, _ in outs[1:]] == [dtype for _, dtype, _ in ins[1:]]
    assert ins[-1][0] == "processed_lens" and outs[-1][0] == "new_processed_lens"
    assert [n for n, _, _ in outs[1:]] == ["new_" + n for n, _, _ in ins[1:]]

    _, _, dec_meta = _io(ex.decoder)
    assert int(dec_meta["vocab_size"]) == len(_tokens(ex.tokens)) == model.decoder.vocab_size


@pytest.mark.parametrize("kind", ["zipformer", "causal"])
@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_variants_keep_metadata_and_float_io(exported, kind, variant):
    ex = exported[kind]
    var = ex.variant(variant)
    for base, other in ((ex.encoder, var.encoder), (ex.decoder, var.decoder), (ex.joiner, var.joiner)):
        ins, outs, meta = _io(base)
        v_ins, v_outs, v_meta = _io(other)
        assert {k: v for k, v in v_meta.items() if k in meta} == meta
        assert [(n, t) for n, t, _ in v_ins] == [(n, t) for n, t, _ in ins]
        assert [(n, t) for n, t, _ in v_outs] == [(n, t) for n, t, _ in outs]
    assert var.encoder.stat().st_size < ex.encoder.stat().st_size


@pytest.mark.parametrize("kind", ["zipformer", "causal"])
def test_int8_weights_cannot_saturate_a_non_vnni_cpu(exported, kind):
    """On x86 without VNNI, onnxruntime multiplies uint8 activations (0..255) by int8 weights with vpmaddubsw, which
    adds two products into a saturating int16: exact only while 2 * 255 * max|w| <= 32767, i.e. |w| <= 64. Every
    quantised weight matrix of every int8 file keeps to that bound (full-range int8 weights, up to 127, decoded
    repeated tokens on such a CPU), and the bound is not met by accident: some weight reaches at least 32."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    var = exported[kind].variant("int8")
    for path in (var.encoder, var.decoder, var.joiner):
        weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
                   if t.data_type == onnx.TensorProto.INT8]
        assert weights, f"{path.name} holds no int8 weight"
        peak = max(int(abs(w.astype(np.int32)).max()) for w in weights)
        assert 32 <= peak and 2 * 255 * peak <= 32767, (path.name, peak)
