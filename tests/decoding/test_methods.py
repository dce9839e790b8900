"""The table of decoding methods: (method, head, streaming) → search, what each model may run, the refusals, and
the public API's two return types."""

from __future__ import annotations

import itertools

import pytest
import torch

from asrprec.decoding import (
    CTC_METHODS, HEADS, METHODS, DecodingOptions, Searcher, check_method, decode, greedy_search, model_heads,
    modified_beam_search, select_search, streaming_decode, supported_methods,
)
from asrprec.decoding.fusion import BatchFusion
from asrprec.decoding.methods import TABLE
from asrprec.models import build_transducer, configure_streaming

# what each head may run, written out by hand (whole utterances, chunk by chunk)
EXPECTED = {
    "rnnt": ({"greedy_search", "modified_beam_search", "malsd_batch"}, {"greedy_search", "modified_beam_search"}),
    "tdt": ({"greedy_search", "modified_beam_search", "malsd_batch"}, {"greedy_search"}),
    "ctc": ({"ctc_greedy_search", "ctc_prefix_beam_search"}, {"ctc_greedy_search", "ctc_prefix_beam_search"}),
}


def test_the_table_holds_what_each_head_can_run():
    for head, (offline, streaming) in EXPECTED.items():
        assert {m for (m, h, s) in TABLE if h == head and not s} == offline
        assert {m for (m, h, s) in TABLE if h == head and s} == streaming
    assert {h for (_, h, _) in TABLE} == set(HEADS)
    assert [k for k, e in TABLE.items() if not e.fusion and not k[2]] == [("ctc_greedy_search", "ctc", False)]


def _models():
    torch.manual_seed(0)
    kw = dict(encoder="zipformer", size="tiny", vocab_size=12)
    return {
        ("rnnt",): build_transducer(**kw).eval(),
        ("tdt",): build_transducer(**kw, loss={"loss": "tdt"}).eval(),
        ("ctc",): build_transducer(**kw, ctc={}, use_transducer=False).eval(),
        ("rnnt", "ctc"): build_transducer(**kw, ctc={}).eval(),
        ("tdt", "ctc"): build_transducer(**kw, ctc={}, loss={"loss": "tdt"}).eval(),
    }


def test_each_model_is_offered_its_heads_methods_and_refused_the_rest():
    for heads, model in _models().items():
        assert model_heads(model) == heads
        for streaming in (False, True):
            can = set().union(*(EXPECTED[h][streaming] for h in heads))
            assert set(supported_methods(model, streaming)) == can
            for method in METHODS:
                if method in can:
                    assert select_search(model, method, streaming).method == method
                    continue
                with pytest.raises(ValueError) as e:
                    check_method(model, method, streaming)
                msg = str(e.value)
                assert "\n" not in msg and method in msg
                # the refusal names every method the model can run (in this mode), and no other
                named = msg.rsplit("with ", 1)[1]
                assert set(named.split(" or ")) == can, msg


def test_refusals_give_the_reason():
    models = _models()
    with pytest.raises(ValueError, match="not implemented for TDT.*decode it chunk by chunk .* with greedy_search$"):
        check_method(models[("tdt",)], "modified_beam_search", streaming=True)
    with pytest.raises(ValueError, match="malsd_batch decodes whole utterances"):
        check_method(models[("rnnt",)], "malsd_batch", streaming=True)
    with pytest.raises(ValueError, match="CTC-only.*ctc_greedy_search or ctc_prefix_beam_search"):
        check_method(models[("ctc",)], "malsd_batch")
    with pytest.raises(ValueError, match="unknown decoding method 'beam'"):
        select_search(models[("rnnt",)], "beam")
    with pytest.raises(ValueError, match="greedy_method must be one of label_looping, frame_looping"):
        DecodingOptions(greedy_method="loop")
    hybrid = models[("rnnt", "ctc")]
    fusion = BatchFusion(lm=None, lm_scale=0.0, lodr=None, lodr_scale=0.0, global_trie=None, own_trie=None,
                         vocab_size=12)
    enc, lens = hybrid.encode(torch.randn(1, 40, 80), torch.tensor([40]))
    with pytest.raises(ValueError, match="ctc_greedy_search takes no language model.*fix: decode with "
                                         "ctc_prefix_beam_search$"):
        Searcher(hybrid, DecodingOptions(method="ctc_greedy_search"))(enc, lens, fusion)


def test_decode_returns_token_lists_by_default_and_results_on_request(kit):
    model = kit.make_model(2)
    feats, lens = kit.make_batch(2, [9, 4, 0])
    enc, enc_lens = model.encode(feats, lens)
    for method, want in (("greedy_search", greedy_search(model, enc, enc_lens, return_timestamps=True)),
                         ("modified_beam_search", None)):
        options = DecodingOptions(method=method, beam=2)
        tokens = decode(model, feats, lens, options)
        results = decode(model, feats, lens, options, return_timestamps=True)
        assert all(isinstance(t, list) for t in tokens) and tokens == [list(r.tokens) for r in results]
        if want is not None:  # greedy search's own (tokens, timestamps)
            assert ([list(r.tokens) for r in results], [list(r.frames) for r in results]) == want
        else:
            assert tokens == modified_beam_search(model, enc, enc_lens, beam=2)


