"""greedy_search against a plain per-utterance reference, batching, ordering and edge cases."""

from __future__ import annotations

import pytest
import torch

from asrprec.decoding import greedy_search
from asrprec.models import Decoder, Joiner

LENS = [7, 0, 12, 3, 12, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_sym", [1, 2, 3])
@pytest.mark.parametrize("context_size,blank_bias", [(2, 0.0), (1, 2.0), (3, 1.0)])
def test_matches_naive_reference(kit, seed, max_sym, context_size, blank_bias):
    model = kit.make_model(seed, context_size=context_size, blank_bias=blank_bias)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    got = greedy_search(model, enc, enc_lens, max_sym_per_frame=max_sym)
    want = [kit.naive_greedy(model, enc[i, : LENS[i]], max_sym)[0] for i in range(len(LENS))]
    assert got == want
    # the test is only meaningful if some rows emit several symbols on one frame
    if max_sym > 1 and blank_bias == 0.0:
        assert any(len(w) > n for w, n in zip(want, LENS))


def test_nonzero_blank_id(kit):
    torch.manual_seed(0)
    model = kit.make_model(3)
    V, D = 6, 16
    model.decoder = Decoder(V, D, blank_id=4, context_size=2)
    model.joiner = Joiner(D, D, D, V)
    with torch.no_grad():
        model.joiner.output_linear.weight.mul_(4.0)
    model.eval()
    feats, feat_lens = kit.make_batch(3, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    for max_sym in (1, 2):
        got = greedy_search(model, enc, enc_lens, max_sym_per_frame=max_sym)
        want = [kit.naive_greedy(model, enc[i, : LENS[i]], max_sym)[0] for i in range(len(LENS))]
        assert got == want
        assert all(4 not in g for g in got)


@pytest.mark.parametrize("max_sym", [1, 2])
def test_batched_equals_one_by_one(kit, max_sym):
    model = kit.make_model(5, blank_bias=1.0)
    lens = [4, 9, 2, 9, 6]
    feats, feat_lens = kit.make_batch(5, lens)
    enc, enc_lens = model.encode(feats, feat_lens)
    batched = greedy_search(model, enc, enc_lens, max_sym_per_frame=max_sym)
    single = [
        greedy_search(model, enc[i : i + 1, : lens[i]], enc_lens[i : i + 1], max_sym_per_frame=max_sym)[0]
        for i in range(len(lens))
    ]
    assert batched == single


def test_padding_is_ignored(kit):
    """Frames past an utterance's length must not influence its result."""
    model = kit.make_model(6)
    feats, feat_lens = kit.make_batch(6, [5, 8])
    enc, enc_lens = model.encode(feats, feat_lens)
    a = greedy_search(model, enc, enc_lens)
    enc2 = enc.clone()
    enc2[0, 5:] = 100.0
    assert greedy_search(model, enc2, enc_lens) == a


def test_empty_inputs(kit):
    model = kit.make_model(0)
    D = model.encoder.output_dim
    assert greedy_search(model, torch.zeros(0, 0, D), torch.zeros(0, dtype=torch.int64)) == []
    assert greedy_search(model, torch.zeros(3, 0, D), torch.zeros(3, dtype=torch.int64)) == [[], [], []]
    enc = torch.randn(2, 4, D)
    out = greedy_search(model, enc, torch.tensor([0, 4]))
    assert out[0] == [] and out[1] == kit.naive_greedy(model, enc[1])[0]


def test_bad_inputs_raise_clear_errors(kit):
    model = kit.make_model(0)
    D = model.encoder.output_dim
    with pytest.raises(ValueError, match=r"\(B, T, D_enc\)"):
        greedy_search(model, torch.randn(4, D), torch.tensor([4]))
    with pytest.raises(ValueError, match="encoder_out_lens must lie in"):
        greedy_search(model, torch.randn(1, 4, D), torch.tensor([5]))
    with pytest.raises(ValueError, match="shape"):
        greedy_search(model, torch.randn(2, 4, D), torch.tensor([4]))
    with pytest.raises(ValueError, match="integer"):
        greedy_search(model, torch.randn(1, 4, D), torch.tensor([4.0]))
    with pytest.raises(ValueError, match="max_sym_per_frame"):
        greedy_search(model, torch.randn(1, 4, D), torch.tensor([4]), max_sym_per_frame=0)
