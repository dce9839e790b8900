"""Precision policies: names, errors, mocked hardware, fp32 islands, dtypes, scalers, master weights."""

import copy
import dataclasses
import logging
import pickle

import pytest
import torch
from torch import nn

from asrprec.precision import (
    POLICIES,
    Capabilities,
    GradScaleCollapse,
    LossScaler,
    MasterWeightOptimizer,
    NoOpScaler,
    UnsupportedPrecisionError,
    effective_dtypes,
    fp32_island,
    get_policy,
    keep_fp32,
)
from asrprec.precision import capabilities as caps_mod
from asrprec.precision import policy as policy_mod


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = keep_fp32(nn.Linear(4, 8))
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = fp32_island(output="input")(self.frontend)(x)
        h = h.to(self.body.weight.dtype) if not torch.is_autocast_enabled("cpu") else h
        y = self.body(h)
        return y, self._stats(y)

    @fp32_island
    def _stats(self, y):
        return y.pow(2).mean(-1)


def test_policy_names_and_table():
    assert POLICIES == ("fp32", "amp-fp16", "amp-bf16", "bf16")
    expect = {
        "fp32": (torch.float32, torch.float32, False, False),
        "amp-fp16": (torch.float32, torch.float16, True, True),
        "amp-bf16": (torch.float32, torch.bfloat16, True, False),
        "bf16": (torch.bfloat16, torch.bfloat16, False, False),
    }
    for name, (param, compute, autocast, scaler) in expect.items():
        p = get_policy(name, "cpu")
        assert (p.param_dtype, p.compute_dtype, p.autocast_enabled, p.grad_scaler) == (param, compute, autocast, scaler)
        d = p.describe()
        assert d["policy"] == name and d["loss_dtype"] == "float32"


@pytest.mark.parametrize("bad,hint", [("fp16", "amp-fp16"), ("FP32", "did you mean"), ("int8", "choose one of")])
def test_unknown_policy_names_the_choices(bad, hint):
    with pytest.raises(ValueError, match=hint):
        get_policy(bad, "cpu")


def _fake_caps(bf16=True, fp16=True):
    return Capabilities("cpu", bf16, "" if bf16 else "emulated: no bf16 units", fp16, "" if fp16 else "no fp16",
                        True, "")


def test_hardware_without_bf16_refuses_bf16_policies(monkeypatch):
    monkeypatch.setattr(caps_mod, "probe", lambda device_type: _fake_caps(bf16=False))
    monkeypatch.setattr(policy_mod.capabilities, "probe", lambda device_type: _fake_caps(bf16=False))
    for name in ("amp-bf16", "bf16"):
        with pytest.raises(UnsupportedPrecisionError) as e:
            get_policy(name, "cpu")
        msg = str(e.value)
        assert "bfloat16" in msg and "no bf16 units" in msg and "never switches precision silently" in msg
    assert get_policy("amp-fp16", "cpu").compute_dtype == torch.float16  # the others still work
    assert get_policy("fp32", "cpu").compute_dtype == torch.float32


def test_hardware_without_fp16_refuses_amp_fp16(monkeypatch):
    monkeypatch.setattr(policy_mod.capabilities, "probe", lambda device_type: _fake_caps(fp16=False))
    with pytest.raises(UnsupportedPrecisionError, match="fp16 autocast"):
        get_policy("amp-fp16", "cpu")


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnsupportedPrecisionError, match="--device cpu"):
        get_policy("amp-bf16", "cuda")


def test_real_cpu_probe_runs_every_policy():
    c = caps_mod.probe("cpu")
    assert c.bf16 and c.fp16 and c.grad_scaler, c


def test_parameter_and_activation_dtypes_per_policy():
    x = torch.randn(2, 4)
    for name, param_dt, act_dt in [
        ("fp32", torch.float32, torch.float32),
        ("amp-fp16", torch.float32, torch.float16),
        ("amp-bf16", torch.float32, torch.bfloat16),
        ("bf16", torch.bfloat16, torch.bfloat16),
    ]:
        pol = get_policy(name, "cpu")
        m = pol.prepare_model(Tiny())
        assert m.body.weight.dtype == param_dt and m.norm.weight.dtype == param_dt
        assert m.frontend.weight.dtype == torch.float32  # declared fp32 island keeps its params
        with pol.autocast():
            y, stats = m(x.to(param_dt) if name == "bf16" else x)
        assert y.dtype == act_dt, name
        assert stats.dtype == torch.float32  # the statistics island always returns fp32
        assert set(effective_dtypes(m)) == ({"float32"} if param_dt == torch.float32 else {"float32", "bfloat16"})


def test_prepare_for_inference_casts_whole_model_but_islands():
    for name, dt in [("fp32", torch.float32), ("amp-bf16", torch.bfloat16), ("bf16", torch.bfloat16)]:
        m = get_policy(name, "cpu").prepare_for_inference(Tiny().train())
        assert not m.training and not any(p.requires_grad for p in m.parameters())
        assert m.body.weight.dtype == dt and m.frontend.weight.dtype == torch.float32


def test_scaler_kinds():
    assert isinstance(get_policy("amp-fp16").make_scaler(), LossScaler)
    for name in ("fp32", "amp-bf16", "bf16"):
        s = get_policy(name).make_scaler()
        assert type(s) is NoOpScaler and s.get_scale() == 1.0
        loss = torch.tensor(3.0)
        assert s.scale(loss) is loss


