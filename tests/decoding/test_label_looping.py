"""Label-looping greedy search against frame-looping greedy_search and a per-utterance, frame-by-frame reference:
same tokens and timestamps for every max_sym_per_frame, precision policy and encoder, batched and one by one."""

from __future__ import annotations

import copy

import pytest
import torch

from asrprec.decoding import LabelLoopingGreedy, greedy_search, label_looping_greedy_search
from asrprec.models import build_transducer
from asrprec.precision import POLICIES, get_policy

LENS = [7, 0, 12, 3, 12, 1]


# (seed, window, static_shapes): one frame per inner step as NeMo; windows shorter and longer than the utterances;
# every step on all rows (as a CUDA graph runs it) or only on the rows that move; the second seed only for the
# default (window 8, moving rows only)
VARIANTS = [(0, 8, False), (1, 8, False), (0, 1, False), (0, 1, True), (0, 3, True), (0, 16, False)]


@pytest.mark.parametrize("max_sym", [1, 2, 3])
@pytest.mark.parametrize("context_size,blank_bias", [(2, 0.0), (1, 2.0), (3, 1.0), (2, -2.0)])
@pytest.mark.parametrize("seed,window,static", VARIANTS)
def test_matches_reference_and_frame_looping(kit, seed, max_sym, context_size, blank_bias, window, static):
    model = kit.make_model(seed, context_size=context_size, blank_bias=blank_bias)
    feats, feat_lens = kit.make_batch(seed, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    search = LabelLoopingGreedy(model, max_sym, window=window, static_shapes=static)
    got = search(enc, enc_lens, return_timestamps=True)
    want = [kit.naive_greedy_timestamps(model, enc[i, :n], max_sym) for i, n in enumerate(LENS)]
    assert got == ([w[0] for w in want], [w[1] for w in want])
    assert got == greedy_search(model, enc, enc_lens, max_sym, return_timestamps=True)
    assert label_looping_greedy_search(model, enc, enc_lens, max_sym, window=window) == got[0]
    if max_sym > 1 and blank_bias <= 0.0:  # meaningful only if some frame emits several symbols
        assert any(len(set(s)) < len(s) for s in got[1])


def _both(model, enc, enc_lens, max_sym, static=False):
    ll = label_looping_greedy_search(model, enc, enc_lens, max_sym, return_timestamps=True)
    if static:  # also every step on all rows, one frame at a time (what a CUDA graph replays)
        static_search = LabelLoopingGreedy(model, max_sym, window=1, static_shapes=True)
        assert static_search(enc, enc_lens, return_timestamps=True) == ll
    return ll, greedy_search(model, enc, enc_lens, max_sym, return_timestamps=True)


def _random_transducer(encoder: str, feats: torch.Tensor):
    """A random tiny transducer whose greedy output mixes blanks and tokens: the joiner is sharpened, its
    encoder projection enlarged (a fresh encoder's output varies little from frame to frame) and the blank
    logit shifted so that blank wins about half of the first frames."""
    torch.manual_seed(0)
    model = build_transducer(encoder=encoder, size="tiny", vocab_size=24).eval()
    with torch.no_grad():
        model.joiner.output_linear.weight.mul_(8.0)
        model.joiner.encoder_proj.weight.mul_(4.0)
        model.joiner.decoder_proj.weight.mul_(4.0)
        enc, _ = model.encode(feats, torch.full((feats.size(0),), feats.size(1)))
        start = model.predict(torch.full((1, model.decoder.context_size), model.blank_id))
        logits = model.join(enc, start)  # (B, T, V)
        gap = logits[..., 1:].max(-1).values - logits[..., model.blank_id]
        model.joiner.output_linear.bias[model.blank_id] += gap.median()
    return model


@pytest.mark.parametrize("encoder", ["zipformer", "conformer"])
def test_every_policy_batched_and_one_by_one(encoder):
    """Each policy's inference model (fp32, fp16 and bf16 casts) and an fp32 model under bf16 autocast."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(4, 140, 80, generator=g) * 5
    feat_lens = torch.tensor([140, 37, 100, 81])
    model = _random_transducer(encoder, feats)
    variants = [(name, get_policy(name).prepare_for_inference(copy.deepcopy(model)), None) for name in POLICIES]
    variants.append(("autocast-bf16", model, get_policy("amp-bf16")))
    emitted, repeated = 0, 0
    for name, m, autocast in variants:
        with torch.no_grad(), (autocast.autocast() if autocast else torch.autocast("cpu", enabled=False)):
            enc, enc_lens = m.encode(feats, feat_lens)
            for max_sym in (1, 2):
                ll, fl = _both(m, enc, enc_lens, max_sym, static=True)
                assert ll == fl, (name, max_sym)
                for i, n in enumerate(enc_lens.tolist()):
                    one = _both(m, enc[i : i + 1, :n], enc_lens[i : i + 1], max_sym)
                    assert one[0] == one[1] == ([ll[0][i]], [ll[1][i]]), (name, max_sym, i)
                emitted += sum(map(len, ll[0]))
                repeated += sum(len(s) - len(set(s)) for s in ll[1])
    # the comparison means something only if tokens were emitted, some frames emitting two
    assert emitted > 100 and repeated > 10, (emitted, repeated)


def test_state_is_updated_in_place_and_reused(kit):
    """The loop only writes into the preallocated state (what lets a CUDA graph replay it), and a second batch
    of the same size reuses that state with a fresh start."""
    model = kit.make_model(3)
    search = LabelLoopingGreedy(model, max_sym_per_frame=2, static_shapes=True)
    assert not search.use_cuda_graphs  # CPU: eager, with the shapes a graph would have
    feats, feat_lens = kit.make_batch(3, LENS)
    enc, enc_lens = model.encode(feats, feat_lens)
    first = search(enc, enc_lens, return_timestamps=True)
    ptrs = search.state.data_ptrs()
    feats2, _ = kit.make_batch(4, LENS)
    enc2, _ = model.encode(feats2, feat_lens)
    second = search(enc2, enc_lens, return_timestamps=True)
    assert search.state.data_ptrs() == ptrs
    assert second == greedy_search(model, enc2, enc_lens, 2, return_timestamps=True)
    assert search(enc, enc_lens, return_timestamps=True) == first


def test_edge_cases_and_errors(kit):
    model = kit.make_model(0)
    D = model.encoder.output_dim
    assert label_looping_greedy_search(model, torch.zeros(0, 0, D), torch.zeros(0, dtype=torch.int64)) == []
    assert label_looping_greedy_search(model, torch.zeros(2, 0, D), torch.zeros(2, dtype=torch.int64)) == [[], []]
    enc = torch.randn(3, 5, D)
    lens = torch.tensor([0, 5, 0])
    assert label_looping_greedy_search(model, enc, lens, return_timestamps=True) == (
        [[], kit.naive_greedy(model, enc[1])[0], []],
        [[], kit.naive_greedy_timestamps(model, enc[1])[1], []],
    )
    with pytest.raises(ValueError, match="max_sym_per_frame"):
        LabelLoopingGreedy(model, max_sym_per_frame=0)
    with pytest.raises(ValueError, match="encoder_out_lens must lie in"):
        label_looping_greedy_search(model, enc, torch.tensor([6, 1, 1]))
    with pytest.raises(ValueError, match="use_cuda_graphs=True needs a model on a CUDA device"):
        LabelLoopingGreedy(model, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="window"):
        LabelLoopingGreedy(model, window=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_graphs_match_eager_and_frame_looping(kit, policy):
    torch.manual_seed(0)
    model = get_policy(policy, "cuda").prepare_for_inference(kit.make_model(1))
    feats, feat_lens = kit.make_batch(1, LENS)
    enc, enc_lens = model.encode(feats.cuda(), feat_lens.cuda())
    graphs = LabelLoopingGreedy(model, 2, use_cuda_graphs=True)
    eager = LabelLoopingGreedy(model, 2, use_cuda_graphs=False)
    want = greedy_search(model, enc, enc_lens, 2, return_timestamps=True)
    assert graphs(enc, enc_lens, return_timestamps=True) == eager(enc, enc_lens, return_timestamps=True) == want
    assert graphs._graphs is not None
    # a smaller batch replays the same graphs on padded state
    part, part_lens = enc[:2, :7], enc_lens[:2].clamp(max=7)
    assert graphs(part, part_lens) == greedy_search(model, part, part_lens, 2)


def test_decode_dataset_with_label_looping(kit):
    """decode_dataset's ``search`` hook (what recipes/espeak/decode.py uses) gives the recognitions of the
    default frame-looping greedy search, over several batches with one LabelLoopingGreedy."""
    from asrprec.decoding import DecodingOptions, decode_dataset

    class Words:
        def decode(self, ids):
            return " ".join(f"w{k}" for k in ids)

    model = kit.make_model(2, context_size=2, blank_bias=-1.0)
    loader = []
    for seed, lens in ((0, [5, 9, 2]), (1, [7, 7, 3]), (2, [4, 1, 8])):
        feats, feat_lens = kit.make_batch(seed, lens)
        loader.append({"features": feats, "feature_lens": feat_lens, "texts": ["x"] * len(lens),
                       "cut_ids": [f"{seed}-{i}" for i in range(len(lens))]})
    options = DecodingOptions(max_sym_per_frame=2)
    want, _ = decode_dataset(model, loader, Words(), options)
    got, stats = decode_dataset(model, loader, Words(), options, search=LabelLoopingGreedy(model, 2))
    assert got == want and stats["rtfx"] > 0
    assert sum(len(hyp) for _, _, hyp in got) > 10
