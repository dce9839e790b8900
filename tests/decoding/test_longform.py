"""Long-form decoding: chunk plans, and a recording of known utterances decoded by a model whose output is its input
(every encoder frame's CTC label is written in the features), so the right words and times are known exactly."""

import numpy as np
import pytest
import torch
from torch import nn

from asrprec.decoding import DecodingOptions
from asrprec.decoding.longform import LongFormOptions, decode_long, decode_long_cuts, plan_chunks

PIECES = ["<blk>", "\u2581ONE", "\u2581TWO", "\u2581THR", "EE", "\u2581FOUR", "\u2581FI", "VE"]
WORDS = {"ONE": [1], "TWO": [2], "THREE": [3, 4], "FOUR": [5], "FIVE": [6, 7]}
CTC = DecodingOptions(method="ctc_greedy_search")


class Pieces:
    def id_to_piece(self, i):
        return PIECES[i]


class EchoCtc(nn.Module):
    """CTC-only stand-in: encoder frame t is feature frame 4t (4x subsampling); its log-probs favour the one-hot
    label the feature holds. Records the longest input it was given."""

    use_ctc, use_transducer, blank_id, min_input_frames = True, False, 0, 1

    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.longest = 0

    def encode(self, x, x_lens):
        self.longest = max(self.longest, x.size(1))
        return x[:, ::4], (x_lens + 3) // 4

    def ctc_log_probs(self, encoder_out):
        return (20.0 * encoder_out).log_softmax(-1)


def recording(seed, num_utts, seam_words=()):
    """(T, V) one-hot features of utterances separated by 0.6 s pauses, the true words ``(word, start, end, utt)``
    and each utterance's (begin, end) in seconds. Everything starts on the 40 ms grid. ``seam_words``: times (s) at
    which a word must be running (it is placed across them)."""
    rng = np.random.default_rng(seed)
    labels, words, utts = [0] * 60, [], []
    pending = sorted(seam_words)
    for u in range(num_utts):
        begin = len(labels)
        for _ in range(int(rng.integers(3, 8))):
            if pending and len(labels) * 0.01 > pending[0] - 1.6:  # start a word 80 ms before the seam
                labels += [0] * (int(round(pending.pop(0) * 100)) - 8 - len(labels))
            word = list(WORDS)[int(rng.integers(len(WORDS)))]
            start = len(labels)
            for piece in WORDS[word]:
                labels += [piece] * (4 * int(rng.integers(3, 8)))
            words.append((word, start * 0.01, len(labels) * 0.01, u))
            labels += [0] * (4 * int(rng.integers(2, 5)))
        utts.append((begin * 0.01, len(labels) * 0.01))
        labels += [0] * 60
    feats = torch.zeros(len(labels), len(PIECES))
    feats[torch.arange(len(labels)), torch.tensor(labels)] = 1.0
    return feats, words, utts


def test_chunk_plan_tiles_the_recording():
    opts = LongFormOptions(chunk_seconds=10.0, overlap_seconds=2.0)
    for T in (0, 3, 999, 1000, 1001, 1803, 5000, 12345):
        chunks = plan_chunks(T, opts)
        assert chunks[0].start == 0 and chunks[-1].end == T
        assert chunks[0].own_start == -np.inf and chunks[-1].own_end == np.inf
        for a, b in zip(chunks, chunks[1:]):
            assert b.start % 4 == 0 and a.own_end == b.own_start  # on the encoder grid; owned regions tile
            assert b.start <= a.end - 200  # at least the overlap is shared
            assert a.end * 0.01 - a.own_end >= 1.0 - 1e-9 and b.own_start - b.start * 0.01 >= 1.0 - 1e-9
        assert all(c.end - c.start <= 1003 for c in chunks)


def test_words_in_order_inside_their_utterances_across_seams():
    opts = LongFormOptions(chunk_seconds=10.0, overlap_seconds=2.0, chunks_per_batch=2)
    # chunks [0, 10), [8, 18), [16, 26) ... every 8 s: owned boundaries at 9, 17, 25, 33 ... s; words across the
    # start of a chunk (8, 40 s), an owned boundary (17, 33 s) and the end of a chunk (26, 50 s)
    seams = (8.0, 17.0, 26.0, 33.0, 40.0, 50.0)
    feats, truth, utts = recording(0, 30, seams)
    assert feats.size(0) > 100 * 60  # over a minute
    for s in seams:  # the layout really puts a word across each seam
        assert any(a < s < b for _, a, b, _ in truth), s
    model = EchoCtc()
    got = decode_long(model, feats, Pieces(), opts, CTC)
    assert model.longest <= 1003
    assert [w.word for w in got] == [w for w, *_ in truth]  # none duplicated, none dropped, in order
    following = [t[1] for t in truth[1:]] + [float("inf")]
    for w, (word, start, end, u), nxt in zip(got, truth, following):
        assert w.start == pytest.approx(start, abs=1e-6)
        # a spike's end moves towards the next word by at most 400 ms (asrprec.timestamps)
        assert start + 0.04 - 1e-6 <= w.end <= min(end + 0.44, nxt) + 1e-6
        begins = [b for b, _ in utts[u + 1:]] + [float("inf")]
        assert utts[u][0] <= w.start < utts[u][1] and w.end <= begins[0]  # in its utterance, short of the next


