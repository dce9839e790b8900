"""A transducer small enough that a training run takes a fraction of a second, and an in-memory loader, for the
loop-level fault tests (the recipe-sized set-up is :mod:`harness`)."""

from __future__ import annotations

import torch
from torch import nn

from asrprec.models import Decoder, Joiner, Transducer
from asrprec.training import TrainConfig


class LinearEncoder(nn.Module):
    output_dim = 16

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(80, 16)

    def forward(self, x, lens):
        return torch.tanh(self.proj(x[:, ::2])), (lens + 1) // 2


class Tok:
    blank_id, vocab_size = 0, 6

    def encode(self, texts):
        return [[1 + "abcde".index(c) for c in t] for t in texts]


def make_model():
    torch.manual_seed(0)
    return Transducer(LinearEncoder(), Decoder(6, 16), Joiner(16, 16, 16, 6))


def batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    texts = ["abc", "de", "ea", "bcd", "a", "ed"]
    return [{"features": torch.randn(2, 30, 80, generator=g), "feature_lens": torch.tensor([30, 24]),
             "texts": [texts[(2 * i) % 6], texts[(2 * i + 1) % 6]], "cut_ids": [f"c{i}a", f"c{i}b"]}
            for i in range(n)]


def config(exp_dir, **kw):
    base = dict(exp_dir=str(exp_dir), optimizer="adamw", base_lr=3e-3, lr_batches=100, lr_epochs=2,
                warmup_batches=2, log_interval=1, progress_bar=False, tensorboard=False, average_period=0)
    return TrainConfig(**{**base, **kw})
