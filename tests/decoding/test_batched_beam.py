"""malsd_batch (the batched ALSD beam search): beam 1 against greedy search (RNN-T and TDT), an unpruned beam against
the best label sequence of an exhaustive sum over every decoding path (RNN-T with forced blanks, TDT with durations
on a joint biased to jumps of 2-4 frames), batching, fusion at scale 0, and the named method."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from asrprec.decoding import (
    DecodingOptions, decode_encoder_out, greedy_search, malsd_beam_search, modified_beam_search, tdt_greedy_search,
    tdt_modified_beam_search,
)
from asrprec.decoding.batched_beam import MalsdBeamSearch
from asrprec.decoding.fusion import Fusion
from asrprec.models import Decoder, Joiner, LossConfig, Transducer

LENS = [7, 0, 12, 3, 12, 1]


def tdt_model(kit, seed: int, durations=(0, 1, 2, 3, 4), vocab: int = 6, duration_bias=None,
              logit_scale: float = 4.0) -> Transducer:
    torch.manual_seed(seed)
    dim = 16
    joiner = Joiner(dim, dim, dim, vocab, durations=durations)
    with torch.no_grad():
        for lin in (joiner.encoder_proj, joiner.decoder_proj):
            lin.weight.mul_(4.0)
            lin.bias.mul_(4.0)
        joiner.output_linear.weight.mul_(logit_scale)
        joiner.output_linear.bias.mul_(logit_scale)
        for i, b in enumerate(duration_bias or ()):
            joiner.output_linear.bias[vocab + i] += b
    return Transducer(kit.LinearEncoder(8, dim), Decoder(vocab, dim, blank_id=0, context_size=2), joiner,
                      loss=LossConfig(loss="tdt", tdt_durations=durations)).eval()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("max_sym", [1, 3])
def test_beam_1_equals_greedy(kit, seed, max_sym):
    model = kit.make_model(seed, blank_bias=float(seed % 3) - 1.0)
    feats, lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, lens)
    assert malsd_beam_search(model, enc, enc_lens, 1, max_sym) == greedy_search(model, enc, enc_lens, max_sym)
    tdt = tdt_model(kit, seed)
    enc, enc_lens = tdt.encode(feats, lens)
    assert malsd_beam_search(tdt, enc, enc_lens, 1, max_sym) == tdt_greedy_search(tdt, enc, enc_lens, max_sym)


@torch.no_grad()
def _rnnt_log_probs(model, frame, tokens):
    C, blank = model.decoder.context_size, model.decoder.blank_id
    ctx = ([blank] * C + list(tokens))[-C:]
    dec = model.decoder(torch.tensor([ctx]), need_pad=False)[0, 0]
    return model.join(frame, dec).double()


def rnnt_sequence_score(model, enc, y, S):
    """log Σ over paths emitting y with at most S labels per frame: a blank moves one frame on, and so does the S-th
    label of a frame (no blank scored after it, as greedy search and modified beam search with one symbol a frame)."""
    T, U, blank = enc.shape[0], len(y), model.decoder.blank_id

    @functools.lru_cache(maxsize=None)
    def go(t, u, s):
        if t == T:
            return 0.0 if u == U else -math.inf
        lp = _rnnt_log_probs(model, enc[t], y[:u]).log_softmax(-1)
        out = float(lp[blank]) + go(t + 1, u, 0)
        if u < U:
            nxt = go(t + 1, u + 1, 0) if s + 1 >= S else go(t, u + 1, s + 1)
            out = _logadd(out, float(lp[y[u]]) + nxt)
        return out

    return go(0, 0, 0)


def tdt_sequence_score(model, enc, y, S):
    """log Σ over TDT paths emitting y (the rules of asrprec.decoding.tdt: blank jumps max(d, 1); a label of duration
    0 stays, or jumps 1 when it is the S-th on its frame; a jump to or past T ends the path)."""
    T, U, blank, V = enc.shape[0], len(y), model.decoder.blank_id, model.decoder.vocab_size
    durations = list(model.joiner.durations)

    @functools.lru_cache(maxsize=None)
    def go(t, u, s):
        if t >= T:
            return 0.0 if u == U else -math.inf
        out = _rnnt_log_probs(model, enc[t], y[:u])
        lp, lpd = out[:V].log_softmax(-1), out[V:].log_softmax(-1)
        total = -math.inf
        for i, d in enumerate(durations):
            total = _logadd(total, float(lp[blank] + lpd[i]) + go(t + max(d, 1), u, 0))
            if u < U:
                s2 = s + 1 if d == 0 else 0
                j = d
                if d == 0 and s2 >= S:
                    j, s2 = 1, 0
                total = _logadd(total, float(lp[y[u]] + lpd[i]) + go(t + j, u + 1, s2))
        return total

    return go(0, 0, 0)


def _logadd(a, b):
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


def _best_by_enumeration(score, labels, max_len):
    best, best_y = -math.inf, None
    for n in range(max_len + 1):
        for y in itertools.product(labels, repeat=n):
            s = score(tuple(y))
            if s > best:
                best, best_y = s, list(y)
    return best_y, best


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_unpruned_beam_finds_the_best_sequence_of_an_exhaustive_sum(kit, seed):
    """A beam wider than every (sequence, frame) state prunes nothing and merges equal sequences on a frame, so its
    best hypothesis is the label sequence with the highest probability summed over every path."""
    S, T = 2, 3
    model = kit.make_model(seed, vocab=3, logit_scale=1.5)
    feats, lens = kit.make_batch(seed, [T])
    enc, enc_lens = model.encode(feats, lens)
    want_y, want = _best_by_enumeration(lambda y: rnnt_sequence_score(model, enc[0], y, S), (1, 2), T * S)
    (got,), (score,) = malsd_beam_search(model, enc, enc_lens, 256, S, length_norm=False, return_scores=True)
    assert got == want_y and score == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_tdt_durations_are_honoured(kit, seed):
    """A joint biased to durations 2-4 (0 and 1 made unlikely): the unpruned beam's best equals the best sequence of
    an exhaustive sum over every TDT path with those jumps; beam 1 makes greedy search's jumps."""
    S, T = 1, 6  # one label per frame: at most T labels, so 2^(T+1) - 1 sequences, all within the beam
    model = tdt_model(kit, seed, vocab=3, duration_bias=(-3.0, -3.0, 2.0, 2.0, 2.0), logit_scale=1.5)
    feats, lens = kit.make_batch(seed, [T])
    enc, enc_lens = model.encode(feats, lens)
    want_y, want = _best_by_enumeration(lambda y: tdt_sequence_score(model, enc[0], y, S), (1, 2), T)
    (got,), (score,) = malsd_beam_search(model, enc, enc_lens, 512, S, length_norm=False, return_scores=True)
    assert got == want_y and score == pytest.approx(want, abs=1e-5)
    assert malsd_beam_search(model, enc, enc_lens, 1, S) == tdt_greedy_search(model, enc, enc_lens, S)