@pytest.mark.parametrize("method", ["greedy_search", "modified_beam_search", "ctc_greedy_search",
                                    "ctc_prefix_beam_search"])
def test_streaming_results_equal_simulated_streaming(method):
    """Chunk by chunk with caches against whole utterances under the chunk mask: the same tokens and frames."""
    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={},
                             encoder_overrides={"causal": True}).eval()
    with torch.no_grad():  # sharp heads, so that the searches emit tokens
        model.joiner.output_linear.weight.mul_(30.0)
        model.joiner.encoder_proj.weight.mul_(4.0)
        # the CTC head reads the part of the encoder output that changes over time (a fresh encoder's output is mostly
        # a per-channel constant), blank a little favoured
        enc, _ = model.encode(torch.randn(2, 200, 80, generator=torch.Generator().manual_seed(3)),
                              torch.tensor([200, 200]))
        mean, std = enc.mean(dim=(0, 1)), enc.std(dim=(0, 1))
        lin = model.ctc_output[1]
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(4)) * 3.0
                         / enc.shape[-1] ** 0.5 / std)
        lin.bias.copy_(-lin.weight @ mean)
        lin.bias[0] += 2.0
    g = torch.Generator().manual_seed(5)
    feats, lens = torch.randn(3, 230, 80, generator=g), torch.tensor([230, 170, 61])
    options = DecodingOptions(method=method, beam=3)
    got = streaming_decode(model, feats, lens, options, 16, 64, return_timestamps=True)
    assert streaming_decode(model, feats, lens, options, 16, 64) == [list(r.tokens) for r in got]
    configure_streaming(model, 16, 64)
    want = decode(model, feats, lens, options, return_timestamps=True)
    assert sum(len(r.tokens) for r in want) > 5
    assert [(r.tokens, r.frames) for r in got] == [(r.tokens, r.frames) for r in want]
    enc_lens = model.encode(feats, lens)[1].tolist()
    assert all(r.frames == tuple(sorted(r.frames)) and all(0 <= f < n for f in r.frames)
               for r, n in zip(got, enc_lens))  # frames inside each utterance's encoder output


def test_every_combination_is_either_in_the_table_or_refused():
    models = _models()
    for (heads, model), method, streaming in itertools.product(models.items(), METHODS, (False, True)):
        head = "ctc" if method in CTC_METHODS else heads[0]
        in_table = (method, head, streaming) in TABLE and head in heads
        try:
            entry = select_search(model, method, streaming)
        except ValueError:
            assert not in_table
        else:
            assert in_table and (entry.method, entry.head, entry.streaming) == (method, head, streaming)


def test_decode_dataset_hands_over_each_batchs_results(kit):
    """``on_results`` receives every batch's DecodingResults, equal to a Searcher's on the same batch; label looping
    chosen by ``greedy_method`` (one instance over the loader) recognises what frame looping does."""
    from asrprec.decoding import decode_dataset

    class Words:
        def decode(self, ids):
            return " ".join(f"w{k}" for k in ids)

    model = kit.make_model(2, blank_bias=-1.0)
    loader = []
    for seed, lens in ((0, [5, 9, 2]), (1, [7, 0, 3])):
        feats, feat_lens = kit.make_batch(seed, lens)
        loader.append({"features": feats, "feature_lens": feat_lens, "texts": ["x"] * len(lens),
                       "cut_ids": [f"{seed}-{i}" for i in range(len(lens))]})
    for method in ("greedy_search", "malsd_batch"):
        seen = {}
        options = DecodingOptions(method=method, beam=2, max_sym_per_frame=2)
        got, _ = decode_dataset(model, loader, Words(), options, on_results=lambda ids, rs: seen.update(zip(ids, rs)))
        want = {}
        for b in loader:
            want.update(zip(b["cut_ids"], Searcher(model, options)(*model.encode(b["features"], b["feature_lens"]),
                                                                   return_timestamps=True)))
        # a fresh Searcher per batch: malsd_batch keeps decoder outputs across batches, so scores agree to fp32 rounding
        def parts(results):
            return {c: (r.tokens, r.frames, r.durations, r.score is None) for c, r in results.items()}

        assert parts(seen) == parts(want)
        scored = [c for c in want if want[c].score is not None]
        assert [seen[c].score for c in scored] == pytest.approx([want[c].score for c in scored], abs=1e-5)
        assert sum(len(r.tokens) for r in seen.values()) > 5
        assert [hyp for _, _, hyp in got] == [Words().decode(seen[c].tokens).split() for c, _, _ in got]
    looping, _ = decode_dataset(model, loader, Words(), DecodingOptions(max_sym_per_frame=2,
                                                                        greedy_method="label_looping"))
    framing, _ = decode_dataset(model, loader, Words(), DecodingOptions(max_sym_per_frame=2))
    assert looping == framing
