"""Token frames → word spans, CTC runs and CTM files, on hand-made frame sequences with hand-computed times."""

import numpy as np
import pytest
import torch

from asrprec.timestamps import (
    EXTEND_FRAMES, FRAME_SHIFT_S, TokenWord, WordSpan, ctc_token_runs, ctm_path, finish_words, format_ctm,
    is_zero_duration, token_words, word_spans, words_from_ids, words_from_token_times, write_ctm,
)

F = FRAME_SHIFT_S


def assert_spans(words, expected):
    assert [w.word for w in words] == [e[0] for e in expected]
    assert [t for w in words for t in (w.start, w.end)] == pytest.approx([t for e in expected for t in e[1:]])


def test_frame_shift_is_40_ms_for_both_encoders():
    from asrprec.models.builders import build_encoder

    assert F == pytest.approx(0.04)
    T = 1000  # 10 s of 10 ms feature frames
    for name in ("conformer", "zipformer"):
        enc = build_encoder(name, "tiny").eval()
        with torch.no_grad():
            _, lens = enc(torch.randn(1, T, 80), torch.tensor([T]))
        assert abs(int(lens[0]) * F - T * 0.01) <= 4 * F, (name, int(lens[0]))  # 25 frames a second, edges aside


def test_bpe_word_starts_and_ends():
    # frames: THE@2, SM@5 ALL@7, DOG@12: each word ends one frame after its last piece ...
    pieces, frames = ["\u2581THE", "\u2581SM", "ALL", "\u2581DOG"], [2, 5, 7, 12]
    out = word_spans(pieces, frames, num_frames=20, extend_frames=0)
    assert_spans(out, [("THE", 2 * F, 3 * F), ("SMALL", 5 * F, 8 * F), ("DOG", 12 * F, 13 * F)])
    # ... then, without durations, moves on to the next word's start or the utterance's end (here within 10 frames)
    assert EXTEND_FRAMES == 10
    out = word_spans(pieces, frames, num_frames=20)
    assert_spans(out, [("THE", 2 * F, 5 * F), ("SMALL", 5 * F, 12 * F), ("DOG", 12 * F, 20 * F)])
    # by at most 10 frames: a pause stays out
    out = word_spans(["\u2581A", "\u2581B"], [0, 30], num_frames=45)
    assert_spans(out, [("A", 0.0, 11 * F), ("B", 30 * F, 41 * F)])


def test_first_piece_without_word_start_still_starts_a_word_and_offset_shifts():
    out = word_spans(["ING", "\u2581A"], [0, 1], offset=10.0, num_frames=5)
    assert_spans(out, [("ING", 10.0, round(10.0 + F, 6)), ("A", round(10.0 + F, 6), round(10.0 + 5 * F, 6))])


def test_tdt_durations_extend_the_end_capped_at_the_next_word_and_the_utterance():
    # ONE@0 lasts 4 frames but TWO starts at 2; TWO@2 lasts 3 but the utterance has 4 frames
    out = word_spans(["\u2581ONE", "\u2581TWO"], [0, 2], [4, 3], num_frames=4)
    assert_spans(out, [("ONE", 0.0, 2 * F), ("TWO", 2 * F, 4 * F)])
    # a duration of 0 (the next piece on the same frame) counts as one frame; the word's last piece decides its end
    out = word_spans(["\u2581B", "OX", "\u2581NOW"], [3, 3, 9], [0, 2, 1], extend_frames=0)
    assert_spans(out, [("BOX", 3 * F, 5 * F), ("NOW", 9 * F, 10 * F)])
    # ... from which it moves on to the next word's start, or by at most 10 frames, as without durations (a TDT
    # model jumps over a word's later frames with blanks)
    out = word_spans(["\u2581B", "OX", "\u2581NOW", "\u2581GO"], [3, 3, 9, 40], [0, 2, 1, 3], num_frames=60)
    assert_spans(out, [("BOX", 3 * F, 9 * F), ("NOW", 9 * F, 20 * F), ("GO", 40 * F, 53 * F)])


def test_punctuation_gets_zero_duration():
    # a TDT model emits "." with a long duration: it must not drag WORLD's end (nor HELLO's ",")
    pieces, frames, durs = ["\u2581HELLO", ",", "\u2581WORLD", "."], [1, 4, 6, 9], [2, 10, 2, 30]
    out = word_spans(pieces, frames, durs, num_frames=50, extend_frames=0)
    assert_spans(out, [("HELLO,", 1 * F, 3 * F), ("WORLD.", 6 * F, 8 * F)])
    out = word_spans(pieces, frames, durs, num_frames=50)  # moved on by 10 frames at most, not by "."'s 30
    assert_spans(out, [("HELLO,", 1 * F, 6 * F), ("WORLD.", 6 * F, 18 * F)])
    # a word of punctuation alone is an instant at its frame
    out = word_spans(["\u2581HI", "\u2581?"], [0, 5], [1, 7])
    assert_spans(out, [("HI", 0.0, 5 * F), ("?", 5 * F, 5 * F)])
    out = word_spans(["\u2581HI", "\u2581?"], [0, 5], num_frames=30)  # no durations: HI reaches "?", which stays 0 s
    assert_spans(out, [("HI", 0.0, 5 * F), ("?", 5 * F, 5 * F)])
    assert is_zero_duration(".") and is_zero_duration("\u2581,") and is_zero_duration("<blk>")
    assert is_zero_duration("\u2581") and not is_zero_duration("\u2581A") and not is_zero_duration("<unk>")


