"""Decoding under low precision: a bf16-cast model (policy "bf16") and an fp32 model under CPU autocast."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asrprec.decoding import DecodingOptions, decode, greedy_search, modified_beam_search
from asrprec.precision import get_policy

LENS = [7, 0, 12, 3, 12, 1]


def _bf16_model(kit, seed, **kw):
    model = kit.make_model(seed, **kw)
    cast = get_policy("bf16").prepare_for_inference(model)
    assert cast.joiner.output_linear.weight.dtype == torch.bfloat16
    # float64 twin with the *same* (bf16-rounded) weights: the reference for the cast model
    twin = copy.deepcopy(cast).double()
    return cast, twin


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_cast_greedy_and_beam1(kit, seed):
    model, twin = _bf16_model(kit, seed, blank_bias=1.0)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    assert enc.dtype == torch.bfloat16
    for max_sym in (1, 2):
        hyps = greedy_search(model, enc, enc_lens, max_sym_per_frame=max_sym)
        assert all(isinstance(k, int) and 0 < k < model.vocab_size for h in hyps for k in h)
    hyps = greedy_search(model, enc, enc_lens)
    for i, n in enumerate(LENS):
        assert kit.is_near_greedy(twin, enc[i, :n].double(), hyps[i], eps=0.1)
    assert modified_beam_search(model, enc, enc_lens, beam=1) == hyps
    # an fp32 encoder_out (e.g. from an fp32 encoder) is cast to the joiner's dtype
    assert greedy_search(model, enc.float(), enc_lens) == hyps


def _exhaustive_checks(kit, model, twin, enc, enc_lens, lens, tol, decode_on="cpu"):
    hyp_lists = modified_beam_search(
        model, enc.to(decode_on), enc_lens.to(decode_on), beam=64, return_hypotheses=True
    )
    for i, n in enumerate(lens):
        got = {h.tokens: h.log_prob for h in hyp_lists[i]}
        # log-softmax in an fp32 island: each frame's distribution sums to 1 to fp32 accuracy, so all
        # sequences together do too (a bf16 log-softmax is off by ~1e-2 per frame)
        assert math.log(sum(math.exp(v) for v in got.values())) == pytest.approx(0.0, abs=1e-5)
        want = kit.all_sequence_log_probs(twin, enc[i, :n].double())
        assert set(got) == set(want)
        assert max(abs(got[k] - want[k]) for k in want) < tol


def test_bf16_cast_exhaustive_beam(kit):
    model, twin = _bf16_model(kit, 4, vocab=3, logit_scale=2.0)
    lens = [4, 3]
    feats, feat_lens = kit.make_batch(4, lens)
    enc, enc_lens = model.encode(feats, feat_lens)
    _exhaustive_checks(kit, model, twin, enc, enc_lens, lens, tol=0.1)


@pytest.mark.parametrize("seed", [0, 1])
def test_under_cpu_autocast(kit, seed):
    model = kit.make_model(seed, blank_bias=1.0)
    twin = copy.deepcopy(model).double()
    policy = get_policy("amp-bf16")
    feats, feat_lens = kit.make_batch(seed, LENS)
    with policy.autocast():
        enc, enc_lens = model.encode(feats, feat_lens)
        hyps = greedy_search(model, enc, enc_lens)
        beam1 = modified_beam_search(model, enc, enc_lens, beam=1)
        hyp_lists = modified_beam_search(model, enc, enc_lens, beam=4, return_hypotheses=True)
    assert beam1 == hyps
    for i, n in enumerate(LENS):
        assert kit.is_near_greedy(twin, enc[i, :n].double(), hyps[i], eps=0.1)
        for h in hyp_lists[i]:
            assert isinstance(h.log_prob, float) and h.log_prob <= 0.0


def test_autocast_exhaustive_beam(kit):
    model = kit.make_model(5, vocab=3, logit_scale=2.0)
    twin = copy.deepcopy(model).double()
    lens = [4, 2]
    feats, feat_lens = kit.make_batch(5, lens)
    with get_policy("amp-bf16").autocast():
        enc, enc_lens = model.encode(feats, feat_lens)
        _exhaustive_checks(kit, model, twin, enc, enc_lens, lens, tol=0.1)


def test_decode_and_options(kit):
    model = kit.make_model(0)
    feats, feat_lens = kit.make_batch(0, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    assert decode(model, feats, feat_lens) == [kit.naive_greedy(model, enc[i, :n])[0] for i, n in enumerate(LENS)]
    opts = DecodingOptions.from_dict({"method": "modified_beam_search", "beam": 1})
    assert decode(model, feats, feat_lens, opts) == greedy_search(model, enc, enc_lens)
    with pytest.raises(ValueError, match=r"unknown DecodingOptions keys \['beam_size'\] \(did you mean 'beam'"):
        DecodingOptions.from_dict({"beam_size": 4})
    with pytest.raises(ValueError, match="unknown decoding method"):
        DecodingOptions(method="beam_search")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_cast_on_cuda(kit):
    model = kit.make_model(0, vocab=3, logit_scale=2.0)
    cast_cpu = get_policy("bf16").prepare_for_inference(copy.deepcopy(model))
    twin = copy.deepcopy(cast_cpu).double()
    model = get_policy("bf16", "cuda").prepare_for_inference(model)
    lens = [4, 3]
    feats, feat_lens = kit.make_batch(0, lens)
    enc, enc_lens = model.encode(feats.cuda(), feat_lens.cuda())
    hyps = greedy_search(model, enc, enc_lens)
    assert modified_beam_search(model, enc, enc_lens, beam=1) == hyps
    for i, n in enumerate(lens):
        assert kit.is_near_greedy(twin, enc[i, :n].double().cpu(), hyps[i], eps=0.1)
    _exhaustive_checks(kit, model, twin, enc.cpu(), enc_lens.cpu(), lens, tol=0.1, decode_on=enc.device)
