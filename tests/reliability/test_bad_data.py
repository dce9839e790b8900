"""Bad data is counted, named and skipped, never trained on silently, and never loses an epoch.

Before training, :func:`asrprec.data.check_cuts` (``--validate-data``) drops each kind of bad cut with a count per
reason and example ids; at run time the loader leaves out cuts it cannot read, the loop skips batches it cannot
use (logged, counted), stops when too many are skipped (after a checkpoint), writes the epoch's checkpoint before
validating, and warns about a non-finite validation loss. Expected counts come from how each corpus was damaged.
"""

import math

import numpy as np
import pytest
import torch

from asrprec.checkpoint import read_checkpoint
from asrprec.data import DataCheckError, check_cuts
from asrprec.data.validate import (
    EMPTY_TRANSCRIPT,
    MISSING_FILE,
    OOV,
    TOO_SHORT,
    UNREADABLE,
)
from asrprec.precision import get_policy
from asrprec.tokenizer import Tokenizer
from asrprec.training import NoTrainingBatches, TooManySkippedBatches, train
from asrprec.experiment import read_history

from .corpus import load, make_cut, save_split
from .harness import run
from .tiny import Tok, batches, config, make_model


def _cuts(root, split="train"):
    return list(load(root)[split])


def _feature_file(cut):
    return f"{cut.features.storage_path}/{cut.features.storage_key}"


def _with_text(cut, text):
    from lhotse.utils import fastcopy

    return fastcopy(cut, supervisions=[fastcopy(cut.supervisions[0], text=text)])


def test_each_bad_cut_is_counted_named_and_dropped(corpus_copy):
    from lhotse import CutSet

    tok = Tokenizer(corpus_copy / "bpe.model")
    cuts = _cuts(corpus_copy)
    rng = np.random.default_rng(1)
    damaged = {
        EMPTY_TRANSCRIPT: [_with_text(cuts[0], ""), _with_text(cuts[1], "   ")],
        OOV: [_with_text(cuts[2], "ONE ÉCOLE TWO")],  # one word of three cannot be spelled
        TOO_SHORT: [make_cut("short-8", 8, "ONE", corpus_copy / "feats", rng)],  # the Zipformer needs 9 frames
        MISSING_FILE: [cuts[3], cuts[4]],
        UNREADABLE: [cuts[5]],  # caught by "full" only
    }
    (corpus_copy / "feats" / cuts[3].features.storage_key).unlink()  # a missing file
    open(_feature_file(cuts[4]), "wb").close()  # an empty file
    with open(_feature_file(cuts[5]), "r+b") as f:  # a corrupt file of the right size
        f.seek(0)
        f.write(b"\0" * 64)
    good = cuts[6:]
    every = CutSet.from_cuts([c for group in damaged.values() for c in group] + good)

    kept, report = check_cuts(every, split="train", tokenizer=tok, min_frames=9, mode="fast")
    expected_fast = {r: sorted(c.id for c in cs) for r, cs in damaged.items() if r != UNREADABLE}
    assert {r: sorted(ids) for r, ids in report.problems.items()} == expected_fast
    assert report.total == len(every) and report.kept == len(good) + 1 and len(kept) == report.kept
    assert report.oov_words == {"ÉCOLE": 1}
    text = report.summary()
    assert f"train: dropped 6 of {len(every)} cuts" in text
    assert f"{EMPTY_TRANSCRIPT}: 2 (e.g. {cuts[0].id}, {cuts[1].id})" in text
    assert "too short for the encoder: 1 (e.g. short-8)" in text and "'ÉCOLE' x1" in text
    assert "re-run feature extraction" in text  # each reason says what to do

    _, full = check_cuts(every, split="train", tokenizer=tok, min_frames=9, mode="full")
    assert full.problems[UNREADABLE] == [cuts[5].id]
    # a share of unknown words may be allowed
    _, lenient = check_cuts(every, split="train", tokenizer=tok, min_frames=9, max_oov_fraction=0.5)
    assert OOV not in lenient.problems
    # a test split keeps empty references but not what the encoder cannot take
    _, test = check_cuts(every, split="test", min_frames=9, require_transcript=False)
    assert EMPTY_TRANSCRIPT not in test.problems and test.problems[TOO_SHORT] == ["short-8"]
    with pytest.raises(DataCheckError, match="(?s)no cut of dev passed the data checks.*empty transcript: 2"):
        check_cuts(CutSet.from_cuts(damaged[EMPTY_TRANSCRIPT]), split="dev", mode="fast")


