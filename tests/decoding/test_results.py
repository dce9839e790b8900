"""Token times from every search (:class:`DecodingResult`): on a scripted transducer whose joiner forces a known
alignment (each token on a known frame, TDT durations by construction), on CTC log-probabilities built by hand, and
between searches (beam = 1 against greedy, batched against one utterance at a time, chunks against whole)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asrprec.decoding import (
    DecodingOptions, DecodingResult, LabelLoopingGreedy, Searcher, StreamingCtcGreedySearch,
    StreamingCtcPrefixBeamSearch, StreamingGreedySearch, StreamingModifiedBeamSearch, StreamingTdtGreedySearch,
    TdtLabelLoopingGreedy, ctc_greedy_search, ctc_prefix_beam_search, decode_encoder_out, greedy_search,
    malsd_beam_search, modified_beam_search, tdt_greedy_search, tdt_modified_beam_search,
)
from asrprec.models import Decoder, Joiner, LossConfig, Transducer

SHARP = 12.0  # the scripted logit; every other logit is 0


class ScriptedTransducer(nn.Module):
    """A transducer whose joiner follows a script: utterance b emits ``scripts[b]`` = [(token, frame, duration)], each
    token once. Its encoder output holds (utterance, frame) as one number and its decoder output the last token, so
    the joiner knows where the search is; off the script it says blank. It has only the searchable-transducer interface
    (no ``decoder`` or ``joiner``), so a search that reached past it would fail here.

    RNN-T (``durations=()``): at frame t after token ℓ, the script's next token if it is due at t, else blank.
    TDT: a token's scripted duration; a blank jumps to the next token's frame (the largest duration that does not pass
    it) or, after the last token, one frame."""

    def __init__(self, scripts: list[list[tuple[int, int, int]]], T: int, V: int = 12,
                 durations: tuple[int, ...] = (), context_size: int = 2):
        super().__init__()
        self.blank_id, self.vocab_size, self.context_size, self.durations = 0, V, context_size, tuple(durations)
        K = len(durations)
        table = torch.zeros(len(scripts) * T, V, V + K)
        for b, script in enumerate(scripts):
            for t in range(T):
                for last in range(V):
                    pos = [k for k, _, _ in script].index(last) if last in [k for k, _, _ in script] else -1
                    if last != 0 and pos < 0:  # off the script
                        nxt = None
                    else:
                        nxt = script[pos + 1] if pos + 1 < len(script) else None
                    row = table[b * T + t, last]
                    if nxt is not None and nxt[1] == t:
                        row[nxt[0]] = SHARP
                        if K:
                            row[V + durations.index(nxt[2])] = SHARP
                    else:
                        row[0] = SHARP
                        if K:
                            gap = nxt[1] - t if nxt is not None and nxt[1] > t else 1
                            row[V + max(i for i, d in enumerate(durations) if 0 < d <= gap)] = SHARP
        self.register_buffer("table", table)
        self.T = T

    def encoder_out(self, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, 1) holding b·T + t, and (B,) lengths."""
        B = len(lens)
        g = torch.arange(B)[:, None] * self.T + torch.arange(self.T)[None, :]
        return g[..., None].float(), torch.tensor(lens)

    def project_encoder(self, encoder_out: torch.Tensor) -> torch.Tensor:
        return encoder_out.float()

    def project_decoder(self, contexts: torch.Tensor) -> torch.Tensor:
        return contexts[:, -1:].float()

    def join_projected(self, encoder_proj: torch.Tensor, decoder_proj: torch.Tensor) -> torch.Tensor:
        g, last = torch.broadcast_tensors(encoder_proj[..., 0], decoder_proj[..., 0])
        return self.table[g.long(), last.long()]


# token, frame, duration: two tokens on frame 3 (max_sym_per_frame 2), a token on the last frame
RNNT_SCRIPTS = [[(5, 1, 0), (7, 3, 0), (2, 3, 0), (9, 8, 0)], [], [(3, 0, 0), (4, 2, 0)]]
RNNT_ONE_PER_FRAME = [[(5, 1, 0), (7, 3, 0), (2, 4, 0), (9, 8, 0)], [], [(3, 0, 0), (4, 2, 0)]]
LENS = [9, 4, 5]
# TDT: durations 0 (another token on the frame), 1, 2, 4; blanks jump to the next token
TDT_DURATIONS = (0, 1, 2, 4)
TDT_SCRIPTS = [[(5, 0, 2), (6, 2, 0), (7, 2, 4), (8, 8, 1)], [(3, 1, 4)], []]
TDT_LENS = [10, 6, 3]