def test_tdt_alignments_of_one_sequence_merge_on_their_frame(kit):
    """A joint that ignores its inputs: blank 0.9, durations 1 and 2 equally likely (0 all but impossible). At beam 2
    the empty sequence's alignments (every way to cover T frames with jumps of 1 and 2) leave the beam as two
    hypotheses on different frames; taken frame by frame they meet again and merge, so the best hypothesis's score is
    the sum over all of them: log Σ over compositions of T into 1s and 2s (2·0.45 per jump, the last jump may
    overshoot), computed by the enumeration of every TDT path."""
    T = 9
    model = tdt_model(kit, 0, durations=(0, 1, 2), vocab=3)
    with torch.no_grad():
        model.joiner.output_linear.weight.zero_()
        model.joiner.output_linear.bias.copy_(torch.tensor([0.9, 0.05, 0.05, 1e-30, 0.5, 0.5]).log())
    feats, lens = kit.make_batch(0, [T])
    enc, enc_lens = model.encode(feats, lens)
    want = tdt_sequence_score(model, enc[0], (), 1)
    (got,), (score,) = malsd_beam_search(model, enc, enc_lens, 2, 1, length_norm=False, return_scores=True)
    assert got == [] and score == pytest.approx(want, abs=1e-6)  # fp32 log-softmax


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_sym", [1, 2])
def test_tdt_equals_the_frame_by_frame_modified_beam_search(kit, seed, max_sym):
    """On a TDT model malsd_batch keeps modified beam search's rules (the earliest frame's best `beam` hypotheses
    expand, their candidates compete for `beam` places, equal sequences on a frame merge), so the two, written apart
    (per-frame dictionaries against one tensor step for the batch), decode alike, durations included."""
    model = tdt_model(kit, seed, logit_scale=2.0)
    feats, lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, lens)
    for beam in (2, 4):
        want = tdt_modified_beam_search(model, enc, enc_lens, beam, max_sym, return_results=True)
        got = malsd_beam_search(model, enc, enc_lens, beam, max_sym, return_results=True)
        assert [(r.tokens, r.durations) for r in got] == [(r.tokens, r.durations) for r in want]
        assert [r.score for r in got] == pytest.approx([r.score for r in want], abs=1e-5)
    assert sum(len(r.tokens) for r in got) > 4


