"""LM / LODR / phrase fusion in every search: with every scale 0 the plain decoding, token for token; unpruned beam
searches against an enumeration of label sequences with the LM and phrase bonuses added by hand; greedy fusion against
a per-utterance loop; a hand-made CTC case where the LM must overturn the acoustic choice."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asrprec.decoding import (
    LabelLoopingGreedy, ctc_prefix_beam_search, greedy_search, modified_beam_search, tdt_greedy_search,
    tdt_modified_beam_search,
)
from asrprec.decoding.fusion import Fusion
from asrprec.lm import estimate_kneser_ney, load_arpa, write_arpa
from asrprec.models import Decoder, Joiner, LossConfig, Transducer

LENS = [7, 0, 12, 3, 12, 1]
VOCAB = 6
PIECES = ["<blk>", "<unk>", "a", "b", "c", "d"]


def _lm(tmp_path, order: int, seed: int, name: str):
    rng = random.Random(seed)
    sents = [[rng.choice("abcd") for _ in range(rng.randint(1, 6))] for _ in range(40)]
    return load_arpa(write_arpa(tmp_path / name, estimate_kneser_ney(sents, order)), PIECES)


def _fusion(tmp_path, lm_scale=0.0, lodr_scale=0.0, hotword_score=0.0, own=True) -> Fusion:
    return Fusion(vocab_size=VOCAB, lm=_lm(tmp_path, 3, 0, "lm.arpa"), lm_scale=lm_scale,
                  lodr=_lm(tmp_path, 2, 1, "lodr.arpa"), lodr_scale=lodr_scale, phrases=[[2, 3], [4, 4, 5]],
                  hotword_score=hotword_score,
                  phrases_by_cut={f"u{i}": [[3, 2, 5]] for i in range(0, len(LENS), 2)} if own else None)


def _batch(fusion: Fusion):
    return fusion.for_batch([f"u{i}" for i in range(len(LENS))])


def _tdt_model(kit, seed: int) -> Transducer:
    torch.manual_seed(seed)
    dim, durations = 16, (0, 1, 2, 3)
    joiner = Joiner(dim, dim, dim, VOCAB, durations=durations)
    with torch.no_grad():
        for lin in (joiner.encoder_proj, joiner.decoder_proj, joiner.output_linear):
            lin.weight.mul_(4.0)
            lin.bias.mul_(4.0)
    return Transducer(kit.LinearEncoder(8, dim), Decoder(VOCAB, dim, blank_id=0, context_size=2), joiner,
                      loss=LossConfig(loss="tdt", tdt_durations=durations)).eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_zero_is_plain_decoding_in_every_search(kit, tmp_path, seed):
    fusion = _batch(_fusion(tmp_path))
    model = kit.make_model(seed, blank_bias=0.5)
    feats, lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, lens)
    assert greedy_search(model, enc, enc_lens, 2, fusion=fusion) == greedy_search(model, enc, enc_lens, 2)
    looping = LabelLoopingGreedy(model, 2)
    assert looping(enc, enc_lens, fusion=fusion) == LabelLoopingGreedy(model, 2)(enc, enc_lens)
    plain = modified_beam_search(model, enc, enc_lens, beam=4, return_hypotheses=True)
    fused = modified_beam_search(model, enc, enc_lens, beam=4, return_hypotheses=True, fusion=fusion)
    for p, f in zip(plain, fused):
        assert [(h.tokens, h.log_prob) for h in p.sorted()] == [(h.tokens, h.log_prob) for h in f.sorted()]
    lp = torch.randn(len(LENS), max(LENS), VOCAB, generator=torch.Generator().manual_seed(seed)).mul(2).log_softmax(-1)
    plain = ctc_prefix_beam_search(lp, lens, 4, return_hypotheses=True)
    fused = ctc_prefix_beam_search(lp, lens, 4, return_hypotheses=True, fusion=fusion)
    for p, f in zip(plain, fused):
        assert [(h.tokens, h.log_prob) for h in p.sorted()] == [(h.tokens, h.log_prob) for h in f.sorted()]
    tdt = _tdt_model(kit, seed)
    enc, enc_lens = tdt.encode(feats, lens)
    assert tdt_greedy_search(tdt, enc, enc_lens, 2, fusion=fusion) == tdt_greedy_search(tdt, enc, enc_lens, 2)
    plain = tdt_modified_beam_search(tdt, enc, enc_lens, 3, 2, return_hypotheses=True)
    fused = tdt_modified_beam_search(tdt, enc, enc_lens, 3, 2, return_hypotheses=True, fusion=fusion)
    for p, f in zip(plain, fused):
        assert [(h.tokens, h.log_prob) for h in p] == [(h.tokens, h.log_prob) for h in f]


def _bonus_by_hand(fusion: Fusion, utt: int, tokens: tuple[int, ...], lm_scale: float, lodr_scale: float,
                   score: float) -> float:
    """λ·log p_lm(tokens) − μ·log p_lodr(tokens) (no </s>) + phrase bonus of completed phrases only (counted)."""
    total = lm_scale * fusion.lm.sentence_logprob(tokens, eos=False)
    total -= lodr_scale * fusion.lodr.sentence_logprob(tokens, eos=False)
    phrases = set(map(tuple, fusion.phrases)) | set(fusion.phrases_by_cut.get(f"u{utt}", ()))
    for p in phrases:
        total += score * len(p) * sum(tokens[e - len(p) : e] == p for e in range(len(p), len(tokens) + 1))
    return total


@pytest.mark.parametrize("seed", [0, 1])
def test_unpruned_modified_beam_search_adds_the_bonus_of_each_sequence(kit, tmp_path, seed):
    """Nothing pruned: each label sequence's score = its acoustic probability over all alignments (enumerated) plus
    its LM, LODR and completed-phrase bonus (computed here token by token from the models' own lookups)."""
    lam, mu, score = 0.7, 0.3, 0.9
    fusion = _fusion(tmp_path, lam, mu, score)
    model = kit.make_model(seed, vocab=VOCAB, logit_scale=1.0)
    lens = [3, 2]
    feats, feat_lens = kit.make_batch(seed, lens)
    enc, enc_lens = model.encode(feats, feat_lens)
    batch = fusion.for_batch([f"u{i}" for i in range(len(lens))])
    hyp_lists = modified_beam_search(model, enc, enc_lens, beam=400, return_hypotheses=True, fusion=batch)
    for i, n in enumerate(lens):
        want = kit.all_sequence_log_probs(model, enc[i, :n])
        got = {h.tokens: h.log_prob for h in hyp_lists[i]}
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k] == pytest.approx(v + _bonus_by_hand(fusion, i, k, lam, mu, score), abs=1e-4), k


