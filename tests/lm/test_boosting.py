"""The phrase-boosting trie: hand-made cases (a phrase gets its bonus, an abandoned prefix gives it back, overlapping
phrases through failure arcs, per-utterance sets) and random cases against a brute-force count of phrase occurrences."""

from __future__ import annotations

import random

import pytest
import torch

from asrprec.lm import BoostingTrie

V = 10


def bonuses(trie: BoostingTrie, seq: list[int], root: int = 0) -> tuple[list[float], float]:
    """Per-token bonuses along ``seq`` from set ``root``'s start, and what the end gives back."""
    s = trie.roots[root : root + 1]
    out = []
    for t in seq:
        b, s = trie.score(s, torch.tensor([t]))
        out.append(float(b))
    return out, float(trie.final(s))


def test_a_phrase_in_the_path_gets_its_bonus():
    trie = BoostingTrie([[[2, 3, 4]]], 1.5, V)
    got, back = bonuses(trie, [7, 2, 3, 4, 5])
    assert got == [0.0, 1.5, 1.5, 1.5, 0.0] and back == 0.0


def test_an_abandoned_prefix_gives_its_bonus_back():
    trie = BoostingTrie([[[2, 3, 4]]], 1.0, V)
    got, back = bonuses(trie, [2, 3, 5])
    assert got == [1.0, 1.0, -2.0] and back == 0.0
    got, back = bonuses(trie, [2, 3])  # the utterance ends inside the phrase
    assert got == [1.0, 1.0] and back == -2.0
    got, _ = bonuses(trie, [2, 2, 3, 4])  # "2" restarts the match through the failure arc: 1 - 1 + 1 = net 1, then 3
    assert got == [1.0, 0.0, 1.0, 1.0] and sum(got) == 3.0


def test_overlapping_phrases_through_failure_arcs():
    trie = BoostingTrie([[[2, 3], [3, 4]]], 1.0, V)
    got, back = bonuses(trie, [2, 3, 4])  # "2 3" complete, its failure arc to "3" lets "3 4" complete too
    assert got == [1.0, 1.0, 2.0] and back == 0.0
    # a phrase inside a longer one: "3 4" completes within "2 3 4 5" and keeps its bonus when the longer one fails
    trie = BoostingTrie([[[2, 3, 4, 5], [3, 4]]], 1.0, V)
    got, back = bonuses(trie, [2, 3, 4, 6])
    assert got == [1.0, 1.0, 3.0, -3.0] and sum(got) == 2.0 and back == 0.0
    got, _ = bonuses(trie, [2, 3, 4, 5])
    assert sum(got) == 6.0  # both phrases


def test_blank_changes_nothing_and_sets_are_separate():
    trie = BoostingTrie([[[2, 3]], [[4, 5]]], 1.0, V)
    got, _ = bonuses(trie, [2, 0, 3], root=0)
    assert got == [1.0, 0.0, 1.0]
    got, back = bonuses(trie, [2, 3, 4], root=1)  # set 1 knows only "4 5"
    assert got == [0.0, 0.0, 1.0] and back == -1.0


def brute_force_total(phrases: list[tuple[int, ...]], seq: list[int], lam: float) -> float:
    """Σ over phrase occurrences of λ·len, plus λ·len of the longest suffix that is a proper phrase prefix and no
    phrase (the pending match), minus nothing: the module's definition, counted directly."""
    total = 0.0
    for p in set(phrases):
        for end in range(len(p), len(seq) + 1):
            if tuple(seq[end - len(p) : end]) == p:
                total += lam * len(p)
    prefixes = {p[:i] for p in phrases for i in range(1, len(p) + 1)}
    for k in range(len(seq), 0, -1):
        suffix = tuple(seq[len(seq) - k :])
        if suffix in prefixes:
            if suffix not in phrases:
                total += lam * k
            break
    return total


@pytest.mark.parametrize("seed", range(5))
def test_random_phrases_against_brute_force(seed):
    rng = random.Random(seed)
    phrases = [tuple(rng.choice([2, 3, 4]) for _ in range(rng.randint(1, 4))) for _ in range(4)]
    trie = BoostingTrie([phrases], 0.5, V)
    seqs = [[rng.choice([2, 3, 4, 5]) for _ in range(rng.randint(1, 12))] for _ in range(20)]
    for seq in seqs:
        got, back = bonuses(trie, seq)
        assert sum(got) == pytest.approx(brute_force_total(phrases, seq, 0.5), abs=1e-5), (phrases, seq)
    # batched: every prefix state scored against every token at once equals the one-by-one walk
    s = trie.roots[:1]
    states = [s]
    for t in seqs[0]:
        s = trie.score(s, torch.tensor([t]))[1]
        states.append(s)
    states = torch.cat(states)
    all_b, all_next = trie.score_all(states)
    for i in range(states.numel()):
        for t in range(1, V):
            b, n = trie.score(states[i : i + 1], torch.tensor([t]))
            assert float(all_b[i, t]) == pytest.approx(float(b)) and int(all_next[i, t]) == int(n)
