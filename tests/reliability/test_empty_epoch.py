"""An epoch with no batch says why: every cut dropped by the duration filter, or a sampler that made no batch of the
cuts kept (a small corpus under drop_last: no duration bucket fills --max-duration), each with its fix; the run
stops in one line (exit code 2 through the recipe), with nothing saved.

The corpus: 40 training cuts, 35 of 0.60, 0.62, ..., 1.28 s (32.9 s in all) and 5 of 0.3 s (below the duration
filter's 0.5 s)."""

import json
import shutil

import pytest

from asrprec.data import AsrDataModule, DataConfig
from asrprec.experiment import read_history
from asrprec.precision import get_policy
from asrprec.tokenizer import Tokenizer
from asrprec.training import NoTrainingBatches, train

from .corpus import load, make_cut, save_split
from .harness import build_model, model_config, train_config
from .test_bad_args import recipe

KEPT, SHORT = 35, 5
SECONDS = sum(60 + 2 * i for i in range(KEPT)) / 100  # 32.9


@pytest.fixture(scope="module")
def small_corpus(data_root, tmp_path_factory):
    """The reliability corpus with its training split replaced by 35 cuts of 0.60-1.28 s and 5 of 0.3 s."""
    import numpy as np

    root = tmp_path_factory.mktemp("small") / "data"
    shutil.copytree(data_root, root)
    rng = np.random.default_rng(1)
    words = ["ONE TWO", "RED CAT", "BLUE DOG SEES", "FIVE"]
    cuts = [make_cut(f"train-{i:03d}", 60 + 2 * i if i < KEPT else 30, words[i % 4], root / "feats", rng)
            for i in range(KEPT + SHORT)]
    save_split(root, "train", cuts)
    return root


def train_on(root, exp, **data):
    tokenizer = Tokenizer(root / "bpe.model")
    cuts = load(root)
    dm = AsrDataModule(DataConfig(**{"num_workers": 0, **data}))
    return train(model=build_model(tokenizer), policy=get_policy("fp32", "cpu"), tokenizer=tokenizer,
                 train_dl=dm.train_dataloader(cuts["train"]), valid_dl=dm.valid_dataloader(cuts["dev"]),
                 cfg=train_config(exp, num_epochs=1), model_config=model_config(tokenizer))


def test_a_sampler_that_makes_no_batch_is_not_reported_as_every_cut_dropped(small_corpus, tmp_path):
    # the large-corpus recipes' batching (custom, librispeech: --max-duration 1000, 30 buckets, drop_last) on 32.9 s
    exp = tmp_path / "a"
    with pytest.raises(NoTrainingBatches) as e:
        train_on(small_corpus, exp, max_duration=1000.0, num_buckets=30, drop_last=True)
    msg = str(e.value)
    assert "\n" not in msg and "every cut dropped" not in msg
    assert msg.startswith(f"epoch 1 had no batch at all: the sampler made no batch of the {KEPT} training cuts kept "
                          f"({SECONDS:.1f} s of audio; {SHORT} dropped by the duration filter): with drop_last")
    # lhotse's bucketing gets at most one bucket per two cuts: 35 // 2 = 17, of 32.9 / 17 = 1.94 s each
    assert "--max-duration 1000 s" in msg and "17 bucket(s) of about 1.9 s each fill none" in msg
    assert "Fix: lower --max-duration to 1.94 s or less, or set --data.drop_last false" in msg
    assert not list(exp.glob("*.pt"))  # nothing trained, nothing saved
    assert read_history(exp)[-1]["event"] == "stopped"
    # 10 s batches: 3 buckets of 32.9 s fill one each; the fix names that count, and following it trains
    exp = tmp_path / "b"
    with pytest.raises(NoTrainingBatches, match=r"10 bucket\(s\) of about 3.3 s each fill none. Fix: lower "
                                                 r"--num-buckets to 3, or lower --max-duration to 3.29 s"):
        train_on(small_corpus, exp, max_duration=10.0, num_buckets=10, drop_last=True)
    state = train_on(small_corpus, tmp_path / "c", max_duration=10.0, num_buckets=3, drop_last=True)
    assert state.epoch == 1 and state.batch_idx_train > 0


def test_every_cut_dropped_by_the_duration_filter_is_counted(small_corpus, tmp_path):
    with pytest.raises(NoTrainingBatches, match=r"epoch 1 had no batch at all: the duration filter dropped all 40 "
                                                r"training cuts \(outside 5.00-20.00 s: 40\). Fix: widen "
                                                r"--data.min_cut_s"):
        train_on(small_corpus, tmp_path / "exp", max_duration=100.0, min_cut_s=5.0)


def test_train_py_says_why_in_one_line(small_corpus, tmp_path):
    exp = tmp_path / "exp"
    out = recipe("train.py", "--data-dir", small_corpus, "--exp-dir", exp, "--num-epochs", 1, "--max-duration",
                 1000, "--num-buckets", 30, "--data.drop_last", "true")
    assert out.code == 2 and "\n" not in out.error, out.text
    assert f"the sampler made no batch of the {KEPT} training cuts kept" in out.error
    assert "Fix: lower --max-duration to" in out.error and "every cut dropped" not in out.error
    assert not list(exp.glob("*.pt"))
    assert json.loads((exp / "history.json").read_text())[-1]["event"] == "stopped"
    # the folder holds no checkpoint: the same command with the fix runs there at once
    out = recipe("train.py", "--data-dir", small_corpus, "--exp-dir", exp, "--num-epochs", 1, "--max-duration", 10,
                 "--num-buckets", 3, "--data.drop_last", "true")
    assert out.code is None and (exp / "epoch-1.pt").is_file(), out.text