def _ctc_sequences(lp: torch.Tensor) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    T, V = lp.shape
    import itertools

    for path in itertools.product(range(V), repeat=T):
        seq, prev = [], None
        for k in path:
            if k != 0 and k != prev:
                seq.append(k)
            prev = k
        s = float(sum(lp[t, k] for t, k in enumerate(path)))
        key = tuple(seq)
        out[key] = s if key not in out else max(out[key], s) + math.log1p(math.exp(-abs(out[key] - s)))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_unpruned_ctc_prefix_beam_search_adds_the_bonus_of_each_sequence(tmp_path, seed):
    lam, score = 0.8, 0.6
    fusion = _fusion(tmp_path, lam, 0.0, score)
    T = 3
    lp = torch.randn(2, T, VOCAB, generator=torch.Generator().manual_seed(seed)).log_softmax(-1).double()
    batch = fusion.for_batch(["u0", "u1"])
    hyps = ctc_prefix_beam_search(lp, torch.tensor([T, T]), 400, return_hypotheses=True, fusion=batch)
    for i in range(2):
        want = _ctc_sequences(lp[i])
        got = {h.tokens: h.log_prob for h in hyps[i]}
        assert set(got) == set(want)
        for k, v in want.items():
            # the phrase bonus the search holds includes a pending partial match, taken back at the end
            assert got[k] == pytest.approx(v + _bonus_by_hand(fusion, i, k, lam, 0.0, score), abs=1e-4), k


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_greedy_fusion_against_a_per_utterance_loop(kit, tmp_path, seed):
    """Frame-looping and label-looping greedy with fusion against a loop written from the rule: on each frame the
    acoustic argmax decides blank or not; a non-blank is the argmax of log p_am + bonus over non-blank tokens."""
    lam, mu, score = 1.5, 0.5, 2.0
    fusion = _fusion(tmp_path, lam, mu, score, own=False)
    model = kit.make_model(seed, vocab=VOCAB, blank_bias=0.5)
    feats, lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, lens)
    batch = fusion.for_batch([f"u{i}" for i in range(len(LENS))])
    got = greedy_search(model, enc, enc_lens, 1, fusion=batch)
    assert LabelLoopingGreedy(model, 1)(enc, enc_lens, fusion=batch) == got
    assert got != greedy_search(model, enc, enc_lens, 1)  # the bonus changes some choice here
    for i, n in enumerate(LENS):
        tokens: list[int] = []
        for t in range(n):
            lp = kit._log_probs(model, enc[i, t], tokens)
            if int(lp.argmax()) == 0:
                continue
            base = _bonus_by_hand_pending(fusion, tokens, lam, mu, score)
            best = max(range(1, VOCAB), key=lambda v: float(lp[v]) + _bonus_by_hand_pending(
                fusion, tokens + [v], lam, mu, score) - base)
            tokens.append(best)
        assert got[i] == tokens


