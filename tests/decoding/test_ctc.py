"""CTC decoding: greedy search against a per-utterance loop, prefix beam search against an exhaustive enumeration of
every alignment (float64), beam 1 against greedy search, chunked against whole-utterance search, and both on real
hybrid and CTC-only models (offline, streaming, and from an experiment folder as decode.py runs them)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from asrprec.decoding import (
    CTC_METHODS, METHODS, DecodingOptions, StreamingCtcGreedySearch, StreamingCtcPrefixBeamSearch, ctc_greedy_search,
    ctc_prefix_beam_search, decode, streaming_decode,
)
from asrprec.models import build_transducer, configure_streaming

LENS = [7, 0, 12, 3, 12, 1]


def _log_probs(seed: int, lens: list[int], V: int = 6, scale: float = 3.0, blank_bias: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(lens), max(lens, default=0), V, generator=g) * scale
    logits[..., 0] += blank_bias
    return logits.log_softmax(dim=-1)


def naive_greedy(lp: torch.Tensor, blank: int = 0) -> tuple[list[int], list[int]]:
    """One utterance (T, V): walk the frames, emit a token when it is not blank and differs from the previous
    frame's; returns (tokens, frame of each token)."""
    tokens, frames, prev = [], [], None
    for t in range(lp.shape[0]):
        k = max(range(lp.shape[1]), key=lambda v: float(lp[t, v]))
        if k != blank and k != prev:
            tokens.append(k)
            frames.append(t)
        prev = k
    return tokens, frames


def collapse(path: tuple[int, ...], blank: int = 0) -> tuple[int, ...]:
    out, prev = [], None
    for k in path:
        if k != blank and k != prev:
            out.append(k)
        prev = k
    return tuple(out)