def _want(scripts, *, tdt=False):
    return [(tuple(k for k, _, _ in s), tuple(f for _, f, _ in s), tuple(d for _, _, d in s) if tdt else None)
            for s in scripts]


def _got(results):
    assert all(isinstance(r, DecodingResult) for r in results)
    return [(r.tokens, r.frames, r.durations) for r in results]


def _chunks(enc, lens, sizes):
    start = 0
    for n in sizes:
        yield enc[:, start: start + n], (lens - start).clamp(min=0, max=n)
        start += n


def test_rnnt_searches_give_the_scripted_frames():
    model = ScriptedTransducer(RNNT_SCRIPTS, T=max(LENS))
    enc, lens = model.encoder_out(LENS)
    want = _want(RNNT_SCRIPTS)
    assert _got(greedy_search(model, enc, lens, 2, return_results=True)) == want
    for window, static in ((1, False), (8, False), (8, True)):  # static: every row at every step (CUDA-graph shapes)
        looping = LabelLoopingGreedy(model, 2, window=window, static_shapes=static)
        assert _got(looping(enc, lens, return_results=True)) == want
    for static in (False, True):
        assert _got(malsd_beam_search(model, enc, lens, beam=3, max_sym_per_frame=2, static_shapes=static,
                                      return_results=True)) == want
    malsd = malsd_beam_search(model, enc, lens, beam=3, max_sym_per_frame=2, return_results=True)
    assert all(isinstance(r.score, float) and -1e-3 < r.score <= 0 for r in malsd)  # the script's probability ~1
    stream = StreamingGreedySearch(model, len(LENS), 2)
    for chunk, n in _chunks(enc, lens, [2, 1, 4, 2]):
        stream.accept(chunk, n)
    assert _got(stream.results()) == want
    # one symbol per frame: modified beam search (whole and chunked) and the frame-looping greedy search
    model = ScriptedTransducer(RNNT_ONE_PER_FRAME, T=max(LENS))
    want = _want(RNNT_ONE_PER_FRAME)
    for got in (greedy_search(model, enc, lens, return_results=True),
                modified_beam_search(model, enc, lens, beam=4, return_results=True)):
        assert _got(got) == want
    beam = StreamingModifiedBeamSearch(model, len(LENS), beam=4)
    for chunk, n in _chunks(enc, lens, [3, 3, 3]):
        beam.accept(chunk, n)
    assert _got(beam.results()) == want
    assert [r.score is None for r in greedy_search(model, enc, lens, return_results=True)] == [True] * 3


def test_tdt_searches_give_the_scripted_frames_and_durations():
    model = ScriptedTransducer(TDT_SCRIPTS, T=max(TDT_LENS), durations=TDT_DURATIONS)
    enc, lens = model.encoder_out(TDT_LENS)
    want = _want(TDT_SCRIPTS, tdt=True)
    assert _got(tdt_greedy_search(model, enc, lens, 2, return_results=True)) == want
    for static in (False, True):
        assert _got(TdtLabelLoopingGreedy(model, 2, static_shapes=static)(enc, lens, return_results=True)) == want
    assert _got(tdt_modified_beam_search(model, enc, lens, beam=3, max_sym_per_frame=2, return_results=True)) == want
    for static in (False, True):
        assert _got(malsd_beam_search(model, enc, lens, beam=3, max_sym_per_frame=2, static_shapes=static,
                                      return_results=True)) == want
    stream = StreamingTdtGreedySearch(model, len(TDT_LENS), 2)
    for chunk, n in _chunks(enc, lens, [1, 3, 2, 4]):
        stream.accept(chunk, n)
    assert _got(stream.results()) == want
    for method in ("greedy_search", "modified_beam_search", "malsd_batch"):
        options = DecodingOptions(method=method, beam=2, max_sym_per_frame=2)
        assert _got(decode_encoder_out(model, enc, lens, options, return_timestamps=True)) == want


def _spikes(runs: list[list[tuple[int, int, int]]], T: int, V: int = 6) -> torch.Tensor:
    """Log-probabilities (B, T, V): blank on every frame except the runs (token, first frame, last frame)."""
    logits = torch.zeros(len(runs), T, V)
    logits[:, :, 0] = SHARP
    for b, rs in enumerate(runs):
        for k, a, z in rs:
            logits[b, a: z + 1, 0] = 0.0
            logits[b, a: z + 1, k] = SHARP
    return logits.log_softmax(-1)