def _bonus_by_hand_pending(fusion: Fusion, tokens: list[int], lam: float, mu: float, score: float) -> float:
    """As :func:`_bonus_by_hand` with the global phrases, plus the pending partial match (longest suffix that is a
    phrase prefix and no phrase)."""
    total = _bonus_by_hand(fusion, -1, tuple(tokens), lam, mu, score)
    phrases = set(map(tuple, fusion.phrases))
    prefixes = {p[:j] for p in phrases for j in range(1, len(p) + 1)}
    for k in range(len(tokens), 0, -1):
        suffix = tuple(tokens[len(tokens) - k :])
        if suffix in prefixes:
            return total + (score * k if suffix not in phrases else 0.0)
    return total


def test_the_lm_overturns_the_acoustic_choice_in_a_hand_made_case(tmp_path):
    """One frame, CTC: the acoustic model says a (0.55) over b (0.45); a bigram LM says b after <s> (0.9 against 0.05).
    log .55 + log .05 = -3.59 < log .45 + log .9 = -0.90: with λ = 1 the LM must win; with λ = 0, a."""
    path = tmp_path / "bigram.arpa"
    l10 = math.log10
    path.write_text("\\data\\\nngram 1=5\nngram 2=2\n\n\\1-grams:\n-1\t</s>\n-99\t<s>\t0\n-3\t<unk>\n"
                    f"-1\ta\n-1\tb\n\n\\2-grams:\n{l10(0.05):.6f}\t<s> a\n{l10(0.9):.6f}\t<s> b\n\n\\end\\\n")
    lm = load_arpa(path, ["<blk>", "<unk>", "a", "b"])
    lp = torch.tensor([[[math.log(1e-9), math.log(1e-9), math.log(0.55), math.log(0.45)]]]).log_softmax(-1)
    one = torch.tensor([1])
    for lam, want in ((0.0, [2]), (1.0, [3])):
        fusion = Fusion(vocab_size=4, lm=lm, lm_scale=lam).for_batch(["x"])
        assert ctc_prefix_beam_search(lp, one, 2, fusion=fusion) == [want]


