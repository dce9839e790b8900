"""The Kneser-Ney estimator: every history's distribution sums to one when read back through the ARPA reader's
back-off rule, and the discounted counts of a tiny corpus match a hand computation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asrprec.lm import estimate_kneser_ney, load_arpa, write_arpa

PIECES = ["<blk>", "<unk>", "a", "b", "c", "d"]


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_history_sums_to_one(tmp_path, order):
    rng = random.Random(order)
    sents = [[rng.choice("abcd") for _ in range(rng.randint(1, 7))] for _ in range(60)]
    lm = load_arpa(write_arpa(tmp_path / "lm.arpa", estimate_kneser_ney(sents, order)), PIECES)
    states = torch.arange(lm.num_states)
    lp, _ = lm.score_all(states)
    total = lp[:, 1:].exp().sum(dim=1) + lm.final(states).exp()  # tokens (<unk> once) and </s>
    assert torch.allclose(total, torch.ones_like(total), atol=1e-4)


def test_bigram_by_hand(tmp_path):
    """Corpus "a b", "a b", "a c": bigram counts from <s>: a 3; from a: b 2, c 1. One discount D = n1/(n1+2 n2) over
    the bigrams' counts {<s> a: 3, a b: 2, a c: 1, b </s>: 2, c </s>: 1}: n1 = 2, n2 = 2 → D = 1/3."""
    grams = estimate_kneser_ney([["a", "b"], ["a", "b"], ["a", "c"]], 2)
    D = 2 / (2 + 2 * 2)
    # unigram continuation counts: a 1 (<s>), b 1, c 1, </s> 2 (b, c); total 5; D1 from {1,1,1,2}: n1=3, n2=1 → 0.6
    D1 = 3 / (3 + 2)
    vocab = 5  # a b c </s> <unk>
    gamma0 = D1 * 4 / 5
    p_b = (1 - D1) / 5 + gamma0 / vocab
    gamma_a = D * 2 / 3
    want = (2 - D) / 3 + gamma_a * p_b
    assert 10 ** grams[1][("a", "b")][0] == pytest.approx(want, rel=1e-5)
    assert 10 ** grams[0][("a",)][1] == pytest.approx(gamma_a, rel=1e-5)  # a's back-off weight
    assert 10 ** grams[0][("<unk>",)][0] == pytest.approx(gamma0 / vocab, rel=1e-5)
