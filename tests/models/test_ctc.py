"""The CTC head and its objectives: CTC against a brute-force enumeration of alignments, the CR-CTC consistency
term against its formula, SpecAugment views, every head combination, checkpoints."""

import itertools
import math

import pytest
import torch
from torch import nn

from asrprec.losses import available_backends
from asrprec.models import CtcConfig, Decoder, Joiner, LossConfig, Transducer, build_transducer
from asrprec.models.ctc import cr_consistency_loss, ctc_loss, spec_augment_views
from asrprec.precision import get_policy


def collapse(path, blank=0):
    """CTC's many-to-one map: merge repeats, then drop blanks."""
    out, prev = [], None
    for s in path:
        if s != prev and s != blank:
            out.append(s)
        prev = s
    return out


def brute_force_ctc(log_probs, y, blank=0):
    """−log Σ over every length-T path that collapses to ``y`` of Π p(path_t | t), enumerating all V^T paths
    (float64, one utterance; ``log_probs`` (T, V))."""
    lp = log_probs.double()
    T, V = lp.shape
    scores = [sum(float(lp[t, s]) for t, s in enumerate(path))
              for path in itertools.product(range(V), repeat=T) if collapse(path, blank) == list(y)]
    if not scores:
        return math.inf
    m = max(scores)
    return -(m + math.log(sum(math.exp(s - m) for s in scores)))


def random_log_probs(B, T, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)


# -- CTC ---------------------------------------------------------------------------------------------------------


