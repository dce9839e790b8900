"""Each bad argument, folder or checkpoint gives an error naming the file and the fix (never a traceback from
torch, never "pass weights_only=False" for a broken file), and an experiment folder cannot mix two runs.

The recipes run in-process (their ``main`` through ``runpy``), with the tiny model of :mod:`corpus`.
"""

import json
import logging
import runpy
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from asrprec.checkpoint import CheckpointPolicyWarning

from .corpus import TINY_OVERRIDES

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "espeak"
FAST = ("--train.progress_bar", "false", "--train.tensorboard", "false", "--threads", "1", "--max-duration", "4", "--train.log_interval", "1",
        "--model.encoder_overrides", json.dumps(TINY_OVERRIDES))


@dataclass
class Outcome:
    code: object  # None when main returned, else the SystemExit code (2 for a user error, or argparse's message)
    error: str  # the error the user reads: run_main's "<script>: error: ..." line on stderr, or the exit message
    text: str  # the error, stdout and the log


def recipe(script, *args, fast=True, **_):
    """Run ``recipes/espeak/<script>`` with ``args`` in this process, as ``python script args`` would."""
    argv = [str(RECIPES / script), *(FAST if fast and script == "train.py" else ()), *map(str, args)]
    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()
    log_lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            log_lines.append(record.getMessage())

    saved_argv, code = sys.argv, None
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            logging.getLogger("asrprec").addHandler(keep := Keep())
            try:
                runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as e:
                code = e.code
            finally:
                logging.getLogger("asrprec").removeHandler(keep)
    finally:
        sys.argv = saved_argv
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        torch.set_num_threads(threads)
    mark = f"{Path(argv[0]).name}: error: "
    error = err.getvalue()[err.getvalue().rfind(mark):].strip() if mark in err.getvalue() else str(code or "")
    return Outcome(code, error, "\n".join([error, out.getvalue(), *log_lines]))


@pytest.fixture(scope="module")
def trained(data_root, tmp_path_factory):
    """A finished two-epoch run with mid-epoch checkpoints (checkpoint-2.pt, checkpoint-4.pt)."""
    exp = tmp_path_factory.mktemp("trained") / "exp"
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 2, "--train.max_batches_per_epoch",
                 2, "--train.save_every_n", 2)
    assert out.code is None, out.text
    return exp


def copy_of(exp, tmp_path):
    dst = tmp_path / "exp"
    shutil.copytree(exp, dst)
    return dst


def test_a_new_run_in_a_folder_with_another_runs_checkpoints_is_refused(trained, data_root, tmp_path):
    exp = copy_of(trained, tmp_path)
    before = sorted(p.name for p in exp.iterdir())
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 1)
    assert "holds the checkpoints of an earlier run (checkpoint-2.pt, checkpoint-4.pt, epoch-1.pt, epoch-2.pt)" \
        in out.error and "--resume latest" in out.error and "--overwrite" in out.error
    assert out.code == 2 and "\n" not in out.error  # run_main: one line, exit code 2 (a user error)
    assert sorted(p.name for p in exp.iterdir()) == before  # nothing touched
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 1, "--train.max_batches_per_epoch", 1,
                 "--overwrite")
    assert out.code is None, out.text
    assert sorted(p.name for p in exp.glob("*.pt")) == ["epoch-1.pt"]  # the old run's epoch-2.pt is gone
    events = json.loads((exp / "history.json").read_text())
    assert [e["event"] for e in events][-3:] == ["overwrite", "start", "epoch"]
    assert "epoch-2.pt" in events[-3]["deleted"]


def test_each_resume_argument_names_the_missing_checkpoint(trained, data_root, tmp_path):
    exp = copy_of(trained, tmp_path)
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 3, "--train.start_batch", 3)
    assert f"checkpoint {exp / 'checkpoint-3.pt'} does not exist (checkpoints in {exp}: epoch-1.pt, epoch-2.pt, " \
           "checkpoint-2.pt, checkpoint-4.pt)" in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 3, "--train.start_epoch", 5)
    assert "start_epoch 5 > num_epochs 3: nothing to train" in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", tmp_path / "empty", "--resume", "latest")
    assert "--resume latest: no complete checkpoint in" in out.error and "without --resume" in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--resume", "latest", "--train.start_epoch", 2)
    assert "--resume and --start-epoch each name a checkpoint to resume from; pass only one" in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--train.max_skipped_fraction", 2)
    assert "max_skipped_fraction must be in [0, 1]" in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 2, "--resume", "latest")
    assert "ends epoch 2 and --num-epochs is 2: nothing to train. Fix: raise --num-epochs" in out.error


