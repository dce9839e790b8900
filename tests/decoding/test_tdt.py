"""TDT decoding: batched greedy search against a per-utterance loop written from the rules, label looping and
chunk-by-chunk streaming against it, beam 1 against greedy, a wide beam against an enumeration of every decoding
path, the dispatch of the named methods, and every precision policy on real encoders."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asrprec.decoding import (
    DecodingOptions, StreamingTdtGreedySearch, TdtLabelLoopingGreedy, decode_encoder_out, is_tdt,
    tdt_greedy_search, tdt_label_looping_greedy_search, tdt_modified_beam_search,
)
from asrprec.models import Decoder, Joiner, LossConfig, Transducer, build_transducer
from asrprec.precision import POLICIES, get_policy

LENS = [7, 0, 12, 3, 12, 1]
DURATION_SETS = [(0, 1, 2, 3, 4), (1, 2), (0, 1), (0, 1, 2, 4, 8)]


def make_tdt_model(kit, seed: int, durations=(0, 1, 2, 3, 4), *, vocab: int = 6, context_size: int = 2,
                   blank_bias: float = 0.0, stay_bias: float = 0.0, logit_scale: float = 4.0) -> Transducer:
    """A random tiny TDT transducer (the kit's stand-in encoder, the real decoder and joiner). ``blank_bias`` shifts
    the blank logit, ``stay_bias`` the logit of duration 0 (to make tokens stay on their frame)."""
    torch.manual_seed(seed)
    dim = 16
    joiner = Joiner(dim, dim, dim, vocab, durations=durations)
    with torch.no_grad():
        for lin in (joiner.encoder_proj, joiner.decoder_proj):  # undo the training-time small start
            lin.weight.mul_(4.0)
            lin.bias.mul_(4.0)
        joiner.output_linear.weight.mul_(logit_scale)
        joiner.output_linear.bias.mul_(logit_scale)
        joiner.output_linear.bias[0] += blank_bias
        if 0 in durations:
            joiner.output_linear.bias[vocab + durations.index(0)] += stay_bias
    return Transducer(kit.LinearEncoder(8, dim), Decoder(vocab, dim, blank_id=0, context_size=context_size), joiner,
                      loss=LossConfig(loss="tdt", tdt_durations=durations)).eval()


@torch.no_grad()
def _scores(model, frame: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 token and duration log-probs at one encoder frame (D_enc,) after ``tokens``, through the full
    ``model.join`` path (projections included), one utterance at a time."""
    C, blank, V = model.decoder.context_size, model.blank_id, model.vocab_size
    ctx = ([blank] * C + tokens)[-C:]
    dec = model.decoder(torch.tensor([ctx]), need_pad=False)[0, 0]
    out = model.join(frame, dec).double()
    return out[:V].log_softmax(-1), out[V:].log_softmax(-1)


def naive_tdt_greedy(model, enc: torch.Tensor, max_sym: int) -> tuple[list[int], list[int], int]:
    """The rules of asrprec.decoding.tdt, one utterance (T, D_enc), one frame at a time: (tokens, frames, steps)."""
    durations, blank = model.durations, model.blank_id
    t, sym, steps, tokens, frames = 0, 0, 0, [], []
    while t < enc.shape[0]:
        lp, lp_dur = _scores(model, enc[t], tokens)
        k, d = int(lp.argmax()), durations[int(lp_dur.argmax())]
        steps += 1
        if k == blank:
            t, sym = t + max(d, 1), 0
            continue
        tokens.append(k)
        frames.append(t)
        if d > 0:
            t, sym = t + d, 0
        elif sym + 1 == max_sym:
            t, sym = t + 1, 0
        else:
            sym += 1
    return tokens, frames, steps


def _chunks(enc, enc_lens, seed):
    g = torch.Generator().manual_seed(seed)
    start = 0
    while start < enc.shape[1]:
        n = int(torch.randint(1, 5, (1,), generator=g))
        yield enc[:, start: start + n], (enc_lens - start).clamp(min=0, max=n)
        start += n


# (seed, context size, blank bias, duration-0 bias, durations): every duration set once, with and without 0, and
# models that emit rarely, often, and several tokens on one frame
CASES = [(0, 2, 0.0, 0.0, d) for d in DURATION_SETS] + [(1, 1, 0.0, 4.0, (0, 1, 2, 3, 4)),
                                                       (2, 3, -1.0, 2.0, (0, 1, 2, 3, 4)), (1, 2, 1.0, 0.0, (0, 1))]


@pytest.mark.parametrize("max_sym", [1, 3])
@pytest.mark.parametrize("seed,context_size,blank_bias,stay_bias,durations", CASES)
def test_greedy_label_looping_streaming_beam1_match_naive(kit, max_sym, seed, context_size, blank_bias, stay_bias,
                                                          durations):
    model = make_tdt_model(kit, seed, durations, context_size=context_size, blank_bias=blank_bias,
                           stay_bias=stay_bias)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    want = [naive_tdt_greedy(model, enc[i, :n], max_sym) for i, n in enumerate(LENS)]
    tokens, frames = [w[0] for w in want], [w[1] for w in want]
    assert sum(map(len, tokens)) >= 5  # the comparison means something

    assert tdt_greedy_search(model, enc, enc_lens, max_sym, return_timestamps=True) == (tokens, frames)
    for static in (False, True):  # only the rows that move, or every row at every step (what a CUDA graph runs)
        search = TdtLabelLoopingGreedy(model, max_sym, static_shapes=static)
        assert search(enc, enc_lens, return_timestamps=True) == (tokens, frames)
        assert search.frame_stats() == {"frames": sum(LENS), "joiner_steps": sum(w[2] for w in want)}
        assert search(enc[:3], enc_lens[:3]) == tokens[:3]  # the same instance, a smaller batch
    assert tdt_label_looping_greedy_search(model, enc, enc_lens, max_sym) == tokens
    stream = StreamingTdtGreedySearch(model, len(LENS), max_sym)
    for chunk, chunk_lens in _chunks(enc, enc_lens, seed):
        stream.accept(chunk, chunk_lens)
    assert (stream.hyps, stream.timestamps) == (tokens, frames)
    assert tdt_modified_beam_search(model, enc, enc_lens, beam=1, max_sym_per_frame=max_sym) == tokens
    if stay_bias >= 4.0 and 0 in durations:  # tokens stay on their frame: the cap is exercised
        assert any(len(set(f)) < len(f) for f in frames) == (max_sym > 1)


def test_durations_skip_frames(kit):
    """A model that predicts long jumps evaluates the joiner on fewer frames than the utterances have."""
    model = make_tdt_model(kit, 0, (1, 2, 3, 4))
    with torch.no_grad():
        model.joiner.output_linear.bias[model.vocab_size + 3] += 20.0  # duration 4 wins everywhere
    feats, feat_lens = kit.make_batch(0, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    search = TdtLabelLoopingGreedy(model)
    _, frames = search(enc, enc_lens, return_timestamps=True)
    assert all(b - a == 4 for f in frames for a, b in zip(f, f[1:]))
    assert search.frame_stats()["joiner_steps"] == sum(math.ceil(n / 4) for n in LENS)


def _all_paths(model, enc: torch.Tensor, max_sym: int) -> dict[tuple[int, ...], float]:
    """Every decoding path of one utterance under the rules (each (token, duration) pair at each visited frame, blank
    with duration 0 moving one frame, the cap on tokens per frame), summed by label sequence in float64."""
    durations, blank, T = model.durations, model.blank_id, enc.shape[0]
    out: dict[tuple[int, ...], float] = {}

    def walk(t, sym, tokens, score):
        if t >= T:
            key = tuple(tokens)
            out[key] = math.log(math.exp(out[key]) + math.exp(score)) if key in out else score
            return
        lp, lp_dur = _scores(model, enc[t], tokens)
        for k in range(model.vocab_size):
            for j, d in enumerate(durations):
                s = score + float(lp[k]) + float(lp_dur[j])
                if k == blank:
                    walk(t + max(d, 1), 0, tokens, s)
                elif d == 0 and sym + 1 < max_sym:
                    walk(t, sym + 1, tokens + [k], s)
                else:
                    walk(t + (d if d else 1), 0, tokens + [k], s)

    walk(0, 0, [], 0.0)
    return out


@pytest.mark.parametrize("durations,max_sym,lens", [((1, 2), 1, [4, 2]), ((0, 1), 2, [3, 1]), ((0, 1, 3), 1, [3])])
def test_wide_beam_equals_path_enumeration(kit, durations, max_sym, lens):
    """With a beam wider than every candidate set nothing is pruned: each finished label sequence's score is its
    probability summed over every decoding path (enumerated one by one), and the scores sum to probability 1."""
    model = make_tdt_model(kit, 3, durations, vocab=3, logit_scale=1.0)
    feats, feat_lens = kit.make_batch(3, lens)
    enc, enc_lens = model.encode(feats, feat_lens)
    hyps = tdt_modified_beam_search(model, enc, enc_lens, beam=10_000, max_sym_per_frame=max_sym,
                                    return_hypotheses=True)
    for i, n in enumerate(lens):
        want = _all_paths(model, enc[i, :n], max_sym)
        got = {h.tokens: h.log_prob for h in hyps[i]}
        assert set(got) == set(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-5)
        assert math.log(sum(math.exp(v) for v in got.values())) == pytest.approx(0.0, abs=1e-5)
        C = model.decoder.context_size
        one = (enc[i: i + 1, :n], enc_lens[i: i + 1])
        best_norm = max(want, key=lambda k: want[k] / (C + len(k)))
        best_raw = max(want, key=want.get)
        assert tdt_modified_beam_search(model, *one, beam=10_000, max_sym_per_frame=max_sym)[0] == list(best_norm)
        assert tdt_modified_beam_search(model, *one, beam=10_000, max_sym_per_frame=max_sym,
                                        length_norm=False)[0] == list(best_raw)


def test_named_methods_dispatch_on_the_joiner(kit):
    """greedy_search / modified_beam_search on a TDT model run the TDT searches; an RNN-T model is refused by them."""
    model = make_tdt_model(kit, 0)
    feats, feat_lens = kit.make_batch(0, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    assert is_tdt(model)
    assert decode_encoder_out(model, enc, enc_lens, DecodingOptions()) == tdt_greedy_search(model, enc, enc_lens)
    beam = DecodingOptions(method="modified_beam_search", beam=3)
    assert decode_encoder_out(model, enc, enc_lens, beam) == tdt_modified_beam_search(model, enc, enc_lens, 3)
    rnnt = kit.make_model(0)
    assert not is_tdt(rnnt)
    for search in (tdt_greedy_search, tdt_modified_beam_search):
        with pytest.raises(ValueError, match="no duration head"):
            search(rnnt, enc, enc_lens)
    with pytest.raises(ValueError, match="max_sym_per_frame"):
        tdt_greedy_search(model, enc, enc_lens, 0)
    with pytest.raises(ValueError, match="beam"):
        tdt_modified_beam_search(model, enc, enc_lens, beam=0)


def test_default_tokens_per_frame_are_nemos_for_tdt_and_icefalls_for_rnnt(kit):
    """Options that leave ``max_sym_per_frame`` unset decode a TDT model with NeMo's cap of 10 tokens per frame (the
    naive one-frame-at-a-time rules above), an RNN-T model with icefall's 1; on a model that stays on its frames the
    two caps give different words, and an explicit cap is kept."""
    from asrprec.decoding import TDT_MAX_SYM_PER_FRAME
    from asrprec.export.runtime import TDT_MAX_SYM_PER_FRAME as RUNTIME_DEFAULT

    assert TDT_MAX_SYM_PER_FRAME == RUNTIME_DEFAULT == 10  # onnxruntime's TDT greedy decodes as asrprec does
    model = make_tdt_model(kit, 1, stay_bias=4.0)  # duration 0 likely: several tokens on one frame
    feats, feat_lens = kit.make_batch(0, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    got = decode_encoder_out(model, enc, enc_lens, DecodingOptions())
    want = [naive_tdt_greedy(model, enc[i, :n], 10)[0] for i, n in enumerate(enc_lens.tolist())]
    capped = [naive_tdt_greedy(model, enc[i, :n], 1)[0] for i, n in enumerate(enc_lens.tolist())]
    assert got == want and want != capped
    assert decode_encoder_out(model, enc, enc_lens, DecodingOptions(max_sym_per_frame=1)) == capped
    assert DecodingOptions().for_head("rnnt").max_sym_per_frame == 1
    assert DecodingOptions().for_head("tdt").max_sym_per_frame == 10
    assert DecodingOptions(max_sym_per_frame=3).for_head("tdt").max_sym_per_frame == 3


@pytest.mark.parametrize("encoder", ["zipformer", "conformer"])
def test_every_policy_label_looping_equals_greedy(encoder):
    """Each policy's inference model (fp32, fp16 and bf16 casts) and an fp32 model under bf16 autocast: label looping
    and the batched greedy search agree one utterance at a time (the same joiner calls, so the same rounding), and
    batched in fp32 (in fp16 a joiner call on another number of rows may round a near-tie the other way)."""
    torch.manual_seed(0)
    model = build_transducer(encoder=encoder, size="tiny", vocab_size=24, loss={"loss": "tdt"}).eval()
    with torch.no_grad():
        model.joiner.output_linear.weight.mul_(8.0)
        model.joiner.encoder_proj.weight.mul_(4.0)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(3, 120, 80, generator=g) * 5
    feat_lens = torch.tensor([120, 37, 90])
    variants = [(name, get_policy(name).prepare_for_inference(copy.deepcopy(model)), None) for name in POLICIES]
    variants.append(("autocast-bf16", model, get_policy("amp-bf16")))
    for name, m, autocast in variants:
        with torch.no_grad(), (autocast.autocast() if autocast else torch.autocast("cpu", enabled=False)):
            enc, enc_lens = m.encode(feats, feat_lens)
            want = tdt_greedy_search(m, enc, enc_lens, 2, return_timestamps=True)
            assert sum(map(len, want[0])) > 5, name
            search = TdtLabelLoopingGreedy(m, 2)
            if name == "fp32":
                assert search(enc, enc_lens, return_timestamps=True) == want
            for i, n in enumerate(feat_lens.tolist()):
                one = (enc[i: i + 1, : int(enc_lens[i])], enc_lens[i: i + 1])
                assert search(*one, return_timestamps=True) == tdt_greedy_search(m, *one, 2, return_timestamps=True)


def test_decode_config_names_an_explicit_cap_and_refuses_a_bad_one():
    """decode.py's ``--max-sym-per-frame``: unset, the result files keep their names; a cap given is named in them
    (two caps must not overwrite each other's files), CTC searches excepted; below 1 it is one error naming the fix."""
    from asrprec.decoding.experiment import DecodeConfig, result_tag

    assert "max-sym" not in result_tag(DecodeConfig(epoch=8), "fp32")
    assert result_tag(DecodeConfig(epoch=8, max_sym_per_frame=3), "fp32").endswith("-max-sym-3")
    assert "max-sym" not in result_tag(DecodeConfig(epoch=8, max_sym_per_frame=3,
                                                    decoding_method=("ctc_greedy_search",)), "fp32")
    with pytest.raises(ValueError, match="leave it out for the head's default"):
        DecodeConfig(epoch=8, max_sym_per_frame=0)