def test_ctc_frames_are_the_first_frame_of_each_spike():
    # token 1 repeated across a run and again after a blank; token 2 straight after token 1 (no blank between)
    runs = [[(1, 2, 4), (1, 6, 6), (2, 7, 9)], [], [(3, 0, 0), (5, 3, 4)]]
    lp, lens = _spikes(runs, 11), torch.tensor([11, 5, 6])
    want = [((1, 1, 2), (2, 6, 7), None), ((), (), None), ((3, 5), (0, 3), None)]
    assert _got(ctc_greedy_search(lp, lens, return_results=True)) == want
    for beam in (1, 3, 6):  # 6 = V: every token considered on every frame, token 1 among them from frame 0
        got = ctc_prefix_beam_search(lp, lens, beam, return_results=True)
        assert _got(got) == want
        assert got[1].score == pytest.approx(0.0, abs=1e-3) and got[0].score < 0
    for search in (StreamingCtcGreedySearch(3), StreamingCtcPrefixBeamSearch(3, beam=4)):
        for chunk, n in _chunks(lp, lens, [3, 1, 5, 2]):
            search.accept(chunk, n)
        assert _got(search.results()) == want


def _random_model(kit, seed, tdt=False):
    if not tdt:
        return kit.make_model(seed)
    torch.manual_seed(seed)
    joiner = Joiner(16, 16, 16, 6, durations=(0, 1, 2, 3))
    with torch.no_grad():
        for lin in (joiner.encoder_proj, joiner.decoder_proj, joiner.output_linear):
            lin.weight.mul_(4.0)
    return Transducer(kit.LinearEncoder(8, 16), Decoder(6, 16, blank_id=0, context_size=2), joiner,
                      loss=LossConfig(loss="tdt", tdt_durations=(0, 1, 2, 3))).eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_beam_1_gives_greedy_frames(kit, seed):
    lens = [7, 0, 12, 3]
    model = _random_model(kit, seed)
    enc, enc_lens = model.encode(*kit.make_batch(seed, lens))
    greedy = _got(greedy_search(model, enc, enc_lens, return_results=True))
    assert sum(len(g[0]) for g in greedy) > 5
    assert _got(modified_beam_search(model, enc, enc_lens, beam=1, return_results=True)) == greedy
    assert _got(malsd_beam_search(model, enc, enc_lens, beam=1, return_results=True)) == greedy
    tdt = _random_model(kit, seed, tdt=True)
    enc, enc_lens = tdt.encode(*kit.make_batch(seed, lens))
    greedy = _got(tdt_greedy_search(tdt, enc, enc_lens, 2, return_results=True))
    assert sum(len(g[0]) for g in greedy) > 5 and any(0 in g[2] for g in greedy)
    assert _got(tdt_modified_beam_search(tdt, enc, enc_lens, beam=1, max_sym_per_frame=2, return_results=True)) == greedy
    assert _got(malsd_beam_search(tdt, enc, enc_lens, beam=1, max_sym_per_frame=2, return_results=True)) == greedy


@pytest.mark.parametrize("tdt", [False, True])
@pytest.mark.parametrize("method", ["greedy_search", "modified_beam_search", "malsd_batch"])
def test_batched_results_equal_one_by_one(kit, tdt, method):
    lens = [5, 11, 0, 8]
    model = _random_model(kit, 3, tdt)
    enc, enc_lens = model.encode(*kit.make_batch(3, lens))
    for greedy_method in ("frame_looping", "label_looping"):
        options = DecodingOptions(method=method, beam=3, max_sym_per_frame=2, greedy_method=greedy_method)
        search = Searcher(model, options)
        batched = search(enc, enc_lens, return_timestamps=True)
        alone = [search(enc[i: i + 1, :n], enc_lens[i: i + 1], return_timestamps=True)[0] for i, n in enumerate(lens)]
        assert [(r.tokens, r.frames, r.durations) for r in batched] == [(r.tokens, r.frames, r.durations) for r in alone]
        for a, b in zip(batched, alone):
            assert (a.score is None) == (b.score is None) == (method == "greedy_search")
            if a.score is not None:
                assert a.score == pytest.approx(b.score, abs=1e-6)
        assert search(enc, enc_lens) == [list(r.tokens) for r in batched]  # the default stays token-id lists


def test_decoding_result_is_frozen_and_checked():
    r = DecodingResult([1, 2], [0, 3], None, None)
    assert r.tokens == (1, 2) and r.frames == (0, 3)
    with pytest.raises(Exception):
        r.tokens = (3,)
    with pytest.raises(ValueError, match="one frame .* per token"):
        DecodingResult((1, 2), (0,))
    with pytest.raises(ValueError, match="one frame .* per token"):
        DecodingResult((1,), (0,), (1, 2))
