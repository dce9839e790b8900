"""The training loop end to end on an in-memory dataset: checkpoints, resume, tensorboard, averaging."""

import math

import pytest
import torch

from asrprec.checkpoint import CheckpointMismatchError, average_checkpoints, find_epoch_checkpoints
from asrprec.models import Decoder, Joiner, Transducer
from asrprec.precision import get_policy
from asrprec.training import train

from ..reliability.tiny import LinearEncoder, Tok, batches, config, make_model


def loader(n=4, seed=0):
    return batches(n, seed)


def cfg(tmp_path, **kw):
    return config(tmp_path, **{"tensorboard": True, "average_period": 200, **kw})


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "bf16"])
def test_resume_equals_uninterrupted(tmp_path, precision):
    policy = get_policy(precision, "cpu")
    a, b = tmp_path / "a", tmp_path / "b"
    state = train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
                  cfg=cfg(a, num_epochs=3))
    assert [h["epoch"] for h in state.history] == [1, 2, 3]
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(b, num_epochs=2))
    resumed = make_model()
    state_b = train(model=resumed, policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
                    cfg=cfg(b, num_epochs=3, start_epoch=3))
    assert state_b.batch_idx_train == state.batch_idx_train == 12
    full = torch.load(a / "epoch-3.pt", weights_only=False)["model"]
    res = torch.load(b / "epoch-3.pt", weights_only=False)["model"]
    for k in full:
        assert torch.equal(full[k], res[k]), k
    assert math.isclose(state.history[-1]["valid_loss"], state_b.history[-1]["valid_loss"], rel_tol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_init_from_starts_from_the_checkpoints_weights(tmp_path, precision):
    # the other route: the same weights loaded by hand with load_state_dict before a plain new run
    policy = get_policy(precision, "cpu")
    train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=loader(),
          valid_dl=loader(2, 1), cfg=cfg(tmp_path / "a", num_epochs=1))
    source = tmp_path / "a" / "epoch-1.pt"
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(tmp_path / "b", num_epochs=1, init_from=str(source)))
    by_hand = make_model()
    by_hand.load_state_dict(torch.load(source, weights_only=False)["model"])
    train(model=by_hand, policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(tmp_path / "c", num_epochs=1))
    got = torch.load(tmp_path / "b" / "epoch-1.pt", weights_only=False)["model"]
    want = torch.load(tmp_path / "c" / "epoch-1.pt", weights_only=False)["model"]
    fresh = make_model().state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert any(not torch.equal(got[k].float(), fresh[k]) for k in fresh)


def test_init_from_a_checkpoint_of_another_model_names_the_fix(tmp_path):
    train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=loader(),
          valid_dl=loader(2, 1), cfg=cfg(tmp_path / "a", num_epochs=1))
    other = Transducer(LinearEncoder(), Decoder(6, 24), Joiner(16, 24, 16, 6))  # a wider decoder
    with pytest.raises(CheckpointMismatchError, match="--init-from .* does not fit this model.*Fix: pass a checkpoint"):
        train(model=other, policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
              cfg=cfg(tmp_path / "b", num_epochs=1, init_from=str(tmp_path / "a" / "epoch-1.pt")))


def test_training_learns_and_writes_artifacts(tmp_path):
    state = train(model=make_model(), policy=get_policy("amp-bf16"), tokenizer=Tok(), train_dl=loader(),
                  valid_dl=loader(2, 0), cfg=cfg(tmp_path, num_epochs=6))
    losses = [h["train_loss"] for h in state.history]
    assert losses[-1] < 0.7 * losses[0], losses
    assert (tmp_path / "tensorboard").is_dir() and list((tmp_path / "tensorboard").iterdir())
    ck = torch.load(tmp_path / "epoch-6.pt", weights_only=False)
    assert "policy" in ck and "amp-bf16" in str(ck["policy"])
    paths = find_epoch_checkpoints(tmp_path, 6, 3)
    avg = average_checkpoints(paths)
    w = [torch.load(p, weights_only=False)["model"]["joiner.output_linear.weight"] for p in paths]
    assert torch.allclose(avg["joiner.output_linear.weight"], sum(w) / 3, atol=1e-6)


def test_nonfinite_loss_batch_is_skipped(tmp_path, caplog):
    data = loader()
    data[1]["features"][0, 0, 0] = float("nan")
    state = train(model=make_model(), policy=get_policy("fp32"), tokenizer=Tok(), train_dl=data,
                  valid_dl=loader(2, 1), cfg=cfg(tmp_path, num_epochs=1, max_skipped_fraction=0.5))
    assert "skipped, non-finite loss" in caplog.text and "cuts: c1a, c1b" in caplog.text
    assert state.history[0]["skipped_batches"] == {"non-finite loss": 1} and state.history[0]["steps"] == 3
    assert math.isfinite(state.history[0]["valid_loss"])


