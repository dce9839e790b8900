"""Checkpoints are verified when their weights are read: a file changed since it was saved fails its recorded
digest, and NaN / Inf weights are refused naming the tensor (``allow_nonfinite`` loads them for debugging), on
every route to the weights: load, resume, ``--init-from``, epoch averaging and the running average."""

import hashlib
import json

import pytest
import torch

from asrprec import checkpoint as ckpt
from asrprec.checkpoint import CheckpointIntegrityError, NonFiniteWeightsError
from asrprec.errors import AsrprecError
from asrprec.precision import get_policy
from asrprec.training import train

from .test_bad_args import copy_of, recipe, trained  # noqa: F401  (trained: the module fixture)
from .tiny import Tok, batches, config, make_model

SAVED_PARAM = "encoder.proj.weight"  # 16 x 80 = 1,280 values


def run(exp, epochs=1, **kw):
    return train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(2),
                 valid_dl=batches(1, 1), cfg=config(exp, num_epochs=epochs, **kw))


def sha256_by_hand(state):
    """The digest written out another way: numpy's bytes of each tensor (fp32 / int64 only, as the tiny model's)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode() + t.numpy().tobytes())
    return h.hexdigest()


def one_line(e):
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, AsrprecError)
    return msg


def with_nans(path, n=1024, *, keep_digest):
    """Write ``n`` NaNs into ``SAVED_PARAM`` of ``path``: with the recorded digest kept (a file changed after it
    was written) or recomputed (weights that were NaN when saved, e.g. a diverged run)."""
    data = torch.load(path, weights_only=True)
    data["model"][SAVED_PARAM].view(-1)[:n] = float("nan")
    if not keep_digest:
        data["model_sha256"] = sha256_by_hand(data["model"])
    torch.save(data, path)
    return path.read_bytes()


def test_every_checkpoint_records_the_digest_of_its_weights(tmp_path):
    run(tmp_path)
    data = torch.load(tmp_path / "epoch-1.pt", weights_only=True)
    assert data["model_sha256"] == sha256_by_hand(data["model"])
    ckpt.load_checkpoint(tmp_path / "epoch-1.pt", ckpt.TrainingObjects(model=make_model()))  # verifies and loads


def test_a_checkpoint_changed_after_saving_fails_its_digest(tmp_path):
    run(tmp_path)
    path = tmp_path / "epoch-1.pt"
    data = torch.load(path, weights_only=True)
    data["model"]["joiner.output_linear.bias"][3] += 1e-3  # one value: still finite, still loadable
    torch.save(data, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointIntegrityError) as e:
        ckpt.load_checkpoint(path, ckpt.TrainingObjects(model=make_model()))
    msg = one_line(e)
    assert f"checkpoint {path} fails its integrity check" in msg and "changed or damaged since" in msg
    assert "Fix: delete it and use another checkpoint (present: epoch-1.pt)" in msg
    with pytest.raises(CheckpointIntegrityError):  # resuming reads it the same way
        run(tmp_path, epochs=2, resume="latest")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.glob("*.pt")) == ["epoch-1.pt"]


def test_nan_weights_are_refused_naming_the_tensor_and_load_when_allowed(tmp_path):
    run(tmp_path)
    path = tmp_path / "epoch-1.pt"
    written = with_nans(path, keep_digest=False)
    with pytest.raises(NonFiniteWeightsError) as e:
        ckpt.load_checkpoint(path, ckpt.TrainingObjects(model=make_model()))
    msg = one_line(e)
    assert f"checkpoint {path} holds non-finite weights: {SAVED_PARAM} has 1,024 NaN/Inf of 1,280 values" in msg
    assert "--allow-nonfinite" in msg and "earlier checkpoint" in msg
    model = make_model()
    ckpt.load_checkpoint(path, ckpt.TrainingObjects(model=model), options=ckpt.LoadOptions(allow_nonfinite=True))
    assert int(torch.isnan(model.encoder.proj.weight).sum()) == 1024
    with pytest.raises(NonFiniteWeightsError, match=SAVED_PARAM):
        run(tmp_path, epochs=2, resume="latest")
    assert path.read_bytes() == written and sorted(p.name for p in tmp_path.glob("*.pt")) == ["epoch-1.pt"]


def test_nan_weights_written_into_a_valid_checkpoint_are_caught(tmp_path):
    run(tmp_path)
    with_nans(tmp_path / "epoch-1.pt", keep_digest=True)
    with pytest.raises(CheckpointIntegrityError):
        ckpt.read_checkpoint(tmp_path / "epoch-1.pt", allow_nonfinite=True)  # the flag never hides damage


def test_a_checkpoint_without_a_digest_still_loads_and_is_checked_for_nan(tmp_path):
    run(tmp_path)
    path = tmp_path / "epoch-1.pt"
    data = torch.load(path, weights_only=True)
    del data["model_sha256"]  # as written before checkpoints recorded one
    torch.save(data, path)
    model = make_model()
    ckpt.load_checkpoint(path, ckpt.TrainingObjects(model=model))
    assert torch.equal(model.encoder.proj.weight, data["model"][SAVED_PARAM])
    data["model"][SAVED_PARAM][0, 0] = float("inf")
    torch.save(data, path)
    with pytest.raises(NonFiniteWeightsError, match=f"{SAVED_PARAM} has 1 NaN/Inf of 1,280"):
        ckpt.load_checkpoint(path, ckpt.TrainingObjects(model=make_model()))


def test_averaging_verifies_every_checkpoint(tmp_path):
    run(tmp_path, epochs=2, average_period=1)
    with_nans(tmp_path / "epoch-1.pt", keep_digest=False)
    with pytest.raises(NonFiniteWeightsError) as e:
        ckpt.load_decoding_weights(make_model(), tmp_path, 2, 2)
    assert f"checkpoint {tmp_path / 'epoch-1.pt'} holds non-finite weights: {SAVED_PARAM}" in one_line(e)
    model = make_model()
    ckpt.load_decoding_weights(model, tmp_path, 2, 2, allow_nonfinite=True)
    assert int(torch.isnan(model.encoder.proj.weight).sum()) == 1024  # a mean with NaN is NaN
    # the running average is no part of the digest: a NaN in it is caught in the mean it gives
    path = tmp_path / "epoch-2.pt"
    data = torch.load(path, weights_only=True)
    data["model_avg"]["weights"][SAVED_PARAM][0, :5] = float("nan")
    torch.save(data, path)
    with pytest.raises(NonFiniteWeightsError, match=f"its running average.*{SAVED_PARAM} has 5 NaN/Inf"):
        ckpt.load_decoding_weights(make_model(), tmp_path, 2, 2, use_averaged_model=True)


def test_init_from_goes_through_the_same_check(tmp_path):
    run(tmp_path / "a")
    source = tmp_path / "a" / "epoch-1.pt"
    with_nans(source, keep_digest=False)
    with pytest.raises(NonFiniteWeightsError) as e:
        run(tmp_path / "b", init_from=str(source))
    assert f"checkpoint {source} holds non-finite weights: {SAVED_PARAM}" in one_line(e)
    assert not list((tmp_path / "b").glob("*.pt"))


def test_decode_refuses_nan_weights_in_one_line_and_loads_them_when_asked(trained, data_root, tmp_path):  # noqa: F811
    exp = copy_of(trained, tmp_path)
    data = torch.load(exp / "epoch-2.pt", weights_only=True)
    name = next(k for k, v in data["model"].items() if v.is_floating_point() and v.numel() >= 8)
    data["model"][name].view(-1)[:8] = float("nan")
    data["model_sha256"] = ckpt.weights_digest(data["model"])
    torch.save(data, exp / "epoch-2.pt")
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", exp, "--epoch", 2, "--splits", "dev")
    assert out.code == 2 and "\n" not in out.error
    assert f"holds non-finite weights: {name} has 8 NaN/Inf" in out.error and "--allow-nonfinite" in out.error
    assert not list(exp.glob("recogs-*"))
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", exp, "--epoch", 2, "--splits", "dev",
                 "--allow-nonfinite")
    assert out.code is None, out.text
    assert "loading it anyway (allow_nonfinite)" in out.text
    json.loads(next(exp.glob("wer-summary-*.json")).read_text())
