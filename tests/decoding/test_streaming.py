"""Streaming decoding: greedy and modified beam search fed chunk by chunk against the batched searches over whole
utterances, and chunk-by-chunk decoding of a causal Zipformer transducer against decoding its simulated-streaming output."""

from __future__ import annotations

import pytest
import torch

from asrprec.decoding import (
    DecodingOptions, StreamingGreedySearch, StreamingModifiedBeamSearch, greedy_search, modified_beam_search,
    streaming_decode, streaming_encode,
)
from asrprec.models import build_transducer, configure_streaming

LENS = [7, 0, 12, 3, 12, 1]


def _random_chunks(enc, enc_lens, seed):
    g = torch.Generator().manual_seed(seed)
    start = 0
    while start < enc.shape[1]:
        n = int(torch.randint(1, 5, (1,), generator=g))  # chunks of 1-4 frames
        yield enc[:, start: start + n], (enc_lens - start).clamp(min=0, max=n)
        start += n


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_sym", [1, 2])
def test_streaming_greedy_matches_greedy_search(kit, seed, max_sym):
    model = kit.make_model(seed)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    want = greedy_search(model, enc, enc_lens, max_sym_per_frame=max_sym)
    assert sum(map(len, want)) > 10  # the model emits enough for the comparison to mean something
    search = StreamingGreedySearch(model, len(LENS), max_sym_per_frame=max_sym)
    for chunk, chunk_lens in _random_chunks(enc, enc_lens, seed):
        search.accept(chunk, chunk_lens)
    assert search.hyps == want


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beam", [1, 3])
def test_streaming_beam_search_matches_modified_beam_search(kit, seed, beam):
    """Chunked against whole-utterance search: same surviving hypotheses, scores and token timestamps (frames
    counted from each stream's start), with utterances of different lengths ending in different chunks."""
    model = kit.make_model(seed)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    want = modified_beam_search(model, enc, enc_lens, beam=beam, return_hypotheses=True)
    search = StreamingModifiedBeamSearch(model, len(LENS), beam=beam)
    partial = []
    for chunk, chunk_lens in _random_chunks(enc, enc_lens, seed):
        search.accept(chunk, chunk_lens)
        partial.append(search.best())
    assert sum(len(h.tokens) for b in want for h in b) > 10
    for got_b, want_b in zip(search.beams, want):
        assert {h.tokens: (round(h.log_prob, 9), h.timestamps) for h in got_b} == \
            {h.tokens: (round(h.log_prob, 9), h.timestamps) for h in want_b}
    assert partial[-1] == modified_beam_search(model, enc, enc_lens, beam=beam)
    assert len(set(map(str, partial))) > 1  # partial results grow as chunks arrive


def test_streaming_greedy_checks_its_input(kit):
    model = kit.make_model(0)
    search = StreamingGreedySearch(model, 2)
    with pytest.raises(ValueError, match="2 streams"):
        search.accept(torch.zeros(3, 4, 16), torch.tensor([4, 4, 4]))
    with pytest.raises(ValueError, match="encoder_out_lens must lie"):
        search.accept(torch.zeros(2, 4, 16), torch.tensor([5, 4]))
    with pytest.raises(ValueError, match="max_sym_per_frame"):
        StreamingGreedySearch(model, 2, max_sym_per_frame=0)


@pytest.fixture(scope="module")
def causal_model():
    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=12,
                             encoder_overrides={"causal": True}).eval()
    with torch.no_grad():  # a sharp joiner, so that the searches emit tokens
        model.joiner.output_linear.weight.mul_(30.0)
        model.joiner.encoder_proj.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("method", ["greedy_search", "modified_beam_search"])
def test_streaming_decode_matches_simulated_streaming(causal_model, method):
    g = torch.Generator().manual_seed(5)
    feats, lens = torch.randn(3, 230, 80, generator=g), torch.tensor([230, 170, 61])
    options = DecodingOptions(method=method, beam=3)
    got = streaming_decode(causal_model, feats, lens, options, 16, 64)
    configure_streaming(causal_model, 16, 64)
    enc, enc_lens = causal_model.encode(feats, lens)
    if method == "greedy_search":
        want = greedy_search(causal_model, enc, enc_lens)
    else:
        want = modified_beam_search(causal_model, enc, enc_lens, beam=3)
    assert sum(map(len, want)) > 5
    assert got == want
    chunks = []
    out, out_lens = streaming_encode(causal_model, feats, lens, 16, 64,
                                     on_chunk=lambda o, n: chunks.append((o.shape[1], n.tolist())))
    assert torch.equal(out_lens, enc_lens)
    assert [c[0] for c in chunks] == [8] * len(chunks)  # 16 frames at 50 Hz -> 8 at 25 Hz per chunk
    assert chunks[-1][1] == [int(enc_lens[0]) - 8 * (len(chunks) - 1), 0, 0]  # the short ones ended earlier


def test_streaming_encode_refuses_non_streaming_encoders(kit):
    with pytest.raises(ValueError, match="cannot stream"):
        streaming_encode(kit.make_model(0), torch.zeros(1, 20, 8), torch.tensor([20]), 16, 64)


def test_whole_chunks_only_runs_the_chunks_sherpa_onnx_runs(causal_model):
    """sherpa-onnx runs a chunk while more than 2C + lookahead frames are left past the processed ones and never
    the rest (k2-fsa/sherpa-onnx online-recognizer-transducer-impl.h): written here per utterance with a plain loop
    over streaming_forward, against the batched whole_chunks_only mode."""
    g = torch.Generator().manual_seed(6)
    lens = torch.tensor([230, 173, 109, 46])  # 109 - 45 = 64: exactly one step too few for a second chunk
    feats = torch.randn(4, 230, 80, generator=g)
    enc = causal_model.encoder
    t, step = 32 + enc.streaming_lookahead, 32
    out, out_lens = streaming_encode(causal_model, feats, lens, 16, 64, whole_chunks_only=True)
    for i, n in enumerate(lens.tolist()):
        states, pieces, start = enc.get_init_states(1, 16, 64), [], 0
        with torch.no_grad():
            while start + t < n:
                o, _, states = enc.streaming_forward(feats[i: i + 1, start: start + t], torch.tensor([t]), states)
                pieces.append(o[0])
                start += step
        assert int(out_lens[i]) == 8 * len(pieces)
        if pieces:
            torch.testing.assert_close(out[i, : int(out_lens[i])], torch.cat(pieces), rtol=1e-5, atol=1e-5)
    assert out_lens.tolist() == [8 * 6, 8 * 4, 8 * 2, 8 * 1]
