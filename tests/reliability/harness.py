"""The recipe's training set-up at toy size, in-process: the lhotse datamodule (bucketing sampler, SpecAugment,
optional workers) over :mod:`corpus`, a tiny Zipformer with the pruned loss, ScaledAdam, and
:func:`asrprec.training.train`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

try:  # imported as a package module by pytest, as a plain module by the kill driver
    from .corpus import TINY_OVERRIDES, load
except ImportError:
    from corpus import TINY_OVERRIDES, load


def build_model(tokenizer, seed: int = 42):
    from asrprec.models import LossConfig, build_transducer
    from asrprec.rng import seed_everything

    seed_everything(seed)
    return build_transducer(encoder="zipformer", size="tiny", vocab_size=tokenizer.vocab_size,
                            blank_id=tokenizer.blank_id, encoder_overrides=dict(TINY_OVERRIDES),
                            loss=LossConfig(loss="pruned", prune_range=3, loss_warmup_batches=4),
                            model_warmup_batches=0)


def model_config(tokenizer) -> dict[str, Any]:
    return {"encoder": "zipformer", "size": "tiny", "vocab_size": tokenizer.vocab_size,
            "blank_id": tokenizer.blank_id, "encoder_overrides": dict(TINY_OVERRIDES)}


def train_config(exp_dir: Path, **kw):
    from asrprec.training import TrainConfig

    base = dict(exp_dir=str(exp_dir), num_epochs=2, base_lr=0.02, lr_batches=50, lr_epochs=2, warmup_batches=2,
                log_interval=1, tensorboard=False, progress_bar=False, save_every_n=1, keep_last_k=0,
                encoder_schedule_scale=100.0, average_period=2, scan_oom="off")
    return TrainConfig(**{**base, **kw})


def run(data_root: Path, exp_dir: Path, *, precision: str = "fp32", num_workers: int = 0, seed: int = 42,
        max_duration: float = 4.0, **cfg_kw):
    """Train like ``recipes/espeak/train.py``; returns the TrainState."""
    from asrprec.data import AsrDataModule, DataConfig
    from asrprec.precision import get_policy
    from asrprec.tokenizer import Tokenizer
    from asrprec.training import train

    tokenizer = Tokenizer(Path(data_root) / "bpe.model")
    model = build_model(tokenizer, seed)
    cuts = load(Path(data_root))
    data = AsrDataModule(DataConfig(max_duration=max_duration, num_buckets=2, num_workers=num_workers, seed=seed))
    # bitwise comparisons need the same reductions: the same number of threads in every run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(model=model, policy=get_policy(precision, "cpu"), tokenizer=tokenizer,
                     train_dl=data.train_dataloader(cuts["train"]), valid_dl=data.valid_dataloader(cuts["dev"]),
                     cfg=train_config(exp_dir, seed=seed, **cfg_kw), model_config=model_config(tokenizer))
    finally:
        torch.set_num_threads(threads)


def weights(path: Path) -> dict[str, Any]:
    """What must match between an uninterrupted and a resumed run: weights, running average, optimizer and
    scaler state, the position and the per-epoch losses."""
    c = torch.load(path, weights_only=True)
    extra = c["extra"]
    return {"model": c["model"], "model_avg": c.get("model_avg"), "optimizer": c["optimizer"],
            "scaler": c.get("scaler"), "scheduler": c.get("scheduler"),
            "batch_idx_train": extra["batch_idx_train"],
            "train_losses": [h["train_loss"] for h in extra["history"]]}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested checkpoint contents."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(set(a) ^ set(b)))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)