def test_chunked_equals_one_pass_for_a_context_free_model():
    feats, truth, _ = recording(1, 12, (5.0, 7.0))
    whole = decode_long(EchoCtc(), feats, Pieces(), LongFormOptions(chunk_seconds=1000.0, overlap_seconds=0.0), CTC)
    for chunk, overlap in ((6.0, 1.0), (4.0, 2.0), (3.0, 0.8)):
        opts = LongFormOptions(chunk_seconds=chunk, overlap_seconds=overlap, chunks_per_batch=3)
        got = decode_long(EchoCtc(), feats, Pieces(), opts, CTC)
        assert [(w.word, round(w.start, 6), round(w.end, 6)) for w in got] == [
            (w.word, round(w.start, 6), round(w.end, 6)) for w in whole], (chunk, overlap)
    assert len(whole) == len(truth)


def test_empty_and_silent_recordings():
    assert decode_long(EchoCtc(), torch.zeros(0, len(PIECES)), Pieces(), search=CTC) == []
    silent = torch.zeros(3000, len(PIECES))
    silent[:, 0] = 1.0
    assert decode_long(EchoCtc(), silent, Pieces(), LongFormOptions(chunk_seconds=10.0), CTC) == []


def test_chunk_features_from_audio_match_the_whole_recording(tmp_path):
    import soundfile as sf
    from lhotse import Recording

    from asrprec.data.features import fbank_extractor
    from asrprec.decoding.longform import _Features

    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 7)).astype(np.float32)
    sf.write(tmp_path / "a.wav", audio, 16000)
    rec = Recording.from_file(tmp_path / "a.wav")
    whole = torch.as_tensor(fbank_extractor().extract(rec.load_audio(), 16000))
    feats = _Features(rec)
    assert feats.num_frames == whole.size(0) == 700
    for start, end in ((0, 300), (240, 540), (400, 700)):
        part = feats(start, end)
        assert part.shape == (end - start, 80)
        # away from the chunk's edges (the 25 ms window reaches 1-2 frames over them) the frames are the same
        assert torch.allclose(part[3:-3], whole[start + 3:end - 3], atol=1e-3)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="overlap_seconds"):
        LongFormOptions(chunk_seconds=4.0, overlap_seconds=4.0)
    with pytest.raises(ValueError, match="chunk_seconds"):
        LongFormOptions(chunk_seconds=0.0)
    with pytest.raises(ValueError, match="chunks_per_batch"):
        LongFormOptions(chunks_per_batch=0)
    with pytest.raises(TypeError, match="lhotse Cut"):
        decode_long(EchoCtc(), [1, 2, 3], Pieces())


class LoudCtc(EchoCtc):
    """CTC-only stand-in on real fbank: token 1 on every encoder frame whose mean log-mel energy is high, else blank."""

    def encode(self, x, x_lens):
        self.longest = max(self.longest, x.size(1))
        return x[:, ::4].mean(dim=-1, keepdim=True), (x_lens + 3) // 4

    def ctc_log_probs(self, encoder_out):
        loud = (encoder_out > -8.0).float()
        return torch.cat([1.0 - loud, loud], dim=-1).mul(20.0).log_softmax(-1)


def test_long_cuts_from_audio_find_each_burst_across_seams(tmp_path):
    import soundfile as sf
    from lhotse import MonoCut, Recording, SupervisionSegment

    rng = np.random.default_rng(0)
    audio = np.zeros(16000 * 7, dtype=np.float32)
    bursts = [(0.52, 1.48), (2.6, 3.4), (4.4, 5.6)]  # the 2nd and 3rd run across chunk edges (2 s chunks, 0.8 s step)
    for a, b in bursts:
        audio[int(a * 16000): int(b * 16000)] = 0.1 * rng.standard_normal(int(b * 16000) - int(a * 16000))
    sf.write(tmp_path / "a.wav", audio, 16000)
    rec = Recording.from_file(tmp_path / "a.wav")
    cut = MonoCut("c1", 0.0, rec.duration, 0, recording=rec,
                  supervisions=[SupervisionSegment("s1", rec.id, 0.0, rec.duration, text="A A A")])
    model = LoudCtc()
    results, words, stats = decode_long_cuts(model, [cut], Pieces(), LongFormOptions(2.0, 1.2, 3), CTC)
    assert results == [("c1", ["A", "A", "A"], ["ONE", "ONE", "ONE"])]  # piece 1 is "▁ONE"
    assert model.longest <= 203 and stats["audio_seconds"] == pytest.approx(7.0)
    (cid, spans), = words
    for w, (a, b) in zip(spans, bursts):  # each burst's start within an encoder frame and a window
        assert abs(w.start - a) <= 0.06 and a < w.end <= b + 0.44