class RecordingEncoder(LinearEncoder):
    """Records the batch_count the loop hands it at each forward."""

    def __init__(self):
        super().__init__()
        self.batch_count = 0.0
        self.seen = []

    def forward(self, x, lens):
        if self.training:
            self.seen.append(self.batch_count)
        return super().forward(x, lens)


def test_encoder_schedule_scale_speeds_encoder_schedules_only(tmp_path):
    torch.manual_seed(0)
    enc = RecordingEncoder()
    model = Transducer(enc, Decoder(6, 16), Joiner(16, 16, 16, 6))
    train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=loader(3), valid_dl=loader(1, 1),
          cfg=cfg(tmp_path, num_epochs=1, encoder_schedule_scale=10.0))
    assert enc.seen == [10.0, 20.0, 30.0]
    assert model.batch_count == 3  # the transducer's own warm-ups (loss scales) keep the real batch count


def test_encoder_schedule_scale_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="encoder_schedule_scale"):
        cfg(tmp_path, encoder_schedule_scale=0.0)


def test_encoder_overrides_flag_parses_json_and_rejects_non_objects():
    from asrprec.training.config import training_command_line

    cl = training_command_line()
    assert cl.parse(["--model.encoder_overrides", '{"dropout": 0.0}']).model.encoder_overrides == {"dropout": 0.0}
    for bad in ("[1]", "{dropout: 0}"):
        with pytest.raises(SystemExit):
            cl.parse(["--model.encoder_overrides", bad])


def test_causal_flags_become_zipformer_overrides():
    from asrprec.decoding.experiment import decoding_command_line
    from asrprec.training.config import training_command_line

    cl = training_command_line()

    def overrides(*flags):
        return cl.parse(list(flags)).model.all_encoder_overrides()

    assert overrides("--encoder", "zipformer", "--causal", "--model.chunk_size", "16,32,-1",
                     "--model.left_context_frames", "64,-1", "--model.encoder_overrides", '{"pos_dim": 16}') == \
        {"pos_dim": 16, "causal": True, "chunk_size": [16, 32, -1], "left_context_frames": [64, -1]}
    assert overrides("--encoder", "zipformer") == {}
    with pytest.raises(ValueError, match="need --encoder zipformer"):
        overrides("--encoder", "conformer", "--causal")
    defaults = cl.parse([]).model  # the library's recommended setup, as build_transducer's defaults
    assert (defaults.encoder, defaults.loss) == ("zipformer", "pruned")
    with pytest.raises(ValueError, match="add --causal"):
        overrides("--encoder", "zipformer", "--model.chunk_size", "32")
    for bad in ("16,x", "16,0", "-2"):
        with pytest.raises(SystemExit):
            cl.parse(["--model.chunk_size", bad])
    got = decoding_command_line().parse(["--epoch", "3", "--chunk-size", "32", "--left-context-frames", "256"]).decode
    assert (got.chunk_size, got.left_context_frames) == (32, 256)


def test_running_average_is_kept_saved_and_resumed(tmp_path):
    """The loop samples the weights every --average-period batches into each checkpoint; a resumed run carries the
    same average on (the averaging itself is checked against explicit means in tests/test_model_averaging.py)."""
    policy = get_policy("fp32", "cpu")
    a, b = tmp_path / "a", tmp_path / "b"
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(a, num_epochs=3, average_period=3))
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(b, num_epochs=2, average_period=3))
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(b, num_epochs=3, start_epoch=3, average_period=3))
    saved = [torch.load(d / "epoch-3.pt", weights_only=True)["model_avg"] for d in (a, b)]
    assert saved[0]["count"] == saved[1]["count"] == 4  # batches 3, 6, 9, 12
    for k, v in saved[0]["weights"].items():
        assert torch.equal(v, saved[1]["weights"][k]), k
    one = torch.load(a / "epoch-1.pt", weights_only=True)
    assert one["model_avg"]["count"] == 1  # batch 3 of the first 4
    # the average is not the last model
    assert not torch.equal(one["model_avg"]["weights"]["encoder.proj.weight"].float(),
                           one["model"]["encoder.proj.weight"])
    off = tmp_path / "off"
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=loader(), valid_dl=loader(2, 1),
          cfg=cfg(off, num_epochs=1, average_period=0))
    assert "model_avg" not in torch.load(off / "epoch-1.pt", weights_only=True)


def test_train_config_from_dict_names_a_misspelt_key():
    from asrprec.training import TrainConfig

    assert TrainConfig.from_dict({"exp_dir": "x", "num_epochs": 3}).num_epochs == 3
    with pytest.raises(ValueError, match=r"unknown TrainConfig keys \['num_epoch'\] \(did you mean 'num_epochs'"):
        TrainConfig.from_dict({"exp_dir": "x", "num_epoch": 3})
