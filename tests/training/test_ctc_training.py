"""CTC heads through the real training loop: hybrid, CTC alone and CR-CTC train, and every loss part reaches the log,
tensorboard and history.json (per epoch, per frame), where the parts add up to the total."""

import logging
import math

import pytest
import torch

from asrprec.models import CtcConfig, Decoder, Joiner, LossConfig, Transducer
from asrprec.precision import get_policy
from asrprec.training import train
from asrprec.experiment import read_history

from ..reliability.tiny import LinearEncoder, Tok, batches, config


def make(kind: str) -> Transducer:
    torch.manual_seed(0)
    # the full loss (no warm-up of loss scales) and no CR warm-up, so that the logged parts add up exactly
    loss = LossConfig(loss="full", backend="torch", loss_warmup_batches=0)
    if kind == "hybrid":
        return Transducer(LinearEncoder(), Decoder(6, 16), Joiner(16, 16, 16, 6), loss=loss, ctc=CtcConfig())
    if kind == "ctc":
        return Transducer(LinearEncoder(), None, None, loss=loss, ctc=CtcConfig(), vocab_size=6)
    if kind == "hybrid-cr":
        return Transducer(LinearEncoder(), Decoder(6, 16), Joiner(16, 16, 16, 6), loss=loss,
                          ctc=CtcConfig(use_cr_ctc=True))
    return Transducer(LinearEncoder(), None, None, loss=loss, ctc=CtcConfig(use_cr_ctc=True), vocab_size=6)


# kind -> (the parts history.json must hold, total per frame from them)
CASES = {
    "hybrid": (("transducer_loss", "ctc_loss"), lambda h: h["train_transducer_loss"] + 0.2 * h["train_ctc_loss"]),
    "ctc": (("ctc_loss",), lambda h: h["train_ctc_loss"]),
    "hybrid-cr": (("transducer_loss", "ctc_loss", "cr_loss"),
                  lambda h: h["train_transducer_loss"] + 0.1 * h["train_ctc_loss"] + 0.02 * h["train_cr_loss"]),
    "cr": (("ctc_loss", "cr_loss"), lambda h: h["train_ctc_loss"] + 0.2 * h["train_cr_loss"]),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_ctc_models_train_and_report_every_loss_part(tmp_path, kind, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    parts, total = CASES[kind]
    caplog.set_level(logging.INFO, logger="asrprec")
    state = train(model=make(kind), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(4),
                  valid_dl=batches(2, 1), cfg=config(tmp_path, num_epochs=2, tensorboard=True))
    epochs = [e for e in read_history(tmp_path) if e.get("event") == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    for e in epochs:
        for k in parts:
            assert math.isfinite(e[f"train_{k}"]) and e[f"train_{k}"] >= 0, (k, e)
        absent = {"transducer_loss", "ctc_loss", "cr_loss"} - set(parts)
        assert not any(f"train_{k}" in e for k in absent), e
        assert math.isclose(e["train_loss"], total(e), rel_tol=1e-6), e
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert state.history[-1]["train_ctc_loss"] == epochs[-1]["train_ctc_loss"]
    step_lines = [r.getMessage() for r in caplog.records if " batch " in r.getMessage() and "/frame" in r.getMessage()]
    assert step_lines and all(f" {k.removesuffix('_loss')} " in step_lines[0] for k in parts), step_lines[:1]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {f"train/{k}" for k in parts} <= set(events.Tags()["scalars"])


def test_resume_keeps_the_epochs_loss_parts(tmp_path):
    """A run resumed mid-epoch reports the same per-epoch loss parts as an uninterrupted one."""
    a, b = tmp_path / "a", tmp_path / "b"
    policy = get_policy("fp32", "cpu")
    train(model=make("hybrid"), policy=policy, tokenizer=Tok(), train_dl=batches(4), valid_dl=batches(2, 1),
          cfg=config(a, num_epochs=1))
    train(model=make("hybrid"), policy=policy, tokenizer=Tok(), train_dl=batches(4), valid_dl=batches(2, 1),
          cfg=config(b, num_epochs=1, save_every_n=2, max_batches_per_epoch=2))
    train(model=make("hybrid"), policy=policy, tokenizer=Tok(), train_dl=batches(4), valid_dl=batches(2, 1),
          cfg=config(b, num_epochs=1, resume=str(b / "checkpoint-2.pt"), overwrite=True))
    full = [e for e in read_history(a) if e.get("event") == "epoch"][-1]
    resumed = [e for e in read_history(b) if e.get("event") == "epoch"][-1]
    for k in ("train_loss", "train_transducer_loss", "train_ctc_loss"):
        assert math.isclose(full[k], resumed[k], rel_tol=1e-6), k


def test_recipe_flags_build_every_combination_and_name_mistakes():
    from asrprec.models import build_model
    from asrprec.training.config import training_command_line

    cl = training_command_line(defaults={"model": {"encoder": "conformer", "size": "tiny"}})

    class Bpe:
        vocab_size, blank_id = 10, 0

    def build(*flags):
        options = cl.parse(list(flags)).model
        return options, *build_model(options, Bpe.vocab_size, Bpe.blank_id)

    args, model, config = build()
    assert model.use_transducer and not model.use_ctc and "ctc" not in config and "use_transducer" not in config
    assert args.data_spec_augment(True)
    args, model, config = build("--use-ctc")
    assert config["ctc"]["ctc_loss_scale"] == 0.2 and model.decoder is not None
    args, model, config = build("--use-transducer", "false", "--use-ctc", "1", "--use-cr-ctc", "true",
                                "--model.time_mask_ratio", "2.0")
    assert config["use_transducer"] is False and model.decoder is None
    assert (config["ctc"]["ctc_loss_scale"], config["ctc"]["cr_loss_scale"], config["ctc"]["time_mask_ratio"]) == \
        (1.0, 0.2, 2.0)
    assert not args.data_spec_augment(True)  # the model masks its two views itself
    for flags, message in [(("--use-transducer", "false"), "without a head"),
                           (("--use-cr-ctc",), "add --use-ctc"),
                           (("--use-ctc", "--model.cr_loss_scale", "0.1"), "add --use-cr-ctc")]:
        with pytest.raises(ValueError, match=message):
            build(*flags)
    with pytest.raises(SystemExit):
        cl.parse(["--use-ctc", "maybe"])