def test_loader_leaves_out_unreadable_cuts_and_empty_transcripts(corpus_copy):
    from lhotse import CutSet

    from asrprec.data.datamodule import AsrDataset

    a, b, c = _cuts(corpus_copy)[:3]
    with open(_feature_file(a), "wb") as f:
        f.write(b"not a numpy file")
    ds = AsrDataset(on_the_fly_feats=False, seed=0)
    batch = ds[CutSet.from_cuts([a, _with_text(b, " "), c])]
    assert batch["cut_ids"] == [c.id] and batch["features"].shape[0] == 1
    reasons = {d["cut_id"]: d["reason"] for d in batch["dropped_cuts"]}
    assert reasons[b.id] == "empty transcript" and reasons[a.id].startswith("unreadable features")
    empty = ds[CutSet.from_cuts([a])]
    assert empty["features"].shape[0] == 0 and [d["cut_id"] for d in empty["dropped_cuts"]] == [a.id]


def test_a_corrupt_feature_file_at_run_time_is_named_and_counted(corpus_copy, tmp_path, caplog):
    """With the check that would have caught it switched off (--validate-data fast only sees sizes), a corrupt file
    costs its cut, not the run: the log names it and the epoch record counts it."""
    victim = _cuts(corpus_copy)[0]
    with open(_feature_file(victim), "r+b") as f:
        f.seek(0)
        f.write(b"garbage!" * 8)
    caplog.set_level("WARNING", logger="asrprec.training")
    state = run(corpus_copy, tmp_path / "exp", num_epochs=1, save_every_n=0)
    assert f"cut {victim.id} left out of its batch: unreadable features" in caplog.text
    assert state.history[0]["dropped_cuts"] == 1 and state.history[0]["skipped_batches"] == {}
    assert [e["dropped_cuts"] for e in read_history(tmp_path / "exp") if e["event"] == "epoch"] == [1]


class Failing:
    """Batches, one of which the loader cannot produce (an exception, as a DataLoader worker re-raises it)."""

    def __init__(self, data, bad):
        self.data, self.bad = data, bad

    def __iter__(self):
        for i, b in enumerate(self.data):
            if i in self.bad:
                yield RuntimeError(f"Caught OSError in DataLoader worker process 0.\nOSError: cannot read shard {i}")
            else:
                yield b


def _iterate(failing):
    """What a DataLoader iterator does: raise for the bad batch, continue afterwards."""
    class It:
        def __init__(self):
            self.it = iter(failing)

        def __iter__(self):
            return self

        def __next__(self):
            x = next(self.it)
            if isinstance(x, Exception):
                raise x
            return x

    class Loader:
        def __iter__(self):
            return It()

    return Loader()


@pytest.mark.parametrize("progress_bar", [False, True])
def test_unloadable_batches_are_skipped_counted_and_logged(tmp_path, caplog, progress_bar):
    data = batches(6)
    data[2] = {**data[2], "features": torch.zeros(0, 0, 80), "feature_lens": torch.zeros(0, dtype=torch.int64),
               "texts": [], "cut_ids": [], "dropped_cuts": [{"cut_id": "c2a", "reason": "unreadable features (x)"},
                                                            {"cut_id": "c2b", "reason": "unreadable features (y)"}]}
    caplog.set_level("WARNING", logger="asrprec.training")
    state = train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(),
                  train_dl=_iterate(Failing(data, bad={4})), valid_dl=batches(1, 1),
                  cfg=config(tmp_path, num_epochs=1, max_skipped_fraction=0.5, progress_bar=progress_bar))
    h = state.history[0]  # the epoch goes on after the failing batch (a progress bar must not end it there)
    assert h["skipped_batches"] == {"unloadable": 2} and h["steps"] == 4 and h["batches"] == 6
    assert "skipped, unloadable: no cut of the batch could be read; cuts: c2a, c2b" in caplog.text
    assert "skipped, unloadable: the loader raised RuntimeError: OSError: cannot read shard 4" in caplog.text


def test_an_epoch_of_non_finite_losses_stops_with_a_checkpoint_never_a_zero_loss_epoch(tmp_path):
    data = batches(3)
    for b in data:
        b["features"][0, 0, 0] = float("nan")
    with pytest.raises(TooManySkippedBatches, match=r"no batch of epoch 1 could be trained: all 3 were skipped "
                                                    r"\(non-finite loss 3\).*c0a \(non-finite loss\).*--resume latest"):
        train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=data,
              valid_dl=batches(1, 1), cfg=config(tmp_path, num_epochs=2, max_skipped_fraction=1.0))
    assert not (tmp_path / "epoch-1.pt").exists()  # no epoch is recorded as trained
    assert read_checkpoint(tmp_path / "checkpoint-3.pt")["extra"]["progress"]["skipped"] == {"non-finite loss": 3}
    events = read_history(tmp_path)
    assert [e["event"] for e in events] == ["start", "stopped"] and "all 3 were skipped" in events[1]["reason"]