def test_grad_scaler_really_scales_and_skips_overflow():
    lin = nn.Linear(3, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    s = get_policy("amp-fp16").make_scaler(init_scale=256.0)
    s.watch(lin)
    loss = lin(torch.ones(1, 3)).sum()
    s.scale(loss).backward()
    assert torch.allclose(lin.bias.grad, torch.tensor([256.0]))  # the textbook d(256·(w·x+b))/db
    w0 = lin.weight.detach().clone()
    lin.weight.grad[0, 0] = float("inf")
    s.step(opt)
    s.update()
    assert torch.equal(lin.weight, w0)  # overflow step skipped
    assert s.get_scale() == 128.0 and s.last_bad == ["weight"]


def test_scaler_collapse_saves_and_explains(caplog):
    lin = nn.Linear(2, 1)
    s = LossScaler("cpu", init_scale=1e-6, abort_floor=1e-5)
    s.watch(lin)
    saved = []
    with pytest.raises(GradScaleCollapse, match="What to do"):
        s.check_health(batch_idx=1, on_collapse=lambda: saved.append(True))
    assert saved == [True]
    s = LossScaler("cpu", init_scale=1e-3, warn_floor=0.01)
    with caplog.at_level(logging.WARNING):
        s.check_health(batch_idx=3)
    assert "grad scale is small" in caplog.text


def test_noop_scaler_skips_nonfinite_and_aborts_after_many():
    lin = nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    s = NoOpScaler(max_consecutive_skips=2)
    s.watch(lin)
    for _ in range(2):
        lin.weight.grad = torch.full_like(lin.weight, float("nan"))
        lin.bias.grad = torch.zeros_like(lin.bias)
        assert s.step(opt) is False
    assert s.last_bad == ["weight"]
    with pytest.raises(GradScaleCollapse, match="diverged"):
        s.check_health(batch_idx=2)


def test_bf16_master_weights_keep_small_updates():
    """bf16's spacing below 1.0 is 2^-8: an AdamW step of lr = 1e-4 rounds away unless an fp32 master keeps it."""
    steps, lr = 100, 1e-4

    results = {}
    for update in ("master", "none"):
        pol = get_policy("bf16", bf16_update=update)
        m = pol.prepare_model(nn.Linear(1, 1, bias=False))
        with torch.no_grad():
            m.weight.fill_(1.0)
        opt = pol.build_optimizer(m.parameters(), lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))
        for _ in range(steps):
            m.weight.grad = torch.ones_like(m.weight)
            opt.step()
            opt.zero_grad()
        results[update] = float(m.weight.detach())
        if update == "master":
            assert isinstance(opt, MasterWeightOptimizer)
            assert opt.inner.param_groups[0]["params"][0].dtype == torch.float32
            assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert results["none"] == 1.0  # every update lost
    expect = 1.0 - steps * lr  # 0.99, whose nearest bf16 is 0.98828125 or 0.9921875
    assert abs(results["master"] - expect) <= 2**-8


def test_master_weight_optimizer_state_round_trip():
    pol = get_policy("bf16")
    m = pol.prepare_model(nn.Linear(3, 2))
    opt = pol.build_optimizer(m.parameters(), lambda ps: torch.optim.Adam(ps, lr=1e-2))
    for _ in range(3):
        m(torch.randn(4, 3, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    m2 = pol.prepare_model(nn.Linear(3, 2))
    opt2 = pol.build_optimizer(m2.parameters(), lambda ps: torch.optim.Adam(ps, lr=1e-2))
    opt2.load_state_dict(state)
    for a, b in zip(opt._masters, opt2._masters):
        assert torch.equal(a, b)
    assert torch.equal(m.weight, m2.weight)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_probe_works_where_autograd_is_off(ctx):
    # decode scripts resolve the policy under no_grad / inference_mode; the scaler probe must still see the truth
    from asrprec.precision import capabilities

    with ctx():
        caps = capabilities.probe("cpu")
        policy = get_policy("amp-fp16", "cpu")
    assert caps.grad_scaler, caps.grad_scaler_why
    assert policy.name == "amp-fp16"


def test_policy_is_immutable_through_and_through():
    p = get_policy("amp-fp16", "cpu", init_scale=2.0**10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "fp32"
    with pytest.raises(TypeError):
        p.scaler_kwargs["init_scale"] = 1.0  # the mapping is read-only too
    assert dict(p.scaler_kwargs) == {"init_scale": 2.0**10}
    assert p.make_scaler().get_scale() == 2.0**10 and p.make_scaler(init_scale=8.0).get_scale() == 8.0
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p), dataclasses.replace(p)):
        assert q == p and dict(q.scaler_kwargs) == {"init_scale": 2.0**10}
        with pytest.raises(TypeError):
            q.scaler_kwargs["init_scale"] = 1.0


def test_recipe_precision_flags_reach_the_policy():
    from asrprec.cli import ConfigCommandLine
    from asrprec.precision import PrecisionOptions
    from asrprec.training.config import TRAIN_FLAGS, TrainingConfig

    cl = ConfigCommandLine(TrainingConfig, [f for f in TRAIN_FLAGS if f.startswith("precision.")])

    def policy(*flags):
        options = cl.parse(list(flags)).precision
        assert isinstance(options, PrecisionOptions)
        return options.policy(options.device)

    desc = policy("--precision", "bf16", "--bf16-update", "kahan", "--precision.bf16_moments", "true",
                  "--device", "cpu").describe()
    assert desc["optimizer_state"] == "bfloat16" and "kahan" in desc["optimizer_update"].lower()
    with pytest.raises(ValueError, match="bf16 policy only"):
        policy("--precision", "amp-bf16", "--precision.bf16_moments", "true", "--device", "cpu")