def test_flags_files_and_cut_phrases_reach_the_batch(tmp_path):
    """--lm / --lodr / --hotwords are DecodeConfig fields; the files load through a real tokenizer's pieces and each
    cut's own phrases (cut.custom or a supervision's custom) compile into that utterance's trie only."""
    from types import SimpleNamespace

    from asrprec.decoding.experiment import decoding_command_line, result_tag
    from asrprec.lm import build_token_lm
    from asrprec.tokenizer import Tokenizer

    texts = ["the cat sat on the mat", "a dog sat on a log", "the dog and the cat"] * 20
    tok = Tokenizer.train(texts, tmp_path / "bpe", 30)
    build_token_lm(texts, tok, tmp_path / "lm3.arpa", 3)
    build_token_lm(texts, tok, tmp_path / "lm2.arpa", 2)
    (tmp_path / "hot.txt").write_text("# names\nthe cat\n\nsat on\n")
    cfg = decoding_command_line().parse(["--epoch", "1", "--lm", str(tmp_path / "lm3.arpa"), "--lm-scale", "0.5", "--lodr",
                         str(tmp_path / "lm2.arpa"), "--lodr-scale", "0.2", "--hotwords", str(tmp_path / "hot.txt"),
                                         "--hotword-score", "1.5"]).decode
    assert result_tag(cfg, "fp32").endswith("-lm-0.5-lodr-0.2-hot-1.5")
    fusion = cfg.fusion(tok)
    assert fusion.lm.order == 3 and fusion.lodr.order == 2 and fusion.lm_scale == 0.5 and fusion.lodr_scale == 0.2
    assert sorted(fusion.phrases) == sorted(map(tuple, tok.encode(["the cat", "sat on"])))
    cuts = [SimpleNamespace(id="c0", custom={"hotwords": "a dog|a log"}, supervisions=[]),
            SimpleNamespace(id="c1", custom=None, supervisions=[SimpleNamespace(custom={"hotwords": ["and"]})]),
            SimpleNamespace(id="c2", custom={}, supervisions=[])]
    fusion.with_cut_phrases(cuts, tok)
    batch = fusion.for_batch(["c2", "c0", "c1"])
    states = batch.start(torch.arange(3))
    dog = tok.encode("a dog")[0]
    got = []
    for row in range(3):
        s, total = states[row : row + 1], 0.0
        for t in dog:
            b, s = batch.step(s, torch.tensor([t]))
            total += float(b)
        got.append(total)
    lm_part = 0.5 * fusion.lm.sentence_logprob(dog, eos=False) - 0.2 * fusion.lodr.sentence_logprob(dog, eos=False)
    assert got[0] == pytest.approx(lm_part, abs=1e-4) and got[2] == pytest.approx(lm_part, abs=1e-4)
    assert got[1] == pytest.approx(lm_part + 1.5 * len(dog), abs=1e-4)  # only c0 has "a dog"


def test_ctc_prefix_beam_search_boosts_a_phrase_the_acoustic_model_ranks_below_the_beam(tmp_path):
    """Beam 2 over hand-made frames where the phrase's token (3, "b") is never among the two most probable: boosting
    must still find the sequence an enumeration of every label sequence ranks first with the bonus added by hand."""
    lp = torch.full((1, 3, VOCAB), -6.0, dtype=torch.float64)
    lp[0, :, 0] = -0.2  # blank first on every frame
    lp[0, 0, 2], lp[0, 1, 4], lp[0, 2, 5] = -1.9, -1.8, -2.0  # then "a", "c", "d"
    lp[0, 1, 3] = -2.6  # "b", third on its frame: outside a beam of 2
    lp = lp.log_softmax(-1)
    lens = torch.tensor([3])
    fusion = Fusion(vocab_size=VOCAB, phrases=[[3]], hotword_score=4.0)
    assert 3 not in ctc_prefix_beam_search(lp, lens, 2)[0]
    best = ctc_prefix_beam_search(lp, lens, 2, fusion=fusion.for_batch(["u0"]))[0]
    # by hand: every label sequence's summed alignment probability, + 4 for each "b" (a complete phrase)
    want = max(_ctc_sequences(lp[0]).items(), key=lambda kv: kv[1] + 4.0 * kv[0].count(3))[0]
    assert 3 in want and tuple(best) == want
    no_phrase = Fusion(vocab_size=VOCAB, phrases=[[3]], hotword_score=0.0)  # the same search without a bonus
    assert ctc_prefix_beam_search(lp, lens, 2, fusion=no_phrase.for_batch(["u0"])) == ctc_prefix_beam_search(lp, lens, 2)
