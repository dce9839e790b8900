"""The synthetic corpus' word times: read from espeak's events, stored in the supervisions, and checked against the
energy of the audio written (an independent measure of where speech is).

The energy check (5 ms frames, dB relative to the utterance's loudest frame) on clean utterances: in every pause
between two words no frame is above -30 dB; every word holds a frame above -20 dB; at every word edge that touches
silence (an utterance's ends, pauses) the first / last frame above -40 dB lies within 80 ms (two encoder frames) of
the aligned start / end (stop closures are silent: "CAT" sounds after its "K" closes). Words that run into each
other without a pause share their boundary, which energy cannot check.
"""

import numpy as np

from asrprec.data.espeak import word_spans_from_events
from asrprec.data.synthetic import SAMPLE_RATE, CorpusConfig, plan_corpus, render_aligned_utterance

from .conftest import needs_espeak

TOLERANCE_S = 0.08
HOP = SAMPLE_RATE // 200  # 5 ms


def test_spans_from_hand_made_events():
    W, P, END = 1, 7, 5
    events = [
        (W, 0, ""), (P, 260, "T"), (P, 2100, "r"), (P, 5630, "_"),  # THREE, then a pause
        (W, 6115, ""), (P, 6115, "w"), (P, 9955, "n"),  # ONE runs into FOUR
        (W, 12181, ""), (P, 12445, "f"), (P, 20242, "_"), (P, 20727, "_:"), (END, 20881, ""),
    ]
    assert word_spans_from_events(events, 20881) == [(0, 5630), (6115, 12181), (12181, 20242)]
    # the last word spoken to the end of the audio; a word without a spoken phoneme is an instant; capped at N
    assert word_spans_from_events([(W, 10, ""), (P, 12, "a"), (W, 50, ""), (W, 60, ""), (P, 70, "b")], 65) == [
        (10, 50), (50, 50), (60, 65)]
    assert word_spans_from_events([], 100) == []


def _energy_db(y: np.ndarray) -> np.ndarray:
    n = len(y) // HOP
    e = np.sqrt(np.mean(y[: n * HOP].reshape(n, HOP) ** 2, axis=1))
    return 20 * np.log10(e / e.max() + 1e-12)


def _check_against_energy(y, words, *, ends: bool = True) -> int:
    db = _energy_db(y)
    loud = db > -40
    checked = 0
    for i, (w, a, b) in enumerate(words):
        fa, fb = int(a * 200), int(np.ceil(b * 200))
        assert db[fa:fb].max() > -20, (w, a, b)
        prev_end = words[i - 1][2] if i else 0.0
        nxt = words[i + 1][1] if i + 1 < len(words) else len(y) / SAMPLE_RATE
        if i == 0 or a - prev_end > 0.03:  # a start after silence
            lo = int(prev_end * 200)
            onset = (lo + np.nonzero(loud[lo:fb])[0][0]) / 200
            assert abs(onset - a) <= TOLERANCE_S, (w, a, onset)
            checked += 1
        if ends and (i + 1 == len(words) or nxt - b > 0.03):  # an end before silence
            offset = (fa + np.nonzero(loud[fa:int(np.ceil(nxt * 200))])[0][-1] + 1) / 200
            assert abs(offset - b) <= TOLERANCE_S, (w, b, offset)
            checked += 1
        if ends and i + 1 < len(words) and nxt - b > 0.03:  # a pause: silence between the words
            assert db[int(b * 200) + 2: int(nxt * 200) - 2].max() < -30, (w, b, nxt)
    return checked


@needs_espeak
def test_word_times_match_the_energy_of_clean_audio():
    specs = plan_corpus(CorpusConfig(num_train=0, num_dev=0, num_test=24, snr_db=None, reverb_prob=0.0))
    checked = pauses = 0
    for k, spec in enumerate(specs):
        if k % 2:  # espeak's extra pause between words (the corpus draws one for 30 % of utterances)
            spec = {**spec, "word_gap": 3}
        y, words = render_aligned_utterance(spec)
        assert [w for w, _, _ in words] == spec["text"].split()
        checked += _check_against_energy(y, words)
        pauses += sum(b2 - e1 > 0.03 for (_, _, e1), (_, b2, _) in zip(words, words[1:]))
    assert checked >= 2 * len(specs) and pauses >= 12  # the check saw utterance edges and pauses


@needs_espeak
def test_word_starts_survive_reverberation():
    # the synthetic room response has its direct path at lag 0: onsets stay; the tail smears the ends
    specs = plan_corpus(CorpusConfig(num_train=0, num_dev=0, num_test=8, snr_db=None, reverb_prob=1.0))
    for spec in specs:
        assert spec["rt60_s"] is not None
        y, words = render_aligned_utterance(spec)
        assert _check_against_energy(y, words, ends=False) >= 1


@needs_espeak
def test_corpus_supervisions_hold_ordered_word_spans_inside_the_audio(tiny_corpus):
    _, cuts = tiny_corpus
    for split_cuts in cuts.values():
        for cut in split_cuts:
            sup = cut.supervisions[0]
            items = sup.alignment["word"]
            assert [it.symbol for it in items] == sup.text.split()
            for it, nxt in zip(items, items[1:] + [None]):
                assert 0.0 <= it.start and it.duration > 0 and it.end <= cut.duration + 1e-4, (cut.id, it)
                if nxt is not None:
                    assert it.end <= nxt.start + 1e-4, (cut.id, it, nxt)
