"""WER against hand-computed examples and a plain Levenshtein DP; report files; RTFx."""

from __future__ import annotations

import random

import pytest

from asrprec.metrics import (
    ErrorCounts,
    RtfxMeter,
    align_words,
    compute_wer,
    rtfx,
    word_errors,
    write_error_stats,
    write_recogs,
)


def levenshtein(a: list[str], b: list[str]) -> int:
    """Textbook Wagner–Fischer edit distance with unit costs."""
    d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) + 1):
        d[i][0] = i
    for j in range(len(b) + 1):
        d[0][j] = j
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[len(a)][len(b)]


def test_hand_computed_examples():
    # one substitution (sat->sit) and one deletion (a "the"): 2 errors over 6 words
    c = word_errors("the cat sat on the mat", "the cat sit on mat")
    assert (c.subs, c.dels, c.ins, c.ref_words) == (1, 1, 0, 6)
    assert c.wer == pytest.approx(2 / 6)
    # kitten -> sitting with letters as words: k->s, e->i, +g
    c = word_errors(list("kitten"), list("sitting"))
    assert (c.subs, c.dels, c.ins, c.errors) == (2, 0, 1, 3)
    # insertions can push WER above 100 %
    c = word_errors("a", "b c d")
    assert c.errors == 3 and c.wer == 3.0
    assert word_errors("", "").wer == 0.0
    assert word_errors("", "x").wer == float("inf")
    assert word_errors("a b", "").dels == 2


def test_against_plain_dp_random():
    rng = random.Random(0)
    vocab = ["a", "b", "c", "d"]
    refs, hyps, total = [], [], 0
    for _ in range(300):
        r = [rng.choice(vocab) for _ in range(rng.randint(0, 8))]
        h = [rng.choice(vocab) for _ in range(rng.randint(0, 8))]
        c = word_errors(r, h)
        assert c.errors == levenshtein(r, h)
        assert c.ins - c.dels == len(h) - len(r)  # any valid alignment satisfies this
        refs.append(r)
        hyps.append(h)
        total += levenshtein(r, h)
    corpus = compute_wer(refs, hyps)
    assert corpus.errors == total
    assert corpus.ref_words == sum(map(len, refs)) and corpus.utts == 300
    assert corpus.wer == pytest.approx(total / sum(map(len, refs)))


def test_alignment_pairs_and_filler_words():
    pairs, c = align_words("a * b", "a b c")  # '*' is a real word here: the filler must not collide
    assert c.errors == levenshtein(["a", "*", "b"], ["a", "b", "c"]) == 2
    assert [a for a, _ in pairs if a is not None] == ["a", "*", "b"]
    assert [b for _, b in pairs if b is not None] == ["a", "b", "c"]


def test_error_counts_arithmetic_and_summary():
    c = ErrorCounts(ins=1, dels=2, subs=2, ref_words=40, utts=3) + ErrorCounts(ref_words=0, utts=1)
    assert c.errors == 5 and c.correct == 36 and c.utts == 4
    assert c.summary() == "%WER 12.50 [ 5 / 40, 1 ins, 2 del, 2 sub ]"


def test_input_errors():
    with pytest.raises(ValueError, match="2 references but 1"):
        compute_wer(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="word_errors"):
        compute_wer("a b", "a b")
    with pytest.raises(ValueError, match="word strings"):
        word_errors([1, 2], ["a"])
    with pytest.raises(ValueError, match="triple"):
        write_recogs("/tmp/never", [("id", "a")])
    with pytest.raises(ValueError, match="wall_seconds"):
        rtfx(1.0, 0.0)


def test_report_files(tmp_path):
    results = [
        ("utt-2", "the cat sat on the mat", "the cat sit on mat"),
        ("utt-1", ["hello", "world"], ["hello", "world", "again"]),
        ("utt-3", "sat sat", "sit sit"),
    ]
    recogs = write_recogs(tmp_path / "recogs.txt", results).read_text().splitlines()
    assert recogs[:2] == ["utt-1:\tref=['hello', 'world']", "utt-1:\thyp=['hello', 'world', 'again']"]
    assert len(recogs) == 6
    counts = write_error_stats(tmp_path / "errs.txt", results, title="test-clean greedy_search")
    # 2 + 1 + 2 errors over 6 + 2 + 2 words
    assert (counts.errors, counts.ref_words, counts.subs, counts.dels, counts.ins) == (5, 10, 3, 1, 1)
    text = (tmp_path / "errs.txt").read_text()
    lines = text.splitlines()
    assert lines[0] == "test-clean greedy_search"
    assert lines[1] == "%WER = 50.00"
    assert lines[2].startswith(
        "Errors: 1 insertions, 1 deletions, 3 substitutions, over 10 reference words (6 correct)"
    )
    assert "utt-1:\thello world (*->again)" in lines
    assert "utt-3:\t(sat->sit) (sat->sit)" in lines
    subs = lines[lines.index("SUBSTITUTIONS: count ref -> hyp") + 1]
    assert subs == "3   sat -> sit"  # the most common error comes first
    assert "1   again" in lines[lines.index("INSERTIONS: count hyp") + 1 :]
    per_word = lines[lines.index("PER-WORD STATS: word  corr tot_errs count_in_ref count_in_hyp") + 1 :]
    assert per_word[0] == "sat   0 3 3 0"
    assert "sit   0 3 0 3" in per_word and "cat   1 0 1 1" in per_word


def test_rtfx():
    assert rtfx(100.0, 4.0) == 25.0
    m = RtfxMeter()
    m.add(10.0, 2.0)
    with m.measure(audio_seconds=5.0):
        pass
    assert m.audio_seconds == 15.0 and 2.0 < m.wall_seconds < 3.0
    assert m.rtfx == pytest.approx(15.0 / m.wall_seconds)


def test_read_recogs_inverts_write_recogs(tmp_path):
    from asrprec.metrics import read_recogs

    results = [("b-2", "IT'S A \"TEST\"", ""), ("a-1", ["ONE", "TWO"], ["ONE", "TOO", "X"])]
    path = write_recogs(tmp_path / "recogs.txt", results)
    assert read_recogs(path) == {"a-1": (["ONE", "TWO"], ["ONE", "TOO", "X"]), "b-2": (["IT'S", "A", '"TEST"'], [])}
    (tmp_path / "bad.txt").write_text("a-1 ref=['X']\n")
    with pytest.raises(ValueError, match="not a recogs line"):
        read_recogs(tmp_path / "bad.txt")
