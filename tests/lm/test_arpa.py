"""ARPA reading: back-off probabilities of a hand-written 3-gram against values computed by hand (log10 → natural log
as KenLM's numbers are converted), and malformed files rejected with one error naming the file and line."""

from __future__ import annotations

import math

import pytest
import torch

from asrprec.lm import ArpaError, load_arpa

LN10 = math.log(10.0)
PIECES = ["<blk>", "<unk>", "a", "b", "c", "d"]  # "d" is a model token the file does not list: scored as <unk>
A, B, C, D = 2, 3, 4, 5

ARPA = """\\data\\
ngram 1=6
ngram 2=4
ngram 3=2

\\1-grams:
-1.0\t</s>
-99\t<s>\t-0.5
-2.0\t<unk>
-0.5\ta\t-0.3
-0.7\tb\t-0.2
-0.9\tc

\\2-grams:
-0.2\t<s> a\t-0.1
-0.4\ta b\t-0.25
-0.3\tb c
-0.6\ta </s>

\\3-grams:
-0.1\t<s> a b
-0.05\ta b c

\\end\\
"""


@pytest.fixture
def lm(tmp_path):
    path = tmp_path / "lm.arpa"
    path.write_text(ARPA)
    return load_arpa(path, PIECES)


def test_sentence_probabilities_follow_back_off_by_hand(lm):
    # <s> a b c a c </s>: p(a|<s>) -0.2; p(b|<s> a) -0.1 (3-gram); p(c|a b) -0.05; p(a|b c) = bo(b c)=0 + bo(c)=0 +
    # p(a) -0.5; p(c|a) = bo(a) -0.3 + p(c) -0.9; p(</s>|c) = bo(c) 0 + p(</s>) -1.0
    want = (-0.2 - 0.1 - 0.05 - 0.5 - 1.2 - 1.0) * LN10
    assert lm.sentence_logprob([A, B, C, A, C]) == pytest.approx(want, abs=1e-5)
    # <s> a c: p(c|<s> a) = bo(<s> a) -0.1 + bo(a) -0.3 + p(c) -0.9; no </s>
    assert lm.sentence_logprob([A, C], eos=False) == pytest.approx(-(0.2 + 1.3) * LN10, abs=1e-5)
    # <s> a b b: p(b|a b) = bo(a b) -0.25 + (p(b|b) = bo(b) -0.2 + p(b) -0.7)
    assert lm.sentence_logprob([A, B, B], eos=False) == pytest.approx((-0.2 - 0.1 - 1.15) * LN10, abs=1e-5)


def test_batched_lookup_with_back_off_by_hand(lm):
    """Every (history, token) pair at once, each against the hand-computed value."""
    cases = [  # (history tokens, next token, log10 probability by hand)
        ([], A, -0.2), ([A], B, -0.1), ([A], C, -0.1 - 0.3 - 0.9), ([A, B], C, -0.05),
        ([A, B], B, -0.25 - 0.2 - 0.7), ([A, B, C], A, -0.5), ([B], B, -0.2 - 0.7),  # after <s> b (unlisted) the state is b: bo(b) + p(b)
        ([A], D, -0.1 - 0.3 - 2.0), ([A], 1, -0.1 - 0.3 - 2.0),  # an unlisted token and <unk> itself: p(<unk>)
        ([C], A, -0.5),
    ]
    states = []
    for hist, _, _ in cases:
        s = lm.start(1)
        for t in hist:
            s = lm.score(s, torch.tensor([t]))[1]
        states.append(s)
    logp, _ = lm.score(torch.cat(states), torch.tensor([tok for _, tok, _ in cases]))
    want = torch.tensor([v for _, _, v in cases]) * LN10
    assert torch.allclose(logp, want, atol=1e-5)
    # every token of a state at once, the blank scoring 0 and keeping the state
    all_lp, all_next = lm.score_all(torch.cat(states[:2]))
    assert all_lp.shape == (2, len(PIECES)) and torch.all(all_lp[:, 0] == 0)
    assert torch.equal(all_next[:, 0], torch.cat(states[:2]))
    assert all_lp[1, C] == pytest.approx((-0.1 - 0.3 - 0.9) * LN10, abs=1e-5)