def test_tdt_with_an_lm_and_a_phrase_equals_modified_beam_search(kit, tmp_path):
    """The same with LM, LODR and a hot phrase: both add the bonuses to the labels and give an unfinished phrase's
    back at the end."""
    from asrprec.lm import estimate_kneser_ney, load_arpa, write_arpa

    lm = load_arpa(write_arpa(tmp_path / "lm.arpa", estimate_kneser_ney([["a", "b", "c"], ["b", "d"]], 3)),
                   ["<blk>", "<unk>", "a", "b", "c", "d"])
    fusion = Fusion(vocab_size=6, lm=lm, lm_scale=0.5, lodr=lm, lodr_scale=0.2, phrases=[[2, 3]],
                    hotword_score=1.5).for_batch([str(i) for i in range(len(LENS))])
    model = tdt_model(kit, 4, logit_scale=2.0)
    feats, lens = kit.make_batch(4, LENS)
    enc, enc_lens = model.encode(feats, lens)
    want = tdt_modified_beam_search(model, enc, enc_lens, 3, 1, return_results=True, fusion=fusion)
    got = malsd_beam_search(model, enc, enc_lens, 3, 1, return_results=True, fusion=fusion)
    assert [(r.tokens, r.durations) for r in got] == [(r.tokens, r.durations) for r in want]
    assert [r.score for r in got] == pytest.approx([r.score for r in want], abs=1e-5)
    assert got != malsd_beam_search(model, enc, enc_lens, 3, 1, return_results=True)  # the bonuses changed something


@pytest.mark.parametrize("beam", [2, 4])
def test_batched_equals_one_by_one(kit, beam):
    for model in (kit.make_model(7, blank_bias=1.0), tdt_model(kit, 7)):
        feats, lens = kit.make_batch(7, LENS)
        enc, enc_lens = model.encode(feats, lens)
        batched = malsd_beam_search(model, enc, enc_lens, beam, 2)
        assert malsd_beam_search(model, enc, enc_lens, beam, 2, static_shapes=True) == batched  # the CUDA layout
        for i, n in enumerate(LENS):
            assert malsd_beam_search(model, enc[i : i + 1, :n], enc_lens[i : i + 1], beam, 2) == [batched[i]]


def test_fusion_at_scale_zero_and_the_named_method(kit, tmp_path):
    from asrprec.lm import estimate_kneser_ney, load_arpa, write_arpa

    lm = load_arpa(write_arpa(tmp_path / "lm.arpa", estimate_kneser_ney([["a", "b", "c"], ["b", "d"]], 3)),
                   ["<blk>", "<unk>", "a", "b", "c", "d"])
    fusion = Fusion(vocab_size=6, lm=lm, lm_scale=0.0, lodr=lm, lodr_scale=0.0, phrases=[[2, 3]],
                    hotword_score=0.0).for_batch([str(i) for i in range(len(LENS))])
    model = kit.make_model(3, blank_bias=0.5)
    feats, lens = kit.make_batch(3, LENS)
    enc, enc_lens = model.encode(feats, lens)
    plain = malsd_beam_search(model, enc, enc_lens, 4, 1, return_scores=True)
    assert malsd_beam_search(model, enc, enc_lens, 4, 1, return_scores=True, fusion=fusion) == plain
    options = DecodingOptions(method="malsd_batch", beam=4)
    assert decode_encoder_out(model, enc, enc_lens, options) == plain[0]


@pytest.mark.parametrize("max_sym", [1, 2])
def test_compiled_cpu_step_equals_the_tensor_form(kit, max_sym):
    """The eager CPU search (bookkeeping in one numba call) and the static tensor form (what a CUDA graph replays)
    are written apart; both give the same tokens, frames, durations and scores (to the rounding of fp32 joiner and
    decoder calls on other rows), merges included."""
    for model in (kit.make_model(5, blank_bias=0.5), tdt_model(kit, 5)):
        feats, lens = kit.make_batch(5, LENS)
        enc, enc_lens = model.encode(feats, lens)
        for beam in (1, 3, 6):
            eager = MalsdBeamSearch(model, beam, max_sym)
            assert eager._static is False
            got = eager(enc, enc_lens, return_results=True)
            assert eager._arrays is not None  # the compiled step ran
            want = malsd_beam_search(model, enc, enc_lens, beam, max_sym, static_shapes=True, return_results=True)
            assert [(r.tokens, r.frames, r.durations) for r in got] == [(r.tokens, r.frames, r.durations) for r in want]
            assert [r.score for r in got] == pytest.approx([r.score for r in want], abs=1e-5)  # fp32 calls on other rows
            assert sum(len(r.tokens) for r in got) > 10