def all_label_sequences(lp: torch.Tensor, blank: int = 0) -> dict[tuple[int, ...], float]:
    """Brute force: every one of the V^T alignments of one utterance (T, V), its float64 log-probability, summed per
    label sequence it collapses to."""
    lp = lp.double()
    out: dict[tuple[int, ...], float] = {}
    for path in itertools.product(range(lp.shape[1]), repeat=lp.shape[0]):
        score = sum(float(lp[t, k]) for t, k in enumerate(path))
        key = collapse(path, blank)
        out[key] = score if key not in out else max(out[key], score) + math.log1p(math.exp(-abs(out[key] - score)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("blank", [0, 3])
def test_greedy_matches_per_utterance_loop(seed, blank):
    lp = _log_probs(seed, LENS)
    lens = torch.tensor(LENS)
    tokens, stamps = ctc_greedy_search(lp, lens, blank_id=blank, return_timestamps=True)
    want = [naive_greedy(lp[i, :n], blank) for i, n in enumerate(LENS)]
    assert tokens == [w[0] for w in want] and stamps == [w[1] for w in want]
    assert sum(map(len, tokens)) > 10
    # logits give the argmax of their log-softmax; a bf16 copy decodes too
    assert ctc_greedy_search(lp * 2.0 + 5.0, lens, blank_id=blank) == tokens
    assert len(ctc_greedy_search(lp.bfloat16(), lens, blank_id=blank)) == len(LENS)


def test_greedy_collapses_runs_but_not_runs_split_by_blank():
    lp = torch.full((1, 7, 3), -10.0)
    for t, k in enumerate([1, 1, 0, 1, 2, 2, 1]):
        lp[0, t, k] = 0.0
    assert ctc_greedy_search(lp, torch.tensor([7]), return_timestamps=True) == ([[1, 1, 2, 1]], [[0, 3, 4, 6]])
    assert ctc_greedy_search(lp, torch.tensor([2])) == [[1]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_prefix_beam_1_equals_greedy(seed, scale):
    lp = _log_probs(seed, LENS, scale=scale)
    lens = torch.tensor(LENS)
    assert ctc_prefix_beam_search(lp, lens, beam=1) == ctc_greedy_search(lp, lens)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("V,T", [(3, 5), (4, 4)])
def test_unpruned_prefix_beam_search_equals_exhaustive_enumeration(seed, V, T):
    """With beam >= V and >= the number of label sequences (at most 121 here) nothing is pruned: every sequence's
    score is its probability summed over all alignments (enumerated one by one), and the best is the true maximum."""
    lens = [T, T - 2, 1]
    lp = _log_probs(seed, lens, V=V, scale=1.5, blank_bias=0.0)
    hyps = ctc_prefix_beam_search(lp, torch.tensor(lens), beam=130, return_hypotheses=True)
    best = ctc_prefix_beam_search(lp, torch.tensor(lens), beam=130)
    for i, n in enumerate(lens):
        want = all_label_sequences(lp[i, :n])
        got = {h.tokens: h.log_prob for h in hyps[i]}
        assert set(got) == set(want)
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=1e-9)
        # the sequences share all the probability (up to the float32 normalisation of the inputs)
        assert math.log(sum(math.exp(v) for v in got.values())) == pytest.approx(0.0, abs=1e-6)
        assert tuple(best[i]) == max(want, key=want.get)
        assert hyps[i].get_most_probable().log_prob == pytest.approx(max(want.values()), abs=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_pruned_prefix_beam_search_scores_are_bounded_by_the_truth(seed):
    """A pruned search loses alignments, never invents them: every surviving score is at most the sequence's true
    probability (summed over all its alignments), and some lose mass to the pruning on these cases."""
    lens = [5, 4]
    lp = _log_probs(seed, lens, V=4, scale=2.0, blank_bias=0.5)
    hyps = ctc_prefix_beam_search(lp, torch.tensor(lens), beam=2, return_hypotheses=True)
    gaps = []
    for i, n in enumerate(lens):
        want = all_label_sequences(lp[i, :n])
        assert 1 <= len(hyps[i]) <= 2
        for h in hyps[i]:
            assert h.log_prob <= want[h.tokens] + 1e-9
            gaps.append(want[h.tokens] - h.log_prob)
    assert max(gaps) > 1e-3


def test_prefix_beam_search_prefers_the_sequence_with_more_alignments():
    """Two frames of P(blank)=0.6, P(a)=0.4: greedy says "" (0.36), but "a" has three alignments (aa, a-, -a) worth
    0.64; a beam of 2 finds it, with that exact probability."""
    lp = torch.tensor([[[0.6, 0.4], [0.6, 0.4]]], dtype=torch.float64).log()
    assert ctc_greedy_search(lp, torch.tensor([2])) == [[]]
    hyps = ctc_prefix_beam_search(lp, torch.tensor([2]), beam=2, return_hypotheses=True)[0]
    assert {h.tokens: round(math.exp(h.log_prob), 12) for h in hyps} == {(1,): 0.64, (): 0.36}
    assert ctc_prefix_beam_search(lp, torch.tensor([2]), beam=2) == [[1]]


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_equals_one_utterance_at_a_time(beam):
    lp = _log_probs(5, LENS)
    batched = ctc_prefix_beam_search(lp, torch.tensor(LENS), beam=beam, return_hypotheses=True)
    for i, n in enumerate(LENS):
        alone = ctc_prefix_beam_search(lp[i: i + 1, :n], torch.tensor([n]), beam=beam, return_hypotheses=True)[0]
        assert {h.tokens: (round(h.log_prob, 9), h.timestamps) for h in batched[i]} == \
            {h.tokens: (round(h.log_prob, 9), h.timestamps) for h in alone}


def _random_chunks(lp, lens, seed):
    g = torch.Generator().manual_seed(seed)
    start = 0
    while start < lp.shape[1]:
        n = int(torch.randint(1, 5, (1,), generator=g))
        yield lp[:, start: start + n], (lens - start).clamp(min=0, max=n)
        start += n


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_searches_equal_whole_utterance_searches(seed):
    """Chunks of 1-4 frames, utterances ending in different chunks: the same tokens, timestamps (frames from each
    stream's start) and, for prefix beam search, the same surviving hypotheses and scores."""
    lp = _log_probs(seed, LENS, scale=1.5)
    lens = torch.tensor(LENS)
    greedy = StreamingCtcGreedySearch(len(LENS))
    beam = StreamingCtcPrefixBeamSearch(len(LENS), beam=3)
    for chunk, chunk_lens in _random_chunks(lp, lens, seed):
        greedy.accept(chunk, chunk_lens)
        beam.accept(chunk, chunk_lens)
    assert (greedy.hyps, greedy.timestamps) == ctc_greedy_search(lp, lens, return_timestamps=True)
    want = ctc_prefix_beam_search(lp, lens, beam=3, return_hypotheses=True)
    for got_b, want_b in zip(beam.hypotheses(), want):
        assert {h.tokens: (round(h.log_prob, 9), h.timestamps) for h in got_b} == \
            {h.tokens: (round(h.log_prob, 9), h.timestamps) for h in want_b}
    assert sum(len(h.tokens) for b in want for h in b) > 10


def test_input_errors_name_the_problem():
    lp = _log_probs(0, [3, 2])
    with pytest.raises(ValueError, match=r"log_probs must be \(B, T, V\)"):
        ctc_greedy_search(lp[0], torch.tensor([3]))
    with pytest.raises(ValueError, match="log_probs_lens must lie in"):
        ctc_prefix_beam_search(lp, torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="integer tensor"):
        ctc_greedy_search(lp, torch.tensor([3.0, 2.0]))
    with pytest.raises(ValueError, match="beam must be an integer >= 1"):
        ctc_prefix_beam_search(lp, torch.tensor([3, 2]), beam=0)
    with pytest.raises(ValueError, match="blank_id 6 is not a token"):
        ctc_greedy_search(lp, torch.tensor([3, 2]), blank_id=6)
    with pytest.raises(ValueError, match="2 streams"):
        StreamingCtcGreedySearch(2).accept(_log_probs(0, [3, 3, 3]), torch.tensor([3, 3, 3]))
    assert ctc_greedy_search(lp[:0], torch.tensor([], dtype=torch.int64)) == []


def _sharpen_ctc(model: torch.nn.Module) -> torch.nn.Module:
    """A decisive CTC head reading the part of the encoder output that changes over time (a fresh encoder's output
    is mostly a per-channel constant): random weights scaled by the centred output's spread, the mean removed by the
    bias, blank a little favoured, so that the searches emit varied tokens."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        enc, _ = model.eval().encode(torch.randn(2, 200, 80, generator=g), torch.tensor([200, 200]))
        mean = enc.mean(dim=(0, 1))
        std = (enc - mean).std(dim=(0, 1))
        lin = model.ctc_output[1]
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 3.0 / enc.shape[-1] ** 0.5 / std)
        lin.bias.copy_(-(lin.weight @ mean))
        lin.bias[model.blank_id] += 1.0
    return model


def _reference_ctc_greedy(model, features, feature_lens):
    """The CTC head applied by hand in float64 (its Linear, then log-softmax) and a per-utterance loop."""
    with torch.no_grad():
        enc, enc_lens = model.encode(features, feature_lens)
        lin = model.ctc_output[1]
        lp = torch.nn.functional.linear(enc.double(), lin.weight.double(), lin.bias.double()).log_softmax(-1)
    return [naive_greedy(lp[i, :n], model.blank_id)[0] for i, n in enumerate(enc_lens.tolist())]


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    return _sharpen_ctc(build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={}))


def test_hybrid_decodes_with_every_method(hybrid):
    g = torch.Generator().manual_seed(1)
    feats, lens = torch.randn(3, 90, 80, generator=g), torch.tensor([90, 61, 30])
    want = _reference_ctc_greedy(hybrid, feats, lens)
    assert sum(map(len, want)) > 5
    got = {m: decode(hybrid, feats, lens, DecodingOptions(method=m, beam=1)) for m in METHODS}
    assert set(got) >= {"greedy_search", "modified_beam_search", *CTC_METHODS}
    assert got["ctc_greedy_search"] == want
    assert got["ctc_prefix_beam_search"] == want  # beam 1
    assert got["modified_beam_search"] == got["greedy_search"]  # beam 1 (the transducer head's own check)
    assert got["malsd_batch"] == got["greedy_search"]  # beam 1
    assert all(len(h) == 3 for h in got.values())


def test_ctc_only_model_refuses_transducer_methods():
    torch.manual_seed(0)
    model = _sharpen_ctc(build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={},
                                          use_transducer=False))
    feats, lens = torch.randn(2, 60, 80), torch.tensor([60, 40])
    assert decode(model, feats, lens, DecodingOptions(method="ctc_greedy_search")) == \
        _reference_ctc_greedy(model, feats, lens)
    for method in ("greedy_search", "modified_beam_search"):
        with pytest.raises(ValueError, match="CTC-only.*ctc_greedy_search or ctc_prefix_beam_search"):
            decode(model, feats, lens, DecodingOptions(method=method))
    plain = build_transducer(encoder="zipformer", size="tiny", vocab_size=12).eval()
    with pytest.raises(ValueError, match="has none.*--use-ctc.*greedy_search or modified_beam_search"):
        decode(plain, feats, lens, DecodingOptions(method="ctc_prefix_beam_search"))


@pytest.mark.parametrize("use_transducer", [True, False])
@pytest.mark.parametrize("method", CTC_METHODS)
def test_streaming_ctc_equals_simulated_streaming(use_transducer, method):
    """Chunk by chunk with the encoder's caches against the offline search over the same model configured for the
    same chunk size and left context (simulated streaming): the two encoders agree up to float rounding (the known
    chunking difference is between chunked and full-context encoding, not between these two), so the tokens agree."""
    torch.manual_seed(0)
    model = _sharpen_ctc(build_transducer(encoder="zipformer", size="tiny", vocab_size=12, ctc={},
                                          use_transducer=use_transducer, encoder_overrides={"causal": True}))
    g = torch.Generator().manual_seed(5)
    feats, lens = torch.randn(3, 230, 80, generator=g), torch.tensor([230, 170, 61])
    options = DecodingOptions(method=method, beam=3)
    got = streaming_decode(model, feats, lens, options, 16, 64)
    configure_streaming(model, 16, 64)
    want = decode(model, feats, lens, options)
    assert sum(map(len, want)) > 5
    assert got == want


class _Cuts(list):
    def to_eager(self):
        return self


def test_hybrid_checkpoint_decodes_every_method_from_its_folder(tmp_path, hybrid):
    """As decode.py: model.json + epoch-1.pt, each method's recogs, errs and WER summary; a CTC-only folder refuses a
    transducer method before loading weights."""
    from asrprec.checkpoint import TrainingObjects, save_checkpoint
    from asrprec.decoding.experiment import decode_splits, load_for_decoding
    from asrprec.metrics import read_recogs
    from asrprec.decoding.experiment import decoding_command_line
    from asrprec.experiment import ExperimentError

    (tmp_path / "model.json").write_text(json.dumps({"encoder": "zipformer", "size": "tiny", "vocab_size": 12,
                                                     "ctc": {}}))
    save_checkpoint(tmp_path / "epoch-1.pt", TrainingObjects(model=hybrid), extra={"epoch": 1})
    g = torch.Generator().manual_seed(2)
    feats, lens = torch.randn(2, 80, 80, generator=g), torch.tensor([80, 55])
    batch = {"features": feats, "feature_lens": lens, "texts": ["a b", "c"], "cut_ids": ["u0", "u1"]}

    class Words:  # each token a word
        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

        def id_to_piece(self, i):
            return f"\u2581w{i}"

    cl = decoding_command_line()
    for method in METHODS:
        args = cl.parse(["--epoch", "1", "--decoding-method", method, "--validate-data", "off", "--device", "cpu"])
        cfg = args.decode
        setup = load_for_decoding(tmp_path, cfg, args.precision)
        summary = decode_splits(setup, {"test": _Cuts()}, lambda cuts: [batch], Words(), cfg, tmp_path)
        assert summary["test"]["decoded"] == 2
        assert (tmp_path / f"recogs-test-{setup.tag}.txt").is_file()
        assert (tmp_path / f"errs-test-{setup.tag}.txt").is_file()
        assert (tmp_path / f"wer-summary-{setup.tag}.json").is_file()
        hyps = {cut: hyp for cut, (_, hyp) in read_recogs(tmp_path / f"recogs-test-{setup.tag}.txt").items()}
        ctm = (tmp_path / f"ctm-test-{setup.tag}.txt").read_text().split("\n")
        assert sorted(line.split()[-1] for line in ctm if line) == sorted(w for h in hyps.values() for w in h)
        assert setup.tag.startswith(method)
    assert "beam-4" in (tmp_path / "wer-summary-ctc_prefix_beam_search-epoch-1-avg-1-fp32-beam-4.json").name
    recogs = read_recogs(tmp_path / "recogs-test-ctc_greedy_search-epoch-1-avg-1-fp32.txt")
    want = _reference_ctc_greedy(hybrid, feats, lens)
    assert [recogs[c][1] for c in ("u0", "u1")] == [[f"w{i}" for i in w] for w in want]

    ctc_dir = tmp_path / "ctc"
    ctc_dir.mkdir()
    (ctc_dir / "model.json").write_text(json.dumps({"encoder": "zipformer", "size": "tiny", "vocab_size": 12,
                                                    "ctc": {}, "use_transducer": False}))
    args = cl.parse(["--epoch", "1", "--decoding-method", "greedy_search", "--device", "cpu"])
    with pytest.raises(ExperimentError, match="CTC-only.*ctc_greedy_search or ctc_prefix_beam_search"):
        load_for_decoding(ctc_dir, args.decode, args.precision)  # no epoch-1.pt
        # there: the method is checked first


@pytest.mark.parametrize("policy", ["amp-bf16", "bf16"])
def test_ctc_methods_under_reduced_precision(hybrid, policy):
    """Under autocast or a bf16-cast model the CTC head's log-probabilities stay fp32 (the model's fp32 island), both
    methods run, and each frame's choice is the fp32 model's best or close to it (its float64 log-probabilities).
    "Close" is loose: this test head reads the encoder's small time-varying part scaled up ~15x, so bf16's three
    digits of the encoder output become tenths of a nat here, and whole sequences may differ."""
    import copy

    from asrprec.precision import get_policy

    pol = get_policy(policy, "cpu")
    model = pol.prepare_for_inference(copy.deepcopy(hybrid))
    g = torch.Generator().manual_seed(4)
    feats, lens = torch.randn(2, 90, 80, generator=g), torch.tensor([90, 50])
    with pol.autocast(), torch.no_grad():
        enc, enc_lens = model.encode(feats, lens)
        lp = model.ctc_log_probs(enc)
        assert lp.dtype == torch.float32
        for method in CTC_METHODS:
            assert len(decode(model, feats, lens, DecodingOptions(method=method))) == 2
    with torch.no_grad():
        ref_enc, ref_lens = hybrid.encode(feats, lens)
        lin = hybrid.ctc_output[1]
        ref = torch.nn.functional.linear(ref_enc.double(), lin.weight.double(), lin.bias.double()).log_softmax(-1)
    assert torch.equal(enc_lens, ref_lens)
    chosen = ref.gather(2, lp.argmax(dim=-1, keepdim=True))[..., 0]  # (B, T') fp64 log-prob of each bf16 choice
    for i, n in enumerate(ref_lens.tolist()):
        gap = ref[i, :n].max(dim=-1).values - chosen[i, :n]
        assert float(gap.max()) < 1.0 and float((gap == 0).double().mean()) > 0.6
    assert sum(map(len, ctc_greedy_search(lp, enc_lens))) > 5
