"""Decoding a real (tiny Conformer) transducer from asrprec.models, fp32 and bf16-cast."""

from __future__ import annotations

import copy

import torch

from asrprec.decoding import DecodingOptions, decode, greedy_search, modified_beam_search
from asrprec.models import build_transducer
from asrprec.precision import get_policy


def test_tiny_conformer_fp32_and_bf16(kit):
    torch.manual_seed(0)
    model = build_transducer(encoder="conformer", size="tiny", vocab_size=12).eval()
    feats = torch.randn(3, 60, 80)
    feat_lens = torch.tensor([60, 35, 20])
    with torch.no_grad():
        enc, enc_lens = model.encode(feats, feat_lens)
    hyps = decode(model, feats, feat_lens)
    assert hyps == [kit.naive_greedy(model, enc[i, : int(n)])[0] for i, n in enumerate(enc_lens)]
    assert decode(model, feats, feat_lens, DecodingOptions(method="modified_beam_search", beam=1)) == hyps

    cast = get_policy("bf16").prepare_for_inference(copy.deepcopy(model))
    twin = copy.deepcopy(cast).double()
    with torch.no_grad():
        enc16, lens16 = cast.encode(feats, feat_lens)
    assert torch.equal(lens16, enc_lens)
    h16 = greedy_search(cast, enc16, lens16)
    assert modified_beam_search(cast, enc16, lens16, beam=1) == h16
    for i, n in enumerate(lens16.tolist()):
        assert kit.is_near_greedy(twin, enc16[i, :n].double(), h16[i], eps=0.1)
    assert len(modified_beam_search(cast, enc16, lens16, beam=4)) == 3