def test_one_search_over_many_batches(kit):
    """One MalsdBeamSearch over batches of other sizes: its static state keeps its addresses and takes a smaller batch
    in its first rows (as a replayed CUDA graph does), the eager one keeps its decoder outputs between calls; both
    decode each batch as a one-off call does, and a changed weight drops the kept decoder outputs."""
    model = kit.make_model(11, blank_bias=0.5)
    batches = [kit.make_batch(s, lens) for s, lens in ((1, LENS), (2, [4, 9]), (3, [12, 2, 6, 6, 1, 8, 3]))]
    static, eager = MalsdBeamSearch(model, 3, 2, static_shapes=True), MalsdBeamSearch(model, 3, 2)
    ptrs = None
    for feats, lens in batches + batches[:1]:
        enc, enc_lens = model.encode(feats, lens)
        want = malsd_beam_search(model, enc, enc_lens, 3, 2, return_scores=True)
        got = static(enc, enc_lens, return_scores=True)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-5)
        got = eager(enc, enc_lens, return_scores=True)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-5)
        if static.state.enc.shape[0] == 7:  # the largest batch allocated the state: from then on it stays put
            ptrs = ptrs or static.state.data_ptrs()
            assert static.state.data_ptrs() == ptrs
    assert static.state.enc.shape[:2] == (7, 12) and ptrs is not None
    enc, enc_lens = model.encode(*batches[0])
    before = malsd_beam_search(model, enc, enc_lens, 3, 2)
    with torch.no_grad():
        model.decoder.embedding.weight.mul_(-3.0)
    want = malsd_beam_search(model, enc, enc_lens, 3, 2, return_scores=True)
    assert want[0] != before  # kept outputs of the old weights would decode differently
    got = eager(enc, enc_lens, return_scores=True)
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-5)


def test_a_model_built_under_inference_mode_decodes(kit):
    """decode.py builds and loads its model under torch.inference_mode, whose tensors keep no version counter; the
    search's decoder cache must still work, and give what the same weights give outside it."""
    want_model = kit.make_model(5)
    feats, lens = kit.make_batch(5, LENS)
    with torch.no_grad():
        want = modified_beam_search(want_model, *want_model.encode(feats, lens), beam=4)
    with torch.inference_mode():
        model = kit.make_model(5)
        model.load_state_dict(want_model.state_dict())
        enc, enc_lens = model.encode(feats, lens)
        assert malsd_beam_search(model, enc, enc_lens, 4, 1) == want
        assert malsd_beam_search(model, enc, enc_lens, 4, 1) == want  # the second call reuses the cache


def test_a_searcher_keeps_one_search_for_its_batches(kit):
    """decode.py's Searcher holds one MalsdBeamSearch for the run (its state, decoder outputs by context and, on CUDA,
    its graph); each batch decodes as a one-off call does, for RNN-T and TDT."""
    from asrprec.decoding import Searcher

    for model in (kit.make_model(9, blank_bias=0.5), tdt_model(kit, 9)):
        searcher = Searcher(model, DecodingOptions(method="malsd_batch", beam=3, max_sym_per_frame=2))

        def held():  # the MalsdBeamSearch the searcher's batch search calls
            (search,) = [c.cell_contents for c in searcher._search.__closure__
                         if isinstance(c.cell_contents, MalsdBeamSearch)]
            return search

        kept = {id(held())}
        for seed, lens in ((1, LENS), (2, [4, 9]), (3, [12, 2, 6, 6, 1, 8, 3])):
            enc, enc_lens = model.encode(*kit.make_batch(seed, lens))
            want = malsd_beam_search(model, enc, enc_lens, 3, 2, return_results=True)
            got = searcher(enc, enc_lens, return_timestamps=True)
            assert [(r.tokens, r.frames, r.durations) for r in got] == [(r.tokens, r.frames, r.durations) for r in want]
            kept.add(id(held()))
        assert len(kept) == 1