def test_blank_like_pieces_neither_start_nor_extend_a_word():
    # a bare "▁" at frame 2 starts the word, whose first timed piece (CAT) comes at 4
    out = word_spans(["\u2581", "CAT", "<blk>"], [2, 4, 9], num_frames=8)
    assert_spans(out, [("CAT", 4 * F, 8 * F)])  # to the utterance's end (no durations)
    assert word_spans(["\u2581"], [3]) == []


def test_ctc_repeats_and_blanks():
    # per-frame best path: blank, CA CA, blank, T, blank blank, DOG DOG DOG, blank, DOG
    labels = [0, 5, 5, 0, 6, 0, 0, 7, 7, 7, 0, 7]
    assert ctc_token_runs(labels, blank_id=0) == ([5, 6, 7, 7], [1, 4, 7, 11], [2, 1, 3, 1])
    table = {5: "\u2581CA", 6: "T", 7: "\u2581DOG"}
    out = words_from_ids(table.__getitem__, *ctc_token_runs(labels), num_frames=len(labels), extend_frames=0)
    # CAT: from CA's first frame to one past T; the blank between repeats splits DOG DOG
    assert_spans(out, [("CAT", 1 * F, 5 * F), ("DOG", 7 * F, 10 * F), ("DOG", 11 * F, 12 * F)])
    out = words_from_ids(table.__getitem__, *ctc_token_runs(labels), num_frames=len(labels))  # ends moved on
    assert_spans(out, [("CAT", 1 * F, 7 * F), ("DOG", 7 * F, 11 * F), ("DOG", 11 * F, 12 * F)])
    assert ctc_token_runs([0, 0, 0]) == ([], [], [])
    assert ctc_token_runs([3, 3, 3], blank_id=0) == ([3], [0], [3])


