"""Resume under the bf16 policy's Kahan and stochastic updates: an interrupted and resumed run equals an
uninterrupted one bitwise (the compensation buffers and the rounding generator travel in the checkpoint)."""

import pytest
import torch

from asrprec.optim.bf16_update import KAHAN, STATE_KEY
from asrprec.precision import get_policy
from asrprec.training import train

from ..reliability.tiny import Tok, batches, config, make_model


@pytest.mark.parametrize("optimizer", ["adamw", "scaled_adam"])
@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_resume_equals_uninterrupted(tmp_path, update, optimizer):
    policy = get_policy("bf16", "cpu", bf16_update=update)
    a, b = tmp_path / "a", tmp_path / "b"

    def run(exp_dir, **kw):
        return train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=batches(4, 0),
                     valid_dl=batches(2, 1), cfg=config(exp_dir, optimizer=optimizer, **kw))

    state = run(a, num_epochs=3)
    run(b, num_epochs=2)
    state_b = run(b, num_epochs=3, start_epoch=3)
    assert state_b.batch_idx_train == state.batch_idx_train == 12
    full = torch.load(a / "epoch-3.pt", weights_only=True)
    res = torch.load(b / "epoch-3.pt", weights_only=True)
    assert full["model"]["joiner.output_linear.weight"].dtype == torch.bfloat16
    for k in full["model"]:
        assert torch.equal(full["model"][k], res["model"][k]), k
    rule = full["optimizer"][STATE_KEY]
    assert rule["rule"] == update
    if update == "stochastic":
        assert rule["generators"]["cpu"].dtype == torch.uint8
        assert torch.equal(rule["generators"]["cpu"], res["optimizer"][STATE_KEY]["generators"]["cpu"])
    states = list(full["optimizer"]["state"].values())
    assert all((KAHAN in st) == (update == "kahan") for st in states)
    if update == "kahan":
        assert any(st[KAHAN].abs().sum() > 0 for st in states)  # the buffers hold something to restore
        for i, st in full["optimizer"]["state"].items():
            assert torch.equal(st[KAHAN], res["optimizer"]["state"][i][KAHAN])