def test_end_of_sentence_by_hand(lm):
    s = lm.start(1)
    for t in (A, B):
        s = lm.score(s, torch.tensor([t]))[1]
    assert float(lm.final(s)) == pytest.approx((-0.25 - 0.2 - 1.0) * LN10, abs=1e-5)
    s = lm.score(lm.start(1), torch.tensor([A]))[1]
    # "<s> a </s>" unlisted: bo(<s> a) -0.1 + p(</s>|a) -0.6 (listed)
    assert float(lm.final(s)) == pytest.approx(-0.7 * LN10, abs=1e-5)


def _write(tmp_path, text, name="bad.arpa"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t[: t.index("\\3-grams:")], r"bad\.arpa:\d+: .*truncated"),
    (lambda t: t.replace("ngram 2=4", "ngram 2=5"), r"bad\.arpa:\d+: the \\2-grams: section has 4 entries but the "
                                                    r"header says 5"),
    (lambda t: t.replace("\\2-grams:", "\\9-grams:"), r"bad\.arpa:\d+: section \\9-grams: out of order"),
    (lambda t: t.replace("-0.3\tb c", "-0.3\tb c extra words"), r"bad\.arpa:\d+: a 2-gram line needs"),
    (lambda t: t.replace("-0.3\tb c", "x\tb c"), r"bad\.arpa:\d+: not a number"),
    (lambda t: t.replace("\\data\\", ""), r"bad\.arpa:\d+: no \\data\\ header"),
])
def test_malformed_files_name_file_and_line(tmp_path, mutate, match):
    with pytest.raises(ArpaError, match=match):
        load_arpa(_write(tmp_path, mutate(ARPA)), PIECES)


def test_word_outside_the_vocabulary_names_its_line(tmp_path):
    text = ARPA.replace("-0.9\tc\n", "-0.9\tc\n-1.5\tzz\n").replace("ngram 1=6", "ngram 1=7")
    path = _write(tmp_path, text)
    line = text.splitlines().index("-1.5\tzz") + 1
    with pytest.raises(ArpaError, match=rf"bad\.arpa:{line}: the word 'zz' is not a token of the model's vocabulary"):
        load_arpa(path, PIECES)


def test_line_numbers_point_at_the_bad_line(tmp_path):
    text = ARPA.replace("-0.3\tb c", "-0.3\tb")
    line = text.splitlines().index("-0.3\tb") + 1
    with pytest.raises(ArpaError, match=rf"bad\.arpa:{line}:"):
        load_arpa(_write(tmp_path, text), PIECES)


def test_minus_infinity_is_floored_and_nan_refused(tmp_path):
    lm = load_arpa(_write(tmp_path, ARPA.replace("-99\t<s>", "-inf\t<s>")), PIECES)
    assert lm.sentence_logprob([A, B, C, A, C]) == pytest.approx((-0.2 - 0.1 - 0.05 - 0.5 - 1.2 - 1.0) * LN10, abs=1e-5)
    with pytest.raises(ArpaError, match=r"bad\.arpa:\d+: not a number"):
        load_arpa(_write(tmp_path, ARPA.replace("-0.3\tb c", "nan\tb c")), PIECES)


def test_dense_tables_answer_as_the_back_off_walk(lm):
    """A small model answers from (S, V) tables filled at load; they must index as the walk does."""
    assert lm.dense_logp is not None
    states = torch.arange(lm.num_states).repeat_interleave(len(PIECES))
    tokens = torch.arange(len(PIECES)).repeat(lm.num_states)
    dense = lm.score(states, tokens)
    walked = lm._walk(states, tokens)
    assert torch.equal(dense[0], walked[0]) and torch.equal(dense[1], walked[1])
    lp, nxt = lm.score_all(states[:5])
    assert torch.equal(lp, lm._walk_all(states[:5])[0]) and torch.equal(nxt, lm._walk_all(states[:5])[1])
