"""A finite training step of the Conformer transducer under every precision policy on CPU,
through the same loop pieces the recipes use (no precision branches)."""

import pytest
import torch

from asrprec.models import build_transducer
from asrprec.precision import POLICIES, get_policy
from asrprec.training import TrainConfig, optimizer_from_config, scheduler_from_config, compute_loss


class CharTokenizer:
    blank_id = 0
    vocab_size = 6

    def encode(self, texts):
        return [[1 + (ord(c) % 5) for c in t] for t in texts]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(2, 60, 80, generator=g), "feature_lens": torch.tensor([60, 48]),
            "texts": ["abc", "de"], "cut_ids": ["a", "b"]}


@pytest.mark.parametrize("encoder", ["conformer"])
@pytest.mark.parametrize("name", POLICIES)
def test_finite_step_every_policy(name, encoder, tmp_path):
    torch.manual_seed(0)
    policy = get_policy(name, "cpu")
    model = policy.prepare_model(build_transducer(encoder=encoder, size="tiny", vocab_size=6))
    cfg = TrainConfig(exp_dir=str(tmp_path), optimizer="adamw", base_lr=1e-3)
    opt = optimizer_from_config(model, cfg, policy)
    sched = scheduler_from_config(opt, cfg)
    scaler = policy.make_scaler()
    scaler.watch(model)
    # the tensors the optimizer updates: the model's parameters, or their fp32 masters under bf16
    # (a bf16 weight itself only changes once its master crosses a bf16 rounding boundary)
    updated = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().float().clone() for p in updated]
    losses = []
    for step in range(2):
        sched.step_batch(step + 1)
        loss, info = compute_loss(model, batch(step), CharTokenizer(), policy)
        assert loss.dtype == torch.float32 and torch.isfinite(loss), (name, loss)
        scaler.scale(loss).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g.float()).all() for g in grads), name
        assert all(g.dtype == policy.param_dtype for g in grads)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    changed = sum(not torch.equal(b, p.detach().float()) for b, p in zip(before, updated))
    assert changed > 0.9 * len(before), f"{name}: only {changed}/{len(before)} parameters moved"
    if name == "bf16":
        assert all(p.dtype == torch.float32 for p in updated)  # fp32 master weights
    expect_dtype = torch.bfloat16 if name == "bf16" else torch.float32
    assert model.joiner.output_linear.weight.dtype == expect_dtype
