"""bf16 weight updates (master, kahan, stochastic, none): small updates kept or lost, unbiased stochastic rounding,
AdamWBf16 against torch's AdamW, bf16 moments, bytes per parameter, errors."""

import math

import pytest
import torch
from torch import nn

from asrprec.optim import AdamWBf16, Bf16Update, ScaledAdam, stochastic_round
from asrprec.optim.bf16_update import KAHAN, bytes_per_parameter
from asrprec.precision import MasterWeightOptimizer, get_policy

UPDATES = ("master", "kahan", "stochastic", "none")
STEPS, LR = 2000, 1e-4


def _bf16_spacing(x: float) -> float:
    """Distance between consecutive bf16 numbers around |x| (8 significant bits): 2^(floor(log2|x|) - 7)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def _run(update: str, factory, shape=(32, 32), steps=STEPS):
    torch.manual_seed(0)
    p = nn.Parameter(torch.ones(shape, dtype=torch.bfloat16))
    opt = get_policy("bf16", bf16_update=update).build_optimizer([p], factory)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    return p.detach().double(), opt


@pytest.mark.parametrize("update", UPDATES)
def test_adamw_small_steps_add_up_except_under_none(update):
    # each step moves the weight by lr (Adam's m / sqrt(v) = 1 for a constant gradient), less than half the bf16
    # spacing anywhere on the way from 1.0 to 0.8
    assert LR < _bf16_spacing(0.8) / 2
    w, opt = _run(update, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0))
    moved = float(1.0 - w.mean())
    if update == "none":
        assert torch.equal(w, torch.ones_like(w))  # every update rounded away
    else:
        assert moved == pytest.approx(STEPS * LR, rel=0.03), moved  # 0.2
    if update in ("kahan", "stochastic", "none"):
        assert isinstance(opt, AdamWBf16) and opt.update.rule == update


@pytest.mark.parametrize("update", UPDATES)
def test_scaled_adam_small_steps_add_up_except_under_none(update):
    # ScaledAdam by hand, constant unit gradient on a tensor of ones: the update is lr x RMS(w) = lr x w (Adam's
    # g / sqrt(v) = 1 once bias-corrected), and every size_update_period = 4 steps the learned scale moves w by
    # -lr x scalar_lr_scale x (sum of 4 scale gradients / their RMS = 4) x w: on average a relative
    # -lr x (1 + scalar_lr_scale) per step, so w = exp(-steps x lr x 1.1) = 0.8025 (the momentum's lag of ~10
    # steps is 0.5 %). Clipping is on: the gradient norm never exceeds 2 x its median.
    expect = 1.0 - math.exp(-STEPS * LR * (1 + 0.1))
    w, opt = _run(update, lambda ps: ScaledAdam(ps, lr=LR, clipping_scale=2.0, scalar_lr_scale=0.1))
    moved = float(1.0 - w.mean())
    if update == "none":
        assert torch.equal(w, torch.ones_like(w))
    else:
        assert moved == pytest.approx(expect, rel=0.03), (moved, expect)
    if update != "master":
        assert opt.weight_update.rule == update
        st = next(iter(opt.state.values()))
        assert "param_fp32" not in st  # no hidden fp32 copy
        assert (KAHAN in st) == (update == "kahan")


def test_stochastic_rounding_is_unbiased():
    n = 20000
    g = torch.Generator().manual_seed(1234)
    for lo, frac in [(1.0, 0.125), (1.0, 0.5), (-0.75, 0.3125), (2.0**-9, 0.875), (-1232.0, 1 / 64)]:
        spacing = _bf16_spacing(lo)
        x = lo + math.copysign(frac * spacing, lo)  # exact in fp32, between two bf16 neighbours
        xs = torch.full((n,), x, dtype=torch.float32)
        assert float(xs[0]) == x
        r = stochastic_round(xs, g).double()
        assert set(r.unique().tolist()) <= {lo, lo + math.copysign(spacing, lo)}
        se = spacing * math.sqrt(frac * (1 - frac) / n)  # standard error of the mean of n Bernoulli roundings
        assert abs(float(r.mean()) - x) < 4 * se, (x, float(r.mean()), se)
        # round to nearest is biased by the whole distance to the nearer neighbour
        assert abs(float(xs.to(torch.bfloat16).double().mean()) - x) >= min(frac, 1 - frac) * spacing * 0.999
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = stochastic_round(special, g)
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and (out[3:] == 0).all()


def test_stochastic_rounding_generator_makes_it_reproducible():
    x = torch.rand(1000) * 3
    a = stochastic_round(x, torch.Generator().manual_seed(7))
    b = stochastic_round(x, torch.Generator().manual_seed(7))
    c = stochastic_round(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_adamw_bf16_matches_torch_adamw_on_fp32_parameters():
    # with fp32 parameters the rule writes nothing itself: the arithmetic must be torch's AdamW
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5, 7))
    b = nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours = AdamWBf16([b], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, update=Bf16Update("none"))
    for _ in range(6):
        grad = torch.randn(5, 7)
        a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_bf16_moments_need_stochastic_rounding():
    # v = 0.999 v + 0.001 x with x = 1 from v = 4: exactly 1 + 3 x 0.999^t. The per-step change (<= 0.003) is below
    # half the bf16 spacing at 4 (2^-7), so a round-to-nearest bf16 v never moves; stochastically rounded, its mean
    # follows the fp32 value.
    steps, n = 3000, 4096
    exact = 1 + 3 * 0.999 ** steps
    rule = Bf16Update("stochastic", moments="bf16")
    v_sr = rule.new_moment(torch.empty(n))
    v_sr.fill_(4.0)
    v_rn = v_sr.clone()
    for _ in range(steps):
        rule.store_moment(v_sr, rule.load_moment(v_sr).mul_(0.999).add_(0.001))
        v_rn.copy_(v_rn.float().mul_(0.999).add_(0.001))
    assert v_sr.dtype == torch.bfloat16
    assert torch.all(v_rn == 4.0)
    assert float(v_sr.double().mean()) == pytest.approx(exact, rel=0.01)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("optimizer", ["adamw", "scaled_adam"])
@pytest.mark.parametrize("update,moments", [("master", "fp32"), ("kahan", "fp32"), ("stochastic", "fp32"),
                                            ("none", "fp32"), ("kahan", "bf16"), ("stochastic", "bf16")])
def test_bytes_per_parameter_as_documented(optimizer, update, moments):
    torch.manual_seed(0)
    policy = get_policy("bf16", bf16_update=update, bf16_moments=moments == "bf16")
    model = policy.prepare_model(nn.Linear(128, 96))
    params = list(model.parameters())
    if optimizer == "adamw":
        factory = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    else:
        factory = lambda ps: ScaledAdam(ps, lr=1e-3)  # noqa: E731
    opt = policy.build_optimizer(params, factory)
    master_grads = []
    if isinstance(opt, MasterWeightOptimizer):  # the fp32 gradient copies exist while the inner step runs
        opt.inner.register_step_pre_hook(lambda o, a, k: master_grads.append(_storage_bytes(
            [m.grad for m in opt._masters])))
    model(torch.randn(4, 128, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values()]
    measured = _storage_bytes(params) + _storage_bytes([p.grad for p in params]) + _storage_bytes(state)
    if isinstance(opt, MasterWeightOptimizer):
        measured += _storage_bytes(opt._masters) + master_grads[0]
    numel = sum(p.numel() for p in params)
    # per tensor, besides the per-parameter bytes: torch AdamW keeps its step count as an fp32 tensor (4 B);
    # ScaledAdam keeps the RMS, the scale's second moment and 4 scale gradients (24 B)
    per_tensor = 24 if optimizer == "scaled_adam" else (4 if update == "master" else 0)
    assert measured == bytes_per_parameter(update, moments) * numel + per_tensor * len(params)
    for st in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq", "delta"):
            if k in st:
                assert st[k].dtype == (torch.bfloat16 if moments == "bf16" else torch.float32)


def test_policy_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="bf16_update must be one of .*kahan.*stochastic"):
        get_policy("bf16", bf16_update="sr")
    with pytest.raises(ValueError, match="applies to the bf16 policy only.*--precision bf16"):
        get_policy("amp-bf16", bf16_update="kahan")
    with pytest.raises(ValueError, match="bf16_moments needs --bf16-update kahan, stochastic or none"):
        get_policy("bf16", bf16_moments=True)
    p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="supports ScaledAdam and torch.optim.AdamW, not SGD.*--bf16-update master"):
        get_policy("bf16", bf16_update="kahan").build_optimizer([p], lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        get_policy("bf16", bf16_update="stochastic").build_optimizer(
            [p], lambda ps: torch.optim.AdamW(ps, amsgrad=True))
    d = get_policy("bf16", bf16_update="kahan", bf16_moments=True).describe()
    assert d["optimizer_update"] == "bf16 + Kahan compensation (bf16)" and d["optimizer_state"] == "bfloat16"


@pytest.mark.parametrize("optimizer", ["adamw", "scaled_adam"])
def test_state_dict_round_trip_restores_compensation_moments_and_generator(optimizer):
    def build():
        torch.manual_seed(0)
        policy = get_policy("bf16", bf16_update="stochastic", bf16_moments=True)
        model = policy.prepare_model(nn.Linear(6, 5))
        if optimizer == "adamw":
            return model, policy.build_optimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        return model, policy.build_optimizer(model.parameters(), lambda ps: ScaledAdam(ps, lr=1e-2))

    def step(model, opt, seed):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed)).bfloat16()
        model(x).float().square().sum().backward()
        opt.step()
        opt.zero_grad()

    m1, o1 = build()
    for s in range(3):
        step(m1, o1, s)
    sd = o1.state_dict()
    m2, o2 = build()
    m2.load_state_dict(m1.state_dict())
    o2.load_state_dict(sd)
    for s in range(3, 6):  # the same stochastic roundings follow in both
        step(m1, o1, s)
        step(m2, o2, s)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(o1.state.values(), o2.state.values()):
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    policy = get_policy("bf16", bf16_update="kahan", bf16_moments=True)
    model = policy.prepare_model(nn.Linear(6, 5))
    factory = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if optimizer == "adamw" else (
        lambda ps: ScaledAdam(ps, lr=1e-2))
    with pytest.raises(ValueError, match="saved with bf16 update 'stochastic'.*--bf16-update stochastic"):
        policy.build_optimizer(model.parameters(), factory).load_state_dict(sd)


def test_counters_tell_rounded_away_updates_from_kept_ones():
    # 1.0 + 1e-4 rounds back to 1.0 in bf16 (spacing 2^-7); 1.0 + 0.1 does not; 1.0 + 0 is no update at all
    rule = Bf16Update("none")
    rule.counting = True
    p = torch.ones(30, dtype=torch.bfloat16)
    target = torch.cat([torch.full((10,), 1.0 + 1e-4), torch.full((12,), 1.1), torch.ones(8)])
    rule.write(p, target, {})
    assert rule.take_counts() == (22, 10)
    assert rule.take_counts() == (0, 0)  # reset


def test_scaled_adam_stacked_and_per_tensor_paths_agree_under_kahan():
    # the stacked path (the default on accelerators) reads and writes the weights through the same rule; Kahan is
    # deterministic, so both paths must reach the same weights + compensation (up to fp32 summation order)
    def run(batched):
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(8, 4).bfloat16()), nn.Parameter(torch.randn(8, 4).bfloat16()),
              nn.Parameter(torch.randn(()).bfloat16())]
        opt = ScaledAdam(ps, lr=1e-3, clipping_scale=2.0, batched=batched, weight_update=Bf16Update("kahan"))
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
        return [p.float() + opt.state[p][KAHAN].float() if KAHAN in opt.state[p] else p.float() for p in ps]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