def test_empty_hypotheses():
    assert word_spans([], []) == [] and word_spans([], [], []) == []
    assert words_from_ids(lambda i: "x", [], [], num_frames=0) == []
    assert format_ctm([("utt1", [])]) == ""


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="equal lengths"):
        word_spans(["\u2581A"], [0, 1])
    with pytest.raises(ValueError, match="equal lengths"):
        word_spans(["\u2581A"], [0], [1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        word_spans(["\u2581A", "\u2581B"], [3, 2])
    with pytest.raises(ValueError, match="durations must be >= 0"):
        word_spans(["\u2581A"], [0], [-1])


def test_ctm_columns_order_and_file(tmp_path):
    utts = [("utt2", [WordSpan("B", 0.4, 0.52)]), ("utt1", [WordSpan("Y", 1.0, 1.2), WordSpan("X", 0.08, 0.2)])]
    text = format_ctm(utts)
    assert text == "utt1 1 0.08 0.12 X\nutt1 1 1.00 0.20 Y\nutt2 1 0.40 0.12 B\n"
    path = ctm_path(tmp_path, "test", "greedy_search-epoch-3-avg-1-fp32")
    assert path.name == "ctm-test-greedy_search-epoch-3-avg-1-fp32.txt"
    write_ctm(path, utts)
    assert path.read_text() == text
    assert not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(ValueError, match="whitespace"):
        format_ctm([("a b", [WordSpan("X", 0.0, 0.1)])])


def test_ctm_collector_takes_decode_dataset_results(tmp_path):
    from collections import namedtuple

    from asrprec.timestamps import CtmCollector

    Result = namedtuple("Result", "tokens frames durations")
    table = {1: "\u2581A", 2: "\u2581B", 3: "."}
    ctm = CtmCollector(table.__getitem__, durations={"u2": 0.2})
    ctm(["u2", "u1"], [Result((1, 2), (0, 3), None), Result((), (), None)])
    ctm(["u3"], [Result((1, 3), (2, 4), (2, 9))])  # TDT: durations, "." without one
    # u2: A reaches B's start; B stops at the audio's end (0.2 s = 5 frames); u1 empty
    path = ctm.write(tmp_path / "ctm-test-x.txt")
    # u3 (TDT, no audio length given): A. ends at 4 + 10 frames, "."'s 9 frames not counted
    assert path.read_text() == "u2 1 0.00 0.12 A\nu2 1 0.12 0.08 B\nu3 1 0.08 0.48 A.\n"


def test_tokens_timed_in_seconds():
    # sherpa-onnx's result: pieces and start times in seconds (40 ms frames: 0.08 -> 2, 0.2 -> 5, 0.52 -> 13)
    out = words_from_token_times(["\u2581THE", "\u2581SM", "ALL"], [0.08, 0.2, 0.281], duration=0.6)
    assert_spans(out, [("THE", 2 * F, 5 * F), ("SMALL", 5 * F, 15 * F)])  # SMALL ends with the audio (15 frames)
    assert words_from_token_times([], []) == []
    # a token timed past the audio (a streaming decode's tail padding) goes on its last frame (0.2 s: frame 4)
    out = words_from_token_times(["\u2581A", "\u2581B"], [0.04, 0.5], duration=0.2)
    assert_spans(out, [("A", 1 * F, 4 * F), ("B", 4 * F, 5 * F)])
    # audio of 0.19 s: 5 frames, the last one partly past its end, where B's end is cut
    out = words_from_token_times(["\u2581A", "\u2581B"], [0.04, 0.16], duration=0.19)
    assert_spans(out, [("A", 1 * F, 4 * F), ("B", 4 * F, 0.19)])


def _seg(words, **kw):
    from asrprec.timestamps import segment_spans

    return [(s.text, s.start, s.end) for s in segment_spans(words, **kw)]


def test_sentence_punctuation_ends_a_segment():
    words = [WordSpan("HELLO", 0.1, 0.4), WordSpan("THERE.", 0.44, 0.8), WordSpan("HOW", 0.84, 1.0),
             WordSpan("ARE", 1.0, 1.2), WordSpan("YOU?", 1.2, 1.5), WordSpan("FINE,", 1.6, 1.9),
             WordSpan("THANKS!", 1.9, 2.3), WordSpan("OK", 2.3, 2.5)]
    # "," is no separator; "OK" after the last "!" is a segment of its own (the utterance ends it)
    assert _seg(words, max_gap_s=None) == [("HELLO THERE.", 0.1, 0.8), ("HOW ARE YOU?", 0.84, 1.5),
                                           ("FINE, THANKS!", 1.6, 2.3), ("OK", 2.3, 2.5)]
    # a word made of a separator alone (a "?" piece after "▁") ends one too, and lasts 0 s
    words = [WordSpan("WHY", 0.0, 0.3), WordSpan("?", 0.3, 0.3), WordSpan("NO", 0.5, 0.7)]
    assert _seg(words) == [("WHY ?", 0.0, 0.3), ("NO", 0.5, 0.7)]
    # other separators than the default ones
    assert _seg(words, separators=("O",)) == [("WHY ? NO", 0.0, 0.7)]


def test_a_gap_longer_than_the_threshold_ends_a_segment_a_shorter_one_does_not():
    from asrprec.timestamps import SEGMENT_GAP_S

    assert SEGMENT_GAP_S == 0.5
    # gaps: A-B 0.2 s, B-C 0.7 s, C-D 0.45 s
    words = [WordSpan("A", 0.0, 0.3), WordSpan("B", 0.5, 0.8), WordSpan("C", 1.5, 1.75), WordSpan("D", 2.2, 2.6)]
    assert _seg(words) == [("A B", 0.0, 0.8), ("C D", 1.5, 2.6)]
    assert _seg(words, max_gap_s=0.4) == [("A B", 0.0, 0.8), ("C", 1.5, 1.75), ("D", 2.2, 2.6)]
    assert _seg(words, max_gap_s=0.1) == [("A", 0.0, 0.3), ("B", 0.5, 0.8), ("C", 1.5, 1.75), ("D", 2.2, 2.6)]
    assert _seg(words, max_gap_s=None) == [("A B C D", 0.0, 2.6)]
    # touching words never split, even at a zero threshold
    assert _seg([WordSpan("A", 0.0, 0.3), WordSpan("B", 0.3, 0.5)], max_gap_s=0.0) == [("A B", 0.0, 0.5)]
    with pytest.raises(ValueError, match="max_gap_s"):
        _seg(words, max_gap_s=-0.1)


def test_segments_of_no_words_and_of_one_word():
    assert _seg([]) == []
    assert _seg([WordSpan("ALONE", 1.25, 1.75)]) == [("ALONE", 1.25, 1.75)]
    assert _seg([WordSpan("END.", 0.0, 0.2)]) == [("END.", 0.0, 0.2)]


def test_segments_file_beside_the_ctm(tmp_path):
    from asrprec.timestamps import CtmCollector, format_segments, segments_path, write_segments

    utts = [("u2", [WordSpan("B", 0.4, 0.52)]),
            ("u1", [WordSpan("Y.", 0.6, 1.2), WordSpan("X", 0.08, 0.2), WordSpan("Z", 2.0, 2.25)]), ("u3", [])]
    text = "u1 0.08 1.20 X Y.\nu1 2.00 2.25 Z\nu2 0.40 0.52 B\n"
    assert format_segments(utts) == text
    path = segments_path(tmp_path, "test", "greedy_search-epoch-3-avg-1-fp32")
    assert path.name == "segments-test-greedy_search-epoch-3-avg-1-fp32.txt"
    assert path.parent == ctm_path(tmp_path, "test", "greedy_search-epoch-3-avg-1-fp32").parent
    assert write_segments(path, utts).read_text() == text
    assert format_segments(utts, max_gap_s=None, separators=()) == "u1 0.08 2.25 X Y. Z\nu2 0.40 0.52 B\n"
    with pytest.raises(ValueError, match="whitespace"):
        format_segments([("a b", [WordSpan("X", 0.0, 0.1)])])
    # the collector writes the segments of the words it wrote to the CTM (frames of 40 ms, 25 in 1 s): A@0 reaches
    # B's start (3); B@3 with "." reaches 14 (10 frames past its last timed piece); C@20 reaches the end (25)
    table = {1: "\u2581A", 2: "\u2581B", 3: "\u2581C", 4: "."}
    ctm = CtmCollector(table.__getitem__, durations={"u": 1.0})
    ctm(["u"], [type("R", (), {"tokens": (1, 2, 4, 3), "frames": (0, 3, 4, 20), "durations": None})()])
    assert ctm.write_segments(tmp_path / "s.txt").read_text() == "u 0.00 0.56 A B.\nu 0.80 1.00 C\n"


def test_words_timed_apart_then_joined_get_the_next_word_rules_again():
    # three words' own times, given out of order, as chunks of a long recording give them: A's pieces run 0-28,
    # B's 3-30, "." is an instant at 5, Z starts past the recording's 20 frames
    words = [TokenWord("B", 3, 3, 30), TokenWord("Z", 25, 25, 26), TokenWord("A", 0, 0, 28), TokenWord(".", 5)]
    assert [w.onset for w in words] == [3, 25, 0, 5]
    out = finish_words(words, num_frames=20)
    assert_spans(out, [("A", 0.0, 3 * F), ("B", 3 * F, 5 * F), (".", 5 * F, 5 * F), ("Z", 20 * F, 20 * F)])
    # the end moves on towards the next start by at most extend_frames, never past the last frame
    out = finish_words([TokenWord("A", 0, 0, 1), TokenWord("B", 6, 6, 7)], num_frames=12, extend_frames=10)
    assert_spans(out, [("A", 0.0, 6 * F), ("B", 6 * F, 12 * F)])
    # token_words keeps each word's own times; shifted moves them, its end first cut at the chunk's last frame
    assert token_words(["\u2581A", ",", "X", "\u2581", "\u2581.", "<s>"], [1, 2, 4, 5, 6, 9]) == [
        TokenWord("A,X", 1, 1, 5), TokenWord(".", 6)]
    assert TokenWord("A", 2, 3, 9).shifted(10, limit=6) == TokenWord("A", 12, 13, 16)
    assert TokenWord(".", 2).shifted(10, limit=1) == TokenWord(".", 12)


def test_word_spans_are_ordered_and_never_overlap_for_any_token_frames():
    # an untrained model's output: many tokens on one frame, long gaps, any pieces, durations or none
    rng = np.random.default_rng(0)
    vocab = ["\u2581A", "B", "\u2581C", "\u2581.", ",", "\u2581", "<blk>", "<s>", "\u2581DE", "?"]
    for trial in range(500):
        U = int(rng.integers(0, 30))
        frames = sorted(int(f) for f in rng.choice(rng.integers(0, 200, size=int(rng.integers(1, 5))), size=U))
        pieces = [vocab[int(i)] for i in rng.integers(0, len(vocab), size=U)]
        durations = [int(d) for d in rng.integers(0, 40, size=U)] if rng.random() < 0.5 else None
        num_frames = int(rng.integers(1, 220)) if rng.random() < 0.7 else None
        out = word_spans(pieces, frames, durations, num_frames=num_frames)
        specials = ("\u2581", "<blk>", "<s>")  # every piece's text once, in order
        assert "".join(w.word for w in out) == "".join(p.strip("\u2581") for p in pieces if p not in specials), trial
        for w in out:
            assert 0.0 <= w.start <= w.end, (trial, w)
            assert num_frames is None or w.end <= num_frames * F + 1e-9, (trial, w)
        for a, b in zip(out, out[1:]):
            assert a.start <= b.start and a.end <= b.start + 1e-9, (trial, a, b)