def test_resuming_from_an_older_checkpoint_would_mix_two_continuations(trained, data_root, tmp_path):
    exp = copy_of(trained, tmp_path)
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 2, "--train.start_batch", 2,
                 "--train.max_batches_per_epoch", 2)
    assert "checkpoint-2.pt is not the newest checkpoint" in out.error and "epoch-1.pt" in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 2, "--train.start_batch", 2,
                 "--train.max_batches_per_epoch", 2, "--overwrite")
    assert out.code is None, out.text
    events = json.loads((exp / "history.json").read_text())
    assert events[-4]["event"] == "overwrite" and sorted(events[-4]["deleted"]) == ["checkpoint-4.pt", "epoch-1.pt",
                                                                                   "epoch-2.pt"]


def test_another_model_cannot_resume_a_run(trained, data_root, tmp_path):
    exp = copy_of(trained, tmp_path)
    model_json = (exp / "model.json").read_text()
    other = json.dumps({**TINY_OVERRIDES, "encoder_dim": 40, "encoder_unmasked_dim": 40})
    args = ("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 3, "--resume", "latest",
            "--model.encoder_overrides", other)
    out = recipe(*args)
    assert "model.json records another model than the one this command builds (encoder_overrides.encoder_dim: " \
           "[32, 32, 32] -> [40, 40, 40]" in out.error and "another --exp-dir" in out.error
    assert (exp / "model.json").read_text() == model_json  # the run stays decodable
    from asrprec.checkpoint import CheckpointMismatchError
    from asrprec.experiment import check_model_config

    with pytest.raises(CheckpointMismatchError, match="another --exp-dir"):
        check_model_config(exp, {**json.loads(model_json), "context_size": 3})
    (exp / "model.json").unlink()  # without the record, the checkpoint itself refuses, naming the file
    out = recipe(*args)
    assert f"the checkpoint {exp / 'epoch-2.pt'} does not fit this model" in out.error
    assert "CheckpointMismatchError" not in out.error and "size mismatch" not in out.error
    assert not (exp / "model.json").exists()  # written only after a resume succeeded


def test_a_resume_under_another_precision_policy_warns(tmp_path, caplog):
    from asrprec.precision import get_policy
    from asrprec.training import train

    from .tiny import Tok, batches, config, make_model

    def resume(precision, epochs):
        return train(model=make_model(), policy=get_policy(precision, "cpu"), tokenizer=Tok(), train_dl=batches(2),
                     valid_dl=batches(1, 1), cfg=config(tmp_path, num_epochs=epochs, resume="latest" if epochs > 1
                                                         else ""))

    resume("fp32", 1)
    caplog.set_level("WARNING", logger="asrprec.training")
    with pytest.warns(CheckpointPolicyWarning, match="saved under precision policy 'fp32'"):
        resume("amp-bf16", 2)
    assert "was saved under precision fp32 and training continues under amp-bf16" in caplog.text
    # bf16 keeps fp32 master weights in its optimizer: that state cannot come from a plain optimizer
    from asrprec.checkpoint import CheckpointMismatchError

    with pytest.raises(CheckpointMismatchError, match=r"Fix: resume under the saved policy \(--precision amp-bf16\)"), \
            pytest.warns(CheckpointPolicyWarning):
        resume("bf16", 3)


def test_broken_checkpoints_are_named_with_the_fix(trained, data_root, tmp_path):
    exp = copy_of(trained, tmp_path)
    (exp / "epoch-2.pt").write_bytes(b"")
    (exp / ".tmp-abc123-epoch-3.pt").write_bytes(b"partial")
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 3, "--train.start_epoch", 3)
    msg = out.error
    assert f"checkpoint {exp / 'epoch-2.pt'} is empty (0 bytes)" in msg and "delete it" in msg
    assert "--resume latest" in msg and "weights_only" not in msg
    assert not (exp / ".tmp-abc123-epoch-3.pt").exists()  # a killed write's leftover is removed on start
    data = (exp / "checkpoint-4.pt").read_bytes()
    (exp / "checkpoint-4.pt").write_bytes(data[: len(data) // 2])
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 3, "--train.start_batch", 4)
    assert f"checkpoint {exp / 'checkpoint-4.pt'} ({len(data) // 2:,} bytes) cannot be read: it is truncated or " \
           "corrupt" in out.error and "weights_only" not in out.error
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 2, "--resume", "latest",
                 "--train.max_batches_per_epoch", 2, "--overwrite")
    assert "--overwrite with --resume latest" in out.error
    # --resume latest passes over both broken files (with a warning naming each) to the newest complete one, and
    # the resumed run writes them anew
    out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 2, "--resume", "latest",
                 "--train.max_batches_per_epoch", 2)
    assert out.code is None and f"resumed from {exp / 'epoch-1.pt'}" in out.text, out.text
    assert f"skipping {exp / 'epoch-2.pt'}: checkpoint {exp / 'epoch-2.pt'} is empty" in out.text
    assert f"skipping {exp / 'checkpoint-4.pt'}" in out.text
    assert torch.load(exp / "epoch-2.pt", weights_only=True)["extra"]["batch_idx_train"] == 4


