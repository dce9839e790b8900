"""modified_beam_search: against exhaustive enumeration, against greedy, batching and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from asrprec.decoding import Hypothesis, HypothesisList, greedy_search, modified_beam_search

LENS = [7, 0, 12, 3, 12, 1]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("context_size", [1, 2])
def test_beam_1_equals_greedy(kit, seed, context_size):
    model = kit.make_model(seed, context_size=context_size, blank_bias=float(seed % 3))
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    assert modified_beam_search(model, enc, enc_lens, beam=1) == greedy_search(model, enc, enc_lens)


@pytest.mark.parametrize("seed", [0, 1])
def test_exhaustive_beam_equals_brute_force(kit, seed):
    """With a beam wider than the number of label sequences nothing is pruned, so every sequence's score must
    equal its probability summed over all V^T one-symbol-per-frame paths (enumerated one by one)."""
    model = kit.make_model(seed, vocab=3, logit_scale=2.0)
    lens = [4, 3]
    feats, feat_lens = kit.make_batch(seed, lens)
    enc, enc_lens = model.encode(feats, feat_lens)
    hyp_lists = modified_beam_search(model, enc, enc_lens, beam=64, return_hypotheses=True)
    for i, n in enumerate(lens):
        want = kit.all_sequence_log_probs(model, enc[i, :n])
        got = {h.tokens: h.log_prob for h in hyp_lists[i]}
        assert set(got) == set(want)
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=2e-5)
        assert math.log(sum(math.exp(v) for v in got.values())) == pytest.approx(0.0, abs=1e-5)
        # final choices: raw and icefall's length-normalised score (denominator counts the 2 context slots)
        C = model.decoder.context_size
        best_raw = max(want, key=want.get)
        best_norm = max(want, key=lambda k: want[k] / (C + len(k)))
        one = (enc[i : i + 1, :n], enc_lens[i : i + 1])
        assert modified_beam_search(model, *one, beam=64, length_norm=False)[0] == list(best_raw)
        assert modified_beam_search(model, *one, beam=64, length_norm=True)[0] == list(best_norm)


@pytest.mark.parametrize("seed", range(6))
def test_beam_score_not_worse_than_greedy(kit, seed):
    """The best beam hypothesis scores at least the greedy path (scores recomputed independently in float64).

    Not a theorem for a finite beam (the greedy prefix can be pruned), but it holds on these seeds; the exhaustive
    test above covers the exact case."""
    model = kit.make_model(seed, blank_bias=1.0)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    hyp_lists = modified_beam_search(model, enc, enc_lens, beam=4, return_hypotheses=True)
    for i, n in enumerate(LENS):
        _, greedy_score = kit.naive_greedy(model, enc[i, :n])
        best = hyp_lists[i].get_most_probable(length_norm=False)
        assert best.log_prob >= greedy_score - 1e-5
        # a beam score sums a subset of the sequence's alignments: never more than the full sum
        assert best.log_prob <= kit.sequence_log_prob(model, enc[i, :n], list(best.tokens)) + 1e-5
        for h in hyp_lists[i]:
            assert len(h.timestamps) == len(h.tokens) and list(h.timestamps) == sorted(set(h.timestamps))


@pytest.mark.parametrize("beam", [2, 4])
def test_batched_equals_one_by_one(kit, beam):
    model = kit.make_model(7, blank_bias=1.0)
    lens = [4, 9, 2, 9, 6, 0]
    feats, feat_lens = kit.make_batch(7, lens)
    enc, enc_lens = model.encode(feats, feat_lens)
    batched = modified_beam_search(model, enc, enc_lens, beam=beam, return_hypotheses=True)
    for i, n in enumerate(lens):
        one = (enc[i : i + 1, :n], enc_lens[i : i + 1])
        single = modified_beam_search(model, *one, beam=beam, return_hypotheses=True)[0]
        assert {h.tokens for h in single} == {h.tokens for h in batched[i]}
        for h in single:
            assert batched[i][h.tokens].log_prob == pytest.approx(h.log_prob, abs=1e-5)


def test_empty_inputs_and_wide_beam(kit):
    model = kit.make_model(0, vocab=3)
    D = model.encoder.output_dim
    assert modified_beam_search(model, torch.zeros(0, 0, D), torch.zeros(0, dtype=torch.int64)) == []
    assert modified_beam_search(model, torch.zeros(2, 0, D), torch.zeros(2, dtype=torch.int64)) == [[], []]
    out = modified_beam_search(model, torch.randn(2, 3, D), torch.tensor([0, 3]), beam=50)  # beam > V and > #seqs
    assert out[0] == [] and all(0 < k < 3 for k in out[1])
    with pytest.raises(ValueError, match="beam"):
        modified_beam_search(model, torch.randn(1, 3, D), torch.tensor([3]), beam=0)


def test_hypothesis_list_merges_by_log_add(kit):
    hl = HypothesisList()
    hl.add(Hypothesis((1, 2), math.log(0.1), (0, 1)))
    hl.add(Hypothesis((1, 2), math.log(0.3), (0, 2)))
    hl.add(Hypothesis((3,), math.log(0.35), (1,)))
    assert len(hl) == 2
    assert hl[(1, 2)].log_prob == pytest.approx(math.log(0.4))
    assert hl[(1, 2)].timestamps == (0, 1)
    # hand-computed: (1,2) log 0.4 = -0.916, (3,) log 0.35 = -1.050
    assert hl.get_most_probable().tokens == (1, 2)
    # length-normalised, context 2: -0.916/4 = -0.229 beats -1.050/3 = -0.350
    assert hl.get_most_probable(length_norm=True, context_size=2).tokens == (1, 2)
    hl.add(Hypothesis((), math.log(0.5)))
    # raw: () at -0.693 beats (1,2) at -0.916; normalised: -0.693/2 = -0.347 loses to -0.229
    assert hl.get_most_probable().tokens == ()
    assert hl.get_most_probable(length_norm=True, context_size=2).tokens == (1, 2)
    assert [h.tokens for h in hl.sorted()] == [(), (1, 2), (3,)]
