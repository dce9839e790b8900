"""TDT through the training loop and the recipe flags: training learns, a resume continues exactly (with omega's
random draws), and model.json carries the durations so that decoding rebuilds the duration head."""

import json
import math

import pytest
import torch

from asrprec.models import Decoder, Joiner, LossConfig, Transducer, build_transducer
from asrprec.precision import get_policy
from asrprec.training import train
from asrprec.models import build_model
from asrprec.training.config import training_command_line

from ..reliability.tiny import LinearEncoder, Tok, batches, config


def make_tdt(omega=0.0, aux="simple"):
    torch.manual_seed(0)
    durations = (0, 1, 2)
    return Transducer(LinearEncoder(), Decoder(6, 16), Joiner(16, 16, 16, 6, durations=durations),
                      loss=LossConfig(loss="tdt", tdt_durations=durations, tdt_omega=omega, tdt_aux=aux,
                                      loss_warmup_batches=8))


def _run(exp_dir, model, epochs, **kw):
    return train(model=model, policy=get_policy(kw.pop("precision", "fp32"), "cpu"), tokenizer=Tok(),
                 train_dl=batches(4), valid_dl=batches(2, 1), cfg=config(exp_dir, num_epochs=epochs, **kw))


def test_training_learns_both_parts(tmp_path):
    state = _run(tmp_path, make_tdt(), 6)
    losses = [h["train_loss"] for h in state.history]
    assert losses[-1] < 0.7 * losses[0], losses
    ck = torch.load(tmp_path / "epoch-6.pt", weights_only=False)["model"]
    assert ck["joiner.output_linear.weight"].shape == (6 + 3, 16)


@pytest.mark.parametrize("precision,omega", [("fp32", 0.0), ("fp32", 0.5), ("bf16", 0.0)])
def test_resume_equals_uninterrupted(tmp_path, precision, omega):
    """omega > 0 draws from torch's generator on every batch: the checkpoint's generator states make the resumed
    run draw the same RNN-T / TDT choices."""
    a, b = tmp_path / "a", tmp_path / "b"
    full = _run(a, make_tdt(omega), 3, precision=precision)
    _run(b, make_tdt(omega), 2, precision=precision)
    resumed = _run(b, make_tdt(omega), 3, precision=precision, start_epoch=3)
    assert resumed.batch_idx_train == full.batch_idx_train == 12
    want = torch.load(a / "epoch-3.pt", weights_only=False)["model"]
    got = torch.load(b / "epoch-3.pt", weights_only=False)["model"]
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert math.isclose(full.history[-1]["valid_loss"], resumed.history[-1]["valid_loss"], rel_tol=1e-6)


class _Tok:
    vocab_size, blank_id = 30, 0


def _args(*flags):
    return training_command_line().parse(list(flags)).model


def build_model_from_args(options, tok):
    return build_model(options, tok.vocab_size, tok.blank_id)


def test_flags_reach_the_model_and_model_json_rebuilds_it():
    args = _args("--loss", "tdt", "--model.tdt_durations", "0,1,2,4", "--model.tdt_sigma", "0.05", "--model.tdt_omega", "0.1",
                 "--model.tdt_aux", "none")
    model, model_config = build_model_from_args(args, _Tok())
    cfg = model.loss_config
    assert model.durations == (0, 1, 2, 4) and (cfg.tdt_sigma, cfg.tdt_omega, cfg.tdt_aux) == (0.05, 0.1, "none")
    stored = json.loads(json.dumps(model_config))  # what model.json holds
    assert stored["loss"]["tdt_durations"] == [0, 1, 2, 4]
    rebuilt = build_transducer(**stored)
    assert rebuilt.durations == (0, 1, 2, 4) and rebuilt.loss_config == cfg
    rebuilt.load_state_dict(model.state_dict())  # the same architecture, duration head included
    # an RNN-T model.json (no TDT keys) rebuilds an RNN-T joiner
    plain, plain_config = build_model_from_args(_args("--loss", "full"), _Tok())
    assert "tdt_durations" not in plain_config["loss"] and build_transducer(**plain_config).durations == ()


@pytest.mark.parametrize("value,message", [("0,2", "do not contain 1"), ("2,1", "strictly increasing"),
                                           ("a,b", "comma-separated")])
def test_bad_durations_flag_names_the_fix(value, message, capsys):
    with pytest.raises(SystemExit):
        _args("--loss", "tdt", "--model.tdt_durations", value)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_step_like_one_process_on_the_union(tmp_path):
    """DDP (torchrun, 2 CPU processes): two steps of a TDT model on each rank's shard give the parameters of one
    process stepping on the union of the ranks' batches (gradients summed over ranks, the loss a sum)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    worker = Path(__file__).with_name("_tdt_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(worker), str(tmp_path)], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    spec = importlib.util.spec_from_file_location("asrprec_tests_tdt_ddp_worker", worker)
    worker_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_module)
    W = worker_module.W
    model = worker_module.make_tdt_model()
    train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(),
          train_dl=W.Loader(W.union(W.make_batches(4)), 2.0), valid_dl=W.make_batches(2, 1),
          cfg=W.train_cfg(tmp_path / "single", num_epochs=1, ref_duration=1.0))
    want = W.params(model)
    r0, r1 = (torch.load(tmp_path / f"tdt-rank{r}.pt", weights_only=True) for r in (0, 1))
    for k in want:
        assert torch.equal(r0[k], r1[k]), k  # the replicas stay identical
        torch.testing.assert_close(r0[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    start = W.params(worker_module.make_tdt_model())
    assert not torch.equal(want["joiner.output_linear.weight"], start["joiner.output_linear.weight"])


def test_feature_width_reaches_the_model_and_model_json_rebuilds_it():
    """``--data.num_mel_bins 40`` (``build_model(num_features=40)``): the encoder takes 40-bin features and refuses
    80, model.json records the width (an 80-bin record stays without it) and rebuilds the same architecture; an
    override naming another width is refused with the fix."""
    torch.manual_seed(0)
    model, model_config = build_model(_args(), _Tok().vocab_size, 0, num_features=40)
    stored = json.loads(json.dumps(model_config))
    assert stored["encoder_overrides"]["num_features"] == 40
    rebuilt = build_transducer(**stored)
    rebuilt.load_state_dict(model.state_dict())  # strict: the front-end's shapes agree
    rebuilt.eval()
    out, lens = rebuilt.encoder(torch.randn(2, 60, 40), torch.tensor([60, 50]))
    assert out.shape[0] == 2 and torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"\(B, T, 40\)"):
        rebuilt.encoder(torch.randn(2, 60, 80), torch.tensor([60, 50]))
    _, plain = build_model(_args(), _Tok().vocab_size, 0, num_features=80)
    assert "num_features" not in plain["encoder_overrides"]
    with pytest.raises(ValueError, match="drop num_features from the overrides"):
        build_model(_args("--model.encoder_overrides", '{"num_features": 80}'), _Tok().vocab_size, 0, num_features=40)
