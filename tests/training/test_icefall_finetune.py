"""An icefall checkpoint fine-tunes in every precision policy: ``--init-from icefall:FILE`` trains from icefall's
weights (not from a fresh initialisation), under fp32, amp-fp16, amp-bf16 and bf16 with each update rule, and the
experiment folder it writes decodes through asrprec's own loading (its model.json)."""

import math
from pathlib import Path

import pytest
import torch

from asrprec.experiment import load_experiment_model
from asrprec.models import ModelOptions
from asrprec.models.icefall import (
    IcefallImportError, icefall_training_model, load_icefall, parse_icefall_source, read_icefall_checkpoint,
)
from asrprec.precision import get_policy
from asrprec.training import TrainConfig, train

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "icefall_zipformer"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"icefall fixtures not found at {FIXTURES}")
CKPT = FIXTURES / "offline" / "epoch-1.pt"


class Tok:
    """Letters as ids 1..26 of the fixture's 50-token vocabulary."""
    blank_id, vocab_size = 0, 50

    def encode(self, texts):
        return [[1 + ord(c) - ord("a") for c in t] for t in texts]


def batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    texts = ["abc", "hello", "zip", "former", "icefall", "asr"]
    return [{"features": torch.randn(2, 120, 80, generator=g), "feature_lens": torch.tensor([120, 101]),
             "texts": [texts[(2 * i) % 6], texts[(2 * i + 1) % 6]], "cut_ids": [f"c{i}a", f"c{i}b"]}
            for i in range(n)]


def config(exp_dir, **kw):
    base = dict(exp_dir=str(exp_dir), num_epochs=1, optimizer="scaled_adam", base_lr=0.01, lr_batches=100,
                lr_epochs=2, warmup_batches=1, log_interval=1, progress_bar=False, tensorboard=False,
                average_period=0, init_from=f"icefall:{CKPT}")
    return TrainConfig(**{**base, **kw})


POLICIES = [("fp32", "master"), ("amp-fp16", "master"), ("amp-bf16", "master"), ("bf16", "master"),
            ("bf16", "kahan"), ("bf16", "stochastic")]


@pytest.mark.parametrize("precision,update", POLICIES, ids=[f"{p}-{u}" for p, u in POLICIES])
def test_icefall_checkpoint_fine_tunes_in_every_policy(tmp_path, precision, update):
    model, model_config = icefall_training_model(CKPT, None, ModelOptions(), vocab_size=50)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    icefall, _ = read_icefall_checkpoint(CKPT)
    state = train(model=model, policy=get_policy(precision, "cpu", bf16_update=update), tokenizer=Tok(),
                  train_dl=batches(), valid_dl=batches(1, 1), cfg=config(tmp_path), model_config=model_config)
    assert all(math.isfinite(h["train_loss"]) for h in state.history), state.history
    tuned, _, _ = load_experiment_model(tmp_path, epoch=1)  # the folder's model.json rebuilds the architecture
    got = tuned.state_dict()
    # started from icefall's weights: three small steps stay near them, far from a fresh initialisation
    name, icefall_name = "encoder.encoder.encoders.2.encoder.layers.1.feed_forward2.in_proj.weight", \
        "encoder.encoders.2.encoder.layers.1.feed_forward2.in_proj.weight"
    moved = (got[name] - icefall[icefall_name]).norm() / icefall[icefall_name].norm()
    from_fresh = (got[name] - fresh[name]).norm() / fresh[name].norm()
    assert 0 < moved < 0.2 and from_fresh > 0.5, (moved, from_fresh)


def test_fine_tuned_folder_decodes_like_the_imported_model_when_no_step_was_taken(tmp_path):
    # zero learning rate: the saved weights are icefall's, so the folder's model computes what from_icefall's does
    model, model_config = icefall_training_model(CKPT, None, ModelOptions(), vocab_size=50)
    train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(1), valid_dl=batches(1, 1),
          cfg=config(tmp_path, optimizer="adamw", base_lr=0.0), model_config=model_config)
    tuned, _, _ = load_experiment_model(tmp_path, epoch=1)
    imported, _ = load_icefall(CKPT)
    x, lens = torch.randn(1, 90, 80), torch.tensor([90])
    with torch.no_grad():
        assert torch.allclose(tuned.encode(x, lens)[0], imported.encode(x, lens)[0], atol=1e-6)


def test_tokenizer_of_another_size_and_tdt_are_refused():
    with pytest.raises(IcefallImportError, match=r"tokenizer has 500 pieces .* vocab_size=50\. Fix: .*--bpe-model"):
        icefall_training_model(CKPT, None, ModelOptions(), vocab_size=500)
    with pytest.raises(IcefallImportError, match=r"--loss tdt needs a joiner with a duration head"):
        icefall_training_model(CKPT, None, ModelOptions(loss="tdt"), vocab_size=50)


def test_init_from_value_is_parsed():
    assert parse_icefall_source("icefall:/x/pretrained.pt") == "/x/pretrained.pt"
    assert parse_icefall_source("exp/epoch-3.pt") is None
    with pytest.raises(IcefallImportError, match="names no file"):
        parse_icefall_source("icefall:")