# Chunk results chosen by hand: the search is replaced by one that returns, for each chunk, the tokens and frames
# planned for the chunk's first feature frame (the stand-in encoder passes feature 0, the frame's index, through).
STAMPS = ["<blk>", "\u2581A", "X", "\u2581B", "Y", "\u2581C", "\u2581D", "E", "\u2581.", ",", "\u2581", "<s>",
          "\u2581F"]


class StampPieces:
    def id_to_piece(self, i):
        return STAMPS[i]


class FrameIndex(nn.Module):
    """Encoder stand-in: encoder frame t is feature frame 4t (4x subsampling), as EchoCtc."""

    use_ctc, use_transducer, blank_id, min_input_frames = True, False, 0, 1

    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))

    def encode(self, x, x_lens):
        return x[:, ::4], (x_lens + 3) // 4


def planned_search(monkeypatch, plan):
    """Replace the long-form search by ``plan(chunk_start, encoder_frames) -> (tokens, frames, durations)``."""
    from asrprec.decoding import longform
    from asrprec.decoding.hypothesis import DecodingResult

    class Planned:
        def __init__(self, model, options):
            pass

        def __call__(self, encoder_out, encoder_out_lens, *, return_timestamps=False):
            return [DecodingResult(*plan(int(encoder_out[b, 0, 0]), int(n)))
                    for b, n in enumerate(encoder_out_lens.tolist())]

    monkeypatch.setattr(longform, "Searcher", Planned)


def frame_index(num_frames):
    return torch.arange(float(num_frames)).unsqueeze(1)


@pytest.mark.parametrize("plan, expected", [
    # chunk [0, 1.2) s: "▁A"@0 "X"@27 spans 0-1.2 s (centre 0.6, kept); chunk [0.08, 1.3) s: "▁B"@1 "Y"@29 spans
    # 0.12-1.32 s (centre 0.72, kept). AX ran over BY's start (and BY past the recording's 1.3 s end)
    ({0: ((1, 2), (0, 27)), 8: ((3, 4), (1, 29))}, [("AX", 0.0, 0.12), ("BY", 0.12, 1.30)]),
    # "▁C"@10 spans 0.4-0.84 s (centre 0.62, kept from the first chunk); "▁D"@2 "E"@29 spans 0.16-1.32 s (centre
    # 0.74, kept from the second): DE starts first, and now ends where C starts
    ({0: ((5,), (10,)), 8: ((6, 7), (2, 29))}, [("DE", 0.16, 0.40), ("C", 0.40, 0.84)]),
])
def test_words_kept_from_neighbouring_chunks_are_ordered_and_do_not_overlap(monkeypatch, plan, expected):
    # 1.3 s in 1.2 s chunks with 0.4 s overlap: the last chunk ends at the recording's end, so it starts 80 ms in and
    # shares all but 80 ms with the first; owned regions meet at (1.2 + 0.08) / 2 = 0.64 s
    opts = LongFormOptions(chunk_seconds=1.2, overlap_seconds=0.4)
    assert [(c.start, c.end, c.own_end) for c in plan_chunks(130, opts)] == [(0, 120, 0.64), (8, 130, np.inf)]
    planned_search(monkeypatch, lambda start, n: plan[start])
    got = decode_long(FrameIndex(), frame_index(130), StampPieces(), opts)
    assert [w.word for w in got] == [e[0] for e in expected]
    assert [t for w in got for t in (w.start, w.end)] == pytest.approx([t for e in expected for t in e[1:]])