def test_decode_errors_name_the_folder_and_file(trained, data_root, tmp_path):
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", tmp_path / "nowhere", "--epoch", 1)
    assert f"the experiment folder {tmp_path / 'nowhere'} does not exist. Fix: pass the --exp-dir" in out.error
    exp = copy_of(trained, tmp_path)
    text = (exp / "model.json").read_text()
    (exp / "model.json").write_text(text[: len(text) // 2])
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", exp, "--epoch", 1)
    assert f"{exp / 'model.json'} is not valid JSON" in out.error and "truncated" in out.error


def test_decode_needs_only_the_decoded_split(trained, data_root, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("bpe.model", "espeak_cuts_test_fbank.jsonl.gz"):
        shutil.copy(data_root / name, data / name)  # no train or dev manifest
    exp = copy_of(trained, tmp_path)
    out = recipe("decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 2, "--splits", "test")
    assert out.code is None and "test: WER" in out.text, out.text
    out = recipe("decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 2, "--splits", "dev")
    assert f"{data / 'espeak_cuts_dev_fbank.jsonl.gz'} is missing" in out.error


def test_a_file_where_a_folder_goes_is_named_with_the_fix(trained, data_root, tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("a file, not a folder\n")

    def names():
        return sorted(p.name for p in tmp_path.iterdir())

    before = names()
    for args, flag, path, where in (
            (("train.py", "--data-dir", data_root, "--exp-dir", afile), "--exp-dir", afile, "is a file"),
            (("train.py", "--data-dir", data_root, "--exp-dir", afile / "exp"), "--exp-dir", afile / "exp",
             f"lies under {afile}, which is a file"),
            (("decode.py", "--data-dir", data_root, "--exp-dir", afile, "--epoch", 1), "--exp-dir", afile, "is a file"),
            (("export.py", "--data-dir", data_root, "--exp-dir", afile, "--epoch", 1), "--exp-dir", afile, "is a file"),
            (("export.py", "--data-dir", data_root, "--exp-dir", trained, "--epoch", 1, "--out-dir", afile),
             "--out-dir", afile, "is a file")):
        out = recipe(*args)
        assert out.code == 2 and "\n" not in out.error, (args, out.text)
        assert f"{flag} {path} {where}, not a folder. Fix: " in out.error and "or move the file away" in out.error, \
            out.error
        assert "Errno" not in out.error and "Traceback" not in out.text
        assert afile.read_text() == "a file, not a folder\n" and names() == before
    assert not list(trained.glob("onnx-*"))  # export wrote nothing


def test_decode_weights_selection_errors_are_one_line(trained, data_root):
    before = sorted(p.name for p in trained.iterdir())
    present = f"present in {trained}: epoch-1.pt, epoch-2.pt"
    for args, expected in (
            (("--epoch", 2, "--avg", 3), f"--avg 3 with --epoch 2 would average epochs 0..2, but epochs count from 1 "
                                         f"({present}). Fix: --avg 2 or less"),
            (("--epoch", 2, "--avg", 3, "--use-averaged-model"), "--avg 3 with --epoch 2 would average epochs 0..2"),
            (("--epoch", 1, "--avg", 0), "--avg 0: the number of epochs averaged is at least 1. Fix: --avg 1 "
                                         "(epoch-N.pt alone)"),
            (("--epoch", 0), "--epoch 0: epochs count from 1 (epoch-N.pt is written at the end of epoch N). Fix: "
                             "pass --epoch N of an epoch-N.pt in --exp-dir")):
        for script in ("decode.py", "export.py"):
            out = recipe(script, "--data-dir", data_root, "--exp-dir", trained, *args)
            assert out.code == 2 and "\n" not in out.error and expected in out.error, (script, args, out.text)
            assert "avg <= 0" not in out.error and "Traceback" not in out.text
    assert sorted(p.name for p in trained.iterdir()) == before  # no result or ONNX file written


def test_a_causal_model_with_the_recipes_normalisation_and_a_feature_width_mismatch_are_one_line(data_root, tmp_path):
    """The espeak recipe normalises each utterance's features, which a causal model cannot; features stored at 80
    bins cannot feed a model built for 40. Each ends in one line naming the fix, before any training."""
    for args, expected in ((("--causal",), "add --model.feature_norm none"),
                           (("--data.num_mel_bins", 40), "but --data.num_mel_bins is 40; fix: --data.num_mel_bins 80")):
        out = recipe("train.py", "--data-dir", data_root, "--exp-dir", tmp_path / "exp", "--overwrite", *args)
        assert out.code == 2 and "\n" not in out.error and expected in out.error, (args, out.text)
        assert "Traceback" not in out.text and not list((tmp_path / "exp").glob("epoch-*.pt"))