def test_too_many_skipped_batches_stop_mid_epoch_and_the_run_resumes_after_them(tmp_path):
    data = batches(10)
    for i in (1, 2, 4):
        data[i]["features"][1, 4, 5] = float("nan")
    cfg = dict(num_epochs=1, max_skipped_fraction=0.2)
    with pytest.raises(TooManySkippedBatches, match=r"3 of the 5 batches of epoch 1 so far were skipped "
                                                    r"\(non-finite loss 3\), more than --max-skipped-fraction 0.2.*"
                                                    r"Saved .*checkpoint-5.pt"):
        train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=data,
              valid_dl=batches(1, 1), cfg=config(tmp_path, **cfg))
    # after looking at the data, accept more: the run continues after the fifth batch
    state = train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=data,
                  valid_dl=batches(1, 1), cfg=config(tmp_path, **{**cfg, "max_skipped_fraction": 0.5},
                                                     resume="latest"))
    assert state.history[0]["batches"] == 10 and state.history[0]["skipped_batches"] == {"non-finite loss": 3}


class BrokenValidation:
    def __iter__(self):
        raise ValueError("every utterance needs at least 9 feature frames")


def test_the_epoch_checkpoint_is_written_before_validation(tmp_path):
    with pytest.raises(ValueError, match="9 feature frames"):
        train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(2),
              valid_dl=BrokenValidation(), cfg=config(tmp_path, num_epochs=2))
    assert read_checkpoint(tmp_path / "epoch-1.pt")["extra"]["progress"]["epoch_done"]
    # once the dev data are fixed the run goes on from there
    state = train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(2),
                  valid_dl=batches(1, 1), cfg=config(tmp_path, num_epochs=2, resume="latest"))
    assert [h["epoch"] for h in state.history] == [1, 2] and state.batch_idx_train == 4


def test_a_non_finite_validation_loss_warns(tmp_path, caplog):
    dev = batches(1, 1)
    dev[0]["features"][0, 0, 0] = float("nan")
    caplog.set_level("WARNING", logger="asrprec.training")
    state = train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(2),
                  valid_dl=dev, cfg=config(tmp_path, num_epochs=1))
    assert math.isnan(state.history[0]["valid_loss"])
    assert "validation loss is nan (epoch 1)" in caplog.text and "check the dev data" in caplog.text


def test_the_recipe_drops_and_reports_bad_cuts_in_every_split(corpus_copy):
    """The training recipe's data check on a corpus with one bad cut per split (an empty transcript in train, a
    dev cut too short for the encoder): both are dropped and the run trains; the counts are in config.json."""
    import json

    from .test_bad_args import recipe

    train_cuts = _cuts(corpus_copy)
    save_split(corpus_copy, "train", [_with_text(train_cuts[0], " ")] + train_cuts[1:])
    rng = np.random.default_rng(2)
    save_split(corpus_copy, "dev", _cuts(corpus_copy, "dev") + [make_cut("dev-short", 7, "TWO", corpus_copy / "feats",
                                                                      rng)])
    out = recipe("train.py", "--data-dir", corpus_copy, "--exp-dir", corpus_copy / "exp", "--num-epochs", 1,
                 "--train.max_batches_per_epoch", 1)
    assert out.code is None, out.text
    checks = json.loads((corpus_copy / "exp" / "config.json").read_text())["data"]["checks"]
    assert checks["train"]["dropped"] == {EMPTY_TRANSCRIPT: 1} and checks["dev"]["dropped"] == {TOO_SHORT: 1}
    assert checks["dev"]["examples"][TOO_SHORT] == ["dev-short"]


def test_a_broken_loader_or_an_empty_epoch_stops_the_run(tmp_path):
    class Broken:
        def __iter__(self):
            return self

        def __next__(self):
            raise OSError("Input/output error")

    def run_with(loader, exp):
        return train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=loader,
                     valid_dl=batches(1, 1), cfg=config(exp, num_epochs=1, max_skipped_fraction=1.0))

    with pytest.raises(TooManySkippedBatches, match="loader failed 10 times in a row .*OSError: Input/output error"):
        run_with(Broken(), tmp_path / "broken")
    assert (tmp_path / "broken" / "checkpoint-0.pt").is_file()
    # a loader of its own, without the data module's counts: the possible causes, and nothing saved
    with pytest.raises(NoTrainingBatches, match="epoch 1 had no batch at all: the training loader served nothing"):
        run_with([], tmp_path / "empty")
    assert not list((tmp_path / "empty").glob("*.pt"))