def test_merged_words_are_ordered_inside_the_recording_for_any_token_frames(monkeypatch):
    # what an untrained model may emit: many tokens on one frame, long gaps, pieces without "▁", punctuation and
    # blank-like pieces, TDT durations or none, frames up to the chunk's end
    rng = np.random.default_rng(0)

    def plan(start, n):
        u = int(rng.integers(0, 25))
        on = rng.integers(0, max(n, 1), size=int(rng.integers(1, 4)))  # a few frames take all the tokens
        frames = np.sort(rng.choice(on, size=u)) if rng.random() < 0.5 else np.sort(rng.integers(0, n + 1, size=u))
        tokens = rng.integers(1, len(STAMPS), size=u)
        durations = tuple(int(d) for d in rng.integers(0, 30, size=u)) if rng.random() < 0.4 else None
        return tuple(int(t) for t in tokens), tuple(int(f) for f in frames), durations

    planned_search(monkeypatch, plan)
    words_seen = 0
    for trial in range(150):
        chunk = float(rng.uniform(0.3, 4.0))
        opts = LongFormOptions(chunk, float(rng.uniform(0.0, 0.9)) * chunk, int(rng.integers(1, 4)))
        T = int(rng.integers(1, 1500))
        got = decode_long(FrameIndex(), frame_index(T), StampPieces(), opts)
        words_seen += len(got)
        for w in got:
            assert 0.0 <= w.start <= w.end <= T * 0.01 + 1e-9, (trial, w)
        for a, b in zip(got, got[1:]):
            assert a.start <= b.start and a.end <= b.start + 1e-9, (trial, a, b)
    assert words_seen > 500  # the cases are not empty


def test_segments_cut_at_pauses_own_the_words_up_to_the_pauses_middles():
    from asrprec.decoding.longform import plan_segments

    # speech (energy 0) with quiet runs 30 dB down (-6.9 in natural log) at frames [300, 361) and [1000, 1100),
    # and a 0.2 s dip at [500, 520), shorter than a pause
    energy = torch.zeros(3000)
    for a, b in ((300, 361), (1000, 1100), (500, 520)):
        energy[a:b] = -8.0
    opts = LongFormOptions(chunk_seconds=12.0, overlap_seconds=2.0, pause_seconds=0.3, pause_db=30.0)
    chunks = plan_segments(energy, opts)
    # segments [0, 300), [361, 1000), [1100, 3000), starts moved on to the encoder grid; the last one (19 s) is
    # longer than 12 s: chunked, its chunks sharing 2 s
    assert [(c.start, c.end) for c in chunks[:2]] == [(0, 300), (364, 1000)]
    assert chunks[2].start == 1100 and chunks[-1].end == 3000 and len(chunks) == 4
    assert chunks[3].start <= chunks[2].end - 200
    # owned regions tile the line, meeting at the middles of the pauses (3.305 s, 10.5 s)
    assert chunks[0].own_start == -np.inf and chunks[-1].own_end == np.inf
    assert [c.own_end for c in chunks[:2]] == [pytest.approx(3.305), pytest.approx(10.5)]
    assert all(a.own_end == b.own_start for a, b in zip(chunks, chunks[1:]))
    assert all(c.start % 4 == 0 for c in chunks)
    # without pauses: the fixed chunks
    assert plan_segments(energy, LongFormOptions(chunk_seconds=12.0, overlap_seconds=2.0)) == plan_chunks(3000, opts)
    with pytest.raises(ValueError, match="pause_seconds"):
        LongFormOptions(pause_seconds=-1.0)


def test_cut_at_pauses_each_utterance_is_decoded_alone():
    class OneUtterance(EchoCtc):
        """EchoCtc that sees no output at all in an input holding a pause (as a model trained on single utterances
        fails on several): the pauses are frames of low energy, 60 frames (0.6 s) between utterances."""

        def encode(self, x, x_lens):
            for row, n in zip(x, x_lens.tolist()):
                quiet = (torch.logsumexp(row[:n], -1) < -10).int().tolist()
                run = best = 0
                for q in quiet[4:]:  # after the encoder grid's few
                    run = run + 1 if q else 0
                    best = max(best, run)
                assert best < 30, "a chunk holds a pause"
            return super().encode(x, x_lens)

    feats, truth, utts = recording(3, 12)
    labels = feats.argmax(-1)
    silent = torch.full_like(feats, -20.0)
    silent[:, 0] = -19.0  # a quiet frame whose best label is still blank
    feats = torch.where((labels == 0)[:, None], silent, feats)
    opts = LongFormOptions(chunk_seconds=20.0, overlap_seconds=4.0, pause_seconds=0.3)
    got = decode_long(OneUtterance(), feats, Pieces(), opts, CTC)
    assert [w.word for w in got] == [w for w, *_ in truth]
    assert all(w.start == pytest.approx(t[1], abs=1e-6) for w, t in zip(got, truth))
    with pytest.raises(AssertionError, match="holds a pause"):  # fixed 20 s chunks hold several utterances
        decode_long(OneUtterance(), feats, Pieces(), LongFormOptions(chunk_seconds=20.0, overlap_seconds=4.0), CTC)