def test_ctc_loss_matches_enumeration():
    lp = random_log_probs(4, 5, 3)
    lens = torch.tensor([5, 4, 5, 3])
    # repeated labels need a blank between them; -1 pads
    targets = torch.tensor([[1, 2, 1], [2, 2, -1], [1, -1, -1], [2, 1, -1]])
    target_lens = torch.tensor([3, 2, 1, 2])
    expect = [brute_force_ctc(lp[b, : lens[b]], targets[b, : target_lens[b]].tolist()) for b in range(4)]
    per_utt = ctc_loss(lp, targets, lens, target_lens, reduction="none")
    assert per_utt.dtype == torch.float64
    assert torch.allclose(per_utt, torch.tensor(expect, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    assert math.isclose(float(ctc_loss(lp, targets, lens, target_lens)), sum(expect), rel_tol=1e-10)
    assert math.isclose(float(ctc_loss(lp, targets, lens, target_lens, reduction="mean")), sum(expect) / 4,
                        rel_tol=1e-10)


def test_ctc_loss_is_infinite_without_enough_frames():
    lp = random_log_probs(1, 3, 3)
    # [1, 1, 1] needs 5 frames (blanks between the repeats)
    assert brute_force_ctc(lp[0], [1, 1, 1]) == math.inf
    assert math.isinf(float(ctc_loss(lp, torch.tensor([[1, 1, 1]]), torch.tensor([3]), torch.tensor([3]))))


def test_ctc_loss_validation():
    lp = random_log_probs(2, 4, 3)
    with pytest.raises(ValueError, match="reduction"):
        ctc_loss(lp, torch.ones(2, 1, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([1, 1]), reduction="x")
    with pytest.raises(ValueError, match=r"batch sizes disagree: log_probs 2, targets 3"):
        ctc_loss(lp, torch.ones(3, 1, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([1, 1]))


V_CTC = 4
CTC_BAD_INPUTS = [  # (what changes in a valid batch, the message); the RNN-T losses' validator's words
    (dict(targets=[[1, 4, 2], [3, 1, 0]]), r"targets\[0, 1\] = 4 is outside \[0, V = 4\)"),
    (dict(targets=[[1, 2, 3], [-1, 1, 0]]), r"targets\[1, 0\] = -1 is outside \[0, V = 4\)"),
    (dict(targets=[[1, 10**9, 2], [3, 1, 0]]), r"targets\[0, 1\] = 1000000000 is outside"),
    (dict(targets=[[1, 2, 3], [-10**9, 1, 0]]), r"targets\[1, 0\] = -1000000000 is outside"),
    (dict(targets=[[1, 0, 2], [3, 1, 0]]), r"targets\[0, 1\] is the blank id 0"),
    (dict(blank=4), r"blank = 4 is out of range for V = 4"),
    (dict(blank=-1), r"blank = -1 is out of range for V = 4"),
    (dict(logit_lens=[5, 6]), r"logit_lens\[1\] = 6 exceeds T = 5"),
    (dict(logit_lens=[5, 0]), r"logit_lens\[1\] = 0: every utterance needs at least one frame"),
    (dict(target_lens=[4, 2]), r"target_lens\[0\] = 4 exceeds U = 3"),
    (dict(target_lens=[3, -1]), r"target_lens\[1\] = -1 is negative"),
    (dict(targets=[[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]]), r"targets must be an integer tensor, got dtype torch.float32"),
    (dict(logit_lens=[5.0, 4.0]), r"logit_lens must be an integer tensor"),
    (dict(target_lens=[True, True]), r"target_lens must be an integer tensor, got dtype torch.bool"),
    (dict(log_probs="int"), r"log_probs must be float64, float32, float16 or bfloat16, got torch.int64"),
    (dict(log_probs="B=0"), r"log_probs has batch size 0. Fix: skip empty batches"),
]


@pytest.mark.parametrize("change,message", CTC_BAD_INPUTS, ids=[m for _, m in CTC_BAD_INPUTS])
def test_ctc_loss_validates_as_the_rnnt_losses(change, message):
    """Before validation, ids >= V, negative ids and the blank inside targets gave finite numbers read out of
    range, and ids of +-1e9 could crash the process."""
    lp = random_log_probs(2, 5, V_CTC)
    args = dict(log_probs=lp, targets=[[1, 2, 3], [3, 1, 0]], logit_lens=[5, 4], target_lens=[3, 2], blank=0)
    args.update(change)
    if args["log_probs"] == "int":
        args["log_probs"] = torch.zeros(2, 5, V_CTC, dtype=torch.long)
    elif args["log_probs"] == "B=0":
        args.update(log_probs=lp[:0], targets=torch.zeros(0, 3, dtype=torch.long), logit_lens=[], target_lens=[])
    for k in ("targets", "logit_lens", "target_lens"):
        if not isinstance(args[k], torch.Tensor):
            args[k] = torch.tensor(args[k], dtype=torch.long if not args[k] else None)
    with pytest.raises(ValueError, match=message):
        ctc_loss(args["log_probs"], args["targets"], args["logit_lens"], args["target_lens"], blank=args["blank"])


def test_ctc_loss_ignores_padding_beyond_target_lens():
    lp = random_log_probs(2, 4, 3, seed=5)
    targets = torch.tensor([[1, 2], [2, -7]])  # -7: padding, never read
    per_utt = ctc_loss(lp, targets, torch.tensor([4, 3]), torch.tensor([2, 1]), reduction="none")
    expect = [brute_force_ctc(lp[0], [1, 2]), brute_force_ctc(lp[1, :3], [2])]
    assert torch.allclose(per_utt, torch.tensor(expect, dtype=torch.float64), rtol=1e-10, atol=1e-10)


class LinearEncoder(nn.Module):
    """A stand-in encoder without subsampling, so tiny cases stay enumerable."""

    def __init__(self, num_features=8, dim=12):
        super().__init__()
        self.proj = nn.Linear(num_features, dim)
        self.output_dim = dim

    def forward(self, x, lens):
        return torch.tanh(self.proj(x)), lens


def tiny(vocab=3, *, transducer=True, ctc=None, loss=None, seed=0):
    torch.manual_seed(seed)
    dec = Decoder(vocab, 16, blank_id=0, context_size=2) if transducer else None
    join = Joiner(12, 16, 10, vocab) if transducer else None
    return Transducer(LinearEncoder(), dec, join, ctc=ctc, vocab_size=vocab,
                      loss=LossConfig(**(loss or {"loss": "full"})))


def ctc_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(3, 5, 8, generator=g)
    return feats, torch.tensor([5, 4, 3]), torch.tensor([[1, 2], [2, 2], [1, -1]]), torch.tensor([2, 2, 1])


# (policy, rtol) — the dtype's rounding through the encoder and head, not the loss (computed in fp32)
POLICIES = [("fp32", 1e-5), ("amp-fp16", 5e-3), ("amp-bf16", 3e-2), ("bf16", 3e-2)]


@pytest.mark.parametrize("policy_name,rtol", POLICIES)
def test_model_ctc_loss_matches_enumeration_under_each_policy(policy_name, rtol):
    model = tiny(transducer=False, ctc=CtcConfig())
    model.eval()
    feats, lens, targets, target_lens = ctc_batch()
    with torch.no_grad():
        ref = model.double()
        lp64 = ref.ctc_log_probs(ref.encode(feats.double(), lens)[0])
        expect = sum(brute_force_ctc(lp64[b, : lens[b]], targets[b, : target_lens[b]].tolist()) for b in range(3))
        policy = get_policy(policy_name, "cpu")
        m = policy.prepare_model(model.float())
        with policy.autocast():
            out = m(feats, lens, targets, target_lens)
            lp = m.ctc_log_probs(m.encode(feats, lens)[0])
    assert out["ctc_loss"].dtype == torch.float32 and out["loss"].dtype == torch.float32
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(3, 5), atol=1e-5)  # a distribution, whatever the policy
    assert math.isclose(out["ctc_loss"].item(), expect, rel_tol=rtol), (out["ctc_loss"].item(), expect)
    assert math.isclose(out["loss"].item(), expect, rel_tol=rtol)  # CTC alone: scale 1.0


def test_ctc_log_probs_without_a_head_says_how_to_get_one():
    with pytest.raises(ValueError, match="no CTC head"):
        tiny().ctc_log_probs(torch.zeros(1, 2, 12))


# -- CR-CTC ------------------------------------------------------------------------------------------------------


def test_consistency_term_equals_its_formula_on_hand_made_posteriors():
    # two utterances, two views each (rows b and b+2), T=2, V=3; utterance 1 has one valid frame
    p = torch.tensor([
        [[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]],
        [[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]],  # frame 1 is padding
        [[0.6, 0.3, 0.1], [0.3, 0.6, 0.1]],
        [[0.4, 0.4, 0.2], [0.9, 0.05, 0.05]],  # frame 1 is padding
    ], dtype=torch.float64)
    lens = torch.tensor([2, 1, 2, 1])
    expect = 0.0
    for v, w in [(0, 2), (2, 0), (1, 3), (3, 1)]:  # each view against the other view of its utterance
        for t in range(int(lens[v])):
            expect += sum(float(p[w, t, k]) * math.log(float(p[w, t, k]) / float(p[v, t, k])) for k in range(3))
    log_p = p.log().requires_grad_(True)
    got = cr_consistency_loss(log_p, lens)
    assert math.isclose(float(got.detach()), expect, rel_tol=1e-12)
    # d/d log p_v(k|t) of Σ p̄_w log(p̄_w / p_v) is −p̄_w(k|t): only the learning side carries a gradient; a
    # gradient through the (detached) target side would add p_v-dependent terms
    got.backward()
    other = torch.roll(p, 2, dims=0)
    valid = (torch.arange(2).unsqueeze(0) < lens.unsqueeze(1)).unsqueeze(-1)
    assert torch.allclose(log_p.grad, -other * valid, atol=1e-12)


def test_consistency_term_needs_two_views():
    with pytest.raises(ValueError, match="two views"):
        cr_consistency_loss(torch.zeros(3, 2, 2), torch.tensor([2, 2, 2]))


def test_spec_augment_views_mask_each_copy_independently_within_the_valid_frames():
    torch.manual_seed(3)
    B, T, F = 3, 400, 80
    feats = torch.randn(B, T, F) + 5.0
    lens = torch.tensor([400, 300, 120])
    x, xl = spec_augment_views(feats, lens, time_mask_ratio=2.5, p=1.0)
    assert x.shape == (2 * B, T, F) and torch.equal(xl, lens.repeat(2))
    src = feats.repeat(2, 1, 1)
    changed = x != src
    for r in range(2 * B):
        n = int(xl[r])
        assert not changed[r, n:].any()  # padding untouched
        mean = src[r, :n].mean()
        assert torch.allclose(x[r][changed[r]], mean.expand(int(changed[r].sum())))  # filled with the mean
        # time masks: whole frames; lhotse's bound on how much of the utterance they cover
        frames = changed[r, :n].all(-1)
        assert int(frames.sum()) <= 0.15 * 2.5 * n
        bins = changed[r, :n].all(0)
        assert int(bins.sum()) <= 2 * 26  # two frequency masks narrower than 27 bins
        assert changed[r].any()
    assert not torch.equal(x[:B], x[B:])  # the two views differ
    same, _ = spec_augment_views(feats, lens, p=0.0)
    assert torch.equal(same, src)


@pytest.mark.parametrize("bins, widest", [(80, 26), (40, 12)])
def test_frequency_masks_scale_with_the_feature_width(bins, widest):
    """icefall's 27-bin limit is for 80 bins: 40-bin features get masks up to 13 bins wide (widths are drawn from
    0 .. limit - 1, as lhotse draws them), so that the same share of the spectrum is masked."""
    torch.manual_seed(0)
    n, T = 600, 400
    feats = torch.randn(n, T, bins) + 5.0
    x, _ = spec_augment_views(feats, torch.full((n,), T), copies=1, num_feature_masks=1, p=1.0)
    masked = (x != feats).all(1)  # (n, bins): a bin masked over every frame (time masks cover at most 37.5 %)
    assert int(masked.sum(1).max()) == widest


def test_cr_ctc_forward_is_halved_ctc_on_both_views_plus_the_warmed_up_consistency_term():
    model = tiny(transducer=False, ctc=CtcConfig(use_cr_ctc=True, dropout=0.0))
    model.train()
    model.batch_count = 500.0  # a quarter of the default 2000-batch warm-up
    feats, lens, targets, target_lens = ctc_batch()
    torch.manual_seed(11)
    out = model(feats, lens, targets, target_lens)
    torch.manual_seed(11)
    views, view_lens = spec_augment_views(feats, lens, time_mask_ratio=2.5)
    lp = model.ctc_log_probs(model.encode(views, view_lens)[0]).detach()
    expect_ctc = 0.5 * sum(brute_force_ctc(lp[r, : view_lens[r]], targets[r % 3, : target_lens[r % 3]].tolist())
                           for r in range(6))
    expect_cr = 0.5 * float(cr_consistency_loss(lp, view_lens))
    assert math.isclose(out["ctc_loss"].item(), expect_ctc, rel_tol=1e-5)
    assert math.isclose(out["cr_loss"].item(), expect_cr, rel_tol=1e-5)
    assert model.ctc_config.ctc_loss_scale == 1.0 and model.ctc_config.cr_loss_scale == 0.2
    assert math.isclose(out["loss"].item(), expect_ctc + 0.25 * 0.2 * expect_cr, rel_tol=1e-5)
    assert torch.equal(out["encoder_out_lens"], lens)  # the batch given, not the two views
    model.eval()  # no views, no consistency term
    assert "cr_loss" not in model(feats, lens, targets, target_lens)



@pytest.mark.parametrize("policy_name", ["amp-fp16", "amp-bf16", "bf16"])
def test_cr_ctc_trains_under_every_policy_with_fp32_losses(policy_name):
    policy = get_policy(policy_name, "cpu")
    model = policy.prepare_model(tiny(5, ctc=CtcConfig(use_cr_ctc=True), loss={"loss": "pruned"}))
    model.train()
    model.batch_count = 1000.0
    feats, lens = torch.randn(2, 9, 8), torch.tensor([9, 7])
    targets, target_lens = torch.tensor([[1, 3, 4], [2, 2, -1]]), torch.tensor([3, 2])
    with policy.autocast():
        out = model(feats, lens, targets, target_lens)
    assert {"simple_loss", "pruned_loss", "ctc_loss", "cr_loss"} <= out.keys()
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for k, v in out.items() if k.endswith("loss"))
    out["loss"].backward()
    grad = model.ctc_output[1].weight.grad
    assert grad is not None and torch.isfinite(grad).all()


# -- every combination -------------------------------------------------------------------------------------------


def test_ctc_config_resolves_icefalls_scales_per_combination():
    assert CtcConfig().resolved(use_transducer=False).ctc_loss_scale == 1.0
    assert CtcConfig().resolved(use_transducer=True).ctc_loss_scale == 0.2
    hybrid_cr = CtcConfig(use_cr_ctc=True).resolved(use_transducer=True)
    assert (hybrid_cr.ctc_loss_scale, hybrid_cr.cr_loss_scale) == (0.1, 0.02)
    assert CtcConfig(use_cr_ctc=True).resolved(use_transducer=False).cr_loss_scale == 0.2
    assert CtcConfig(ctc_loss_scale=0.5).resolved(use_transducer=True).ctc_loss_scale == 0.5
    with pytest.raises(ValueError, match="ctc_loss_scale"):
        CtcConfig(ctc_loss_scale=-1.0)
    with pytest.raises(ValueError, match="time_mask_ratio"):
        CtcConfig(time_mask_ratio=0.0)


COMBINATIONS = [(True, None), (True, {}), (False, {}), (True, {"use_cr_ctc": True}), (False, {"use_cr_ctc": True})]


@pytest.mark.parametrize("encoder", ["zipformer", "conformer"])
@pytest.mark.parametrize("use_transducer,ctc", COMBINATIONS)
def test_build_every_combination(encoder, use_transducer, ctc):
    torch.manual_seed(0)
    m = build_transducer(encoder=encoder, size="tiny", vocab_size=12, use_transducer=use_transducer, ctc=ctc)
    keys = m.state_dict().keys()
    assert m.use_transducer is use_transducer and m.use_ctc is (ctc is not None)
    assert (m.decoder is None) is (not use_transducer) and (m.joiner is None) is (not use_transducer)
    assert any(k.startswith("decoder.") for k in keys) is use_transducer
    assert ("ctc_output.1.weight" in keys) is (ctc is not None)
    assert m.blank_id == 0 and m.vocab_size == 12
    m.train()
    x, xl = torch.randn(2, 80, 80), torch.tensor([80, 64])
    y, yl = torch.tensor([[3, 4, 5], [6, 7, -1]]), torch.tensor([3, 2])
    out = m(x, xl, y, yl)
    out["loss"].backward()
    assert ("ctc_loss" in out) is (ctc is not None)
    assert ("pruned_loss" in out) is use_transducer
    assert ("cr_loss" in out) is bool(ctc and ctc.get("use_cr_ctc"))
    assert all(torch.isfinite(v).all() for v in out.values())
    if ctc is not None:
        assert m.ctc_output[1].weight.grad is not None


def test_no_head_is_an_error():
    with pytest.raises(ValueError, match="without a head"):
        build_transducer(vocab_size=5, use_transducer=False)
    with pytest.raises(ValueError, match="no head"):
        Transducer(LinearEncoder(), None, None, vocab_size=5)


CPU_BACKENDS = [b["name"] for b in available_backends() if "cpu" in b["devices"]]


@pytest.mark.parametrize("loss", [{"loss": "full", "backend": b} for b in CPU_BACKENDS]
                         + [{"loss": "full", "joint_mode": "lean"}, {"loss": "pruned"}])
def test_hybrid_loss_is_the_transducer_loss_plus_the_scaled_ctc_loss(loss):
    """Beside a CTC head, every transducer loss computes what it computes alone; the total adds 0.2 × CTC."""
    backend = next((b for b in available_backends() if b["name"] == loss.get("backend")), None)
    if backend is not None and not backend["available"]:
        pytest.skip(f"rnnt_loss backend {backend['name']}: {backend['reason']}")
    hybrid = tiny(5, ctc=CtcConfig(dropout=0.0), loss=loss)
    alone = tiny(5, loss=loss)
    alone.load_state_dict({k: v for k, v in hybrid.state_dict().items() if not k.startswith("ctc_output")})
    hybrid.eval(), alone.eval()
    feats, lens = torch.randn(2, 6, 8), torch.tensor([6, 4])
    targets, target_lens = torch.tensor([[1, 3, 4], [2, 2, -1]]), torch.tensor([3, 2])
    h, a = hybrid(feats, lens, targets, target_lens), alone(feats, lens, targets, target_lens)
    for k in a:
        assert torch.allclose(h[k] if k != "loss" else h[k] - 0.2 * h["ctc_loss"], a[k], rtol=1e-5), k
    lp = hybrid.ctc_log_probs(hybrid.encode(feats, lens)[0]).detach()
    expect = sum(brute_force_ctc(lp[b, : lens[b]], targets[b, : target_lens[b]].tolist()) for b in range(2))
    assert math.isclose(h["ctc_loss"].item(), expect, rel_tol=1e-5)


# -- checkpoints -------------------------------------------------------------------------------------------------


def test_checkpoint_round_trip_rebuilds_the_heads_from_their_build_arguments(tmp_path):
    from asrprec.checkpoint import TrainingObjects, load_checkpoint, save_checkpoint

    config = {"encoder": "zipformer", "size": "tiny", "vocab_size": 9, "use_transducer": False,
              "ctc": CtcConfig(use_cr_ctc=True).resolved(False).__dict__}
    torch.manual_seed(0)
    model = build_transducer(**config)
    save_checkpoint(tmp_path / "epoch-1.pt", TrainingObjects(model=model))
    torch.manual_seed(1)
    again = build_transducer(**config)
    load_checkpoint(tmp_path / "epoch-1.pt", TrainingObjects(model=again))
    assert again.ctc_config == model.ctc_config and again.decoder is None
    model.eval(), again.eval()
    x, xl = torch.randn(1, 60, 80), torch.tensor([60])
    assert torch.equal(model.ctc_log_probs(model.encode(x, xl)[0]), again.ctc_log_probs(again.encode(x, xl)[0]))


def test_build_arguments_without_ctc_keys_give_the_transducer_alone():
    m = build_transducer(encoder="conformer", size="tiny", vocab_size=7)
    assert m.use_transducer and not m.use_ctc and m.ctc_output is None and m.ctc_config is None


def test_time_warp_equals_lhotses_for_the_same_draws(monkeypatch):
    from lhotse.dataset import signal_transforms

    from asrprec.models.ctc import time_warp

    feats = torch.randn(2, 90, 6)
    lens = torch.tensor([90, 70])
    factor = 10
    torch.manual_seed(5)
    got = time_warp(feats, lens, factor, p=1.0)
    torch.manual_seed(5)
    for i, n in enumerate(lens.tolist()):
        draw = torch.rand(3, dtype=torch.float64)
        centre = factor + 1 + int(float(draw[1]) * (n - 2 * factor - 1))
        warped = centre - factor + int(float(draw[2]) * (2 * factor + 1))
        picks = iter([centre, warped])
        monkeypatch.setattr(signal_transforms.np.random, "randint", lambda lo, hi: next(picks))
        expect = signal_transforms.time_warp(feats[i, :n], factor)
        assert factor + 1 <= centre < n - factor and abs(warped - centre) <= factor
        assert torch.allclose(got[i, :n], expect, atol=1e-6), i
        assert torch.equal(got[i, n:], feats[i, n:])
    assert torch.equal(time_warp(feats, lens, factor, p=0.0), feats)
    short = torch.randn(1, 15, 6)
    assert torch.equal(time_warp(short, torch.tensor([15]), factor, p=1.0), short)  # too short to warp
