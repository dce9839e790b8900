"""Test kit for decoding: tiny transducers (a stand-in Linear encoder + the real Decoder and Joiner) and plain,
obviously-correct reference decoders and scorers (one utterance at a time, float64 scores).

The references use the model only through ``decoder(..., need_pad=False)`` and ``joiner`` *with* its input
projections (the full ``model.join`` path), unlike the library, which projects once and calls the joiner with
``project_input=False``. Loaded by conftest.py and handed to tests as the ``kit`` fixture (pytest runs with
``--import-mode=importlib``, so test modules cannot import each other)."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from asrprec.models import Decoder, Joiner, Transducer


class LinearEncoder(nn.Module):
    """Stand-in encoder: (B, T, F) → (B, T, D_enc) by one Linear and tanh; lengths unchanged."""

    def __init__(self, feat_dim: int, output_dim: int):
        super().__init__()
        self.proj = nn.Linear(feat_dim, output_dim)
        self.output_dim = output_dim

    def forward(self, x: torch.Tensor, x_lens: torch.Tensor):
        return torch.tanh(self.proj(x)), x_lens


def make_model(seed: int, *, vocab: int = 6, context_size: int = 2, feat_dim: int = 8, dim: int = 16,
               logit_scale: float = 4.0, blank_bias: float = 0.0) -> Transducer:
    """A random tiny transducer. ``logit_scale`` sharpens the joiner's output distribution (a freshly
    initialised joiner is near-uniform); ``blank_bias`` shifts the blank logit."""
    torch.manual_seed(seed)
    enc = LinearEncoder(feat_dim, dim)
    dec = Decoder(vocab, dim, blank_id=0, context_size=context_size)
    joi = Joiner(dim, dim, dim, vocab)
    with torch.no_grad():
        # the library starts the joiner's projections 4x small (for training); these decoding tests want
        # a sharp random joiner without exact bf16 ties, so undo that
        for lin in (joi.encoder_proj, joi.decoder_proj):
            lin.weight.mul_(4.0)
            lin.bias.mul_(4.0)
        joi.output_linear.weight.mul_(logit_scale)
        joi.output_linear.bias.mul_(logit_scale)
        joi.output_linear.bias[0] += blank_bias
    return Transducer(enc, dec, joi).eval()


def make_batch(seed: int, lens: list[int], feat_dim: int = 8):
    g = torch.Generator().manual_seed(seed + 1000)
    T = max(lens) if lens else 0
    feats = torch.randn(len(lens), T, feat_dim, generator=g)
    return feats, torch.tensor(lens, dtype=torch.int64)

def _log_probs(model, enc_frame: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """float64 log-probabilities (V,) at one encoder frame (D_enc,) after emitting ``tokens``."""
    C, blank = model.decoder.context_size, model.decoder.blank_id
    ctx = ([blank] * C + list(tokens))[-C:]
    dec = model.decoder(torch.tensor([ctx]), need_pad=False)[0, 0]  # (D_dec,)
    logits = model.join(enc_frame, dec)  # (V,)
    return logits.double().log_softmax(-1)


@torch.no_grad()
def naive_greedy(model, enc: torch.Tensor, max_sym_per_frame: int = 1) -> tuple[list[int], float]:
    """Greedy search on one utterance enc (T, D_enc); returns (tokens, path log-prob)."""
    blank = model.decoder.blank_id
    tokens: list[int] = []
    score = 0.0
    for t in range(enc.size(0)):
        for _ in range(max_sym_per_frame):
            lp = _log_probs(model, enc[t], tokens)
            k = int(lp.argmax())
            score += float(lp[k])
            if k == blank:
                break
            tokens.append(k)
    return tokens, score


@torch.no_grad()
def naive_greedy_timestamps(model, enc: torch.Tensor, max_sym_per_frame: int = 1) -> tuple[list[int], list[int]]:
    """Greedy search on one utterance enc (T, D_enc), frame by frame; returns (tokens, the frame of each token)."""
    blank = model.decoder.blank_id
    tokens: list[int] = []
    stamps: list[int] = []
    for t in range(enc.size(0)):
        for _ in range(max_sym_per_frame):
            k = int(_log_probs(model, enc[t], tokens).argmax())
            if k == blank:
                break
            tokens.append(k)
            stamps.append(t)
    return tokens, stamps


@torch.no_grad()
def greedy_margin(model, enc: torch.Tensor) -> float:
    """Smallest gap between the best and second-best log-prob along the greedy path (one symbol per frame)."""
    tokens, _ = naive_greedy(model, enc)
    blank, gaps, u = model.decoder.blank_id, [math.inf], 0
    for t in range(enc.size(0)):
        lp = _log_probs(model, enc[t], tokens[:u])
        top = lp.topk(2).values
        gaps.append(float(top[0] - top[1]))
        if int(lp.argmax()) != blank:
            u += 1
    return min(gaps)


@torch.no_grad()
def is_near_greedy(model, enc: torch.Tensor, tokens: list[int], eps: float) -> bool:
    """Whether some one-symbol-per-frame alignment of ``tokens`` takes, on every frame, a symbol whose log-prob
    is within ``eps`` of that frame's best: i.e. ``tokens`` is a greedy result up to near-ties (what a
    low-precision greedy search may legitimately return)."""
    blank, U = model.decoder.blank_id, len(tokens)
    states = {0}
    for t in range(enc.size(0)):
        nxt = set()
        for u in states:
            lp = _log_probs(model, enc[t], tokens[:u])
            best = float(lp.max())
            if float(lp[blank]) >= best - eps:
                nxt.add(u)
            if u < U and float(lp[tokens[u]]) >= best - eps:
                nxt.add(u + 1)
        states = nxt
    return U in states


@torch.no_grad()
def sequence_log_prob(model, enc: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens) summed over all one-symbol-per-frame alignments (each frame emits blank or one token)."""
    T, U = enc.size(0), len(tokens)
    blank = model.decoder.blank_id
    alpha = [[-math.inf] * (U + 1) for _ in range(T + 1)]
    alpha[0][0] = 0.0
    for t in range(T):
        for u in range(min(t, U) + 1):
            if alpha[t][u] == -math.inf:
                continue
            lp = _log_probs(model, enc[t], tokens[:u])
            stay = alpha[t][u] + float(lp[blank])
            alpha[t + 1][u] = _logadd(alpha[t + 1][u], stay)
            if u < U:
                alpha[t + 1][u + 1] = _logadd(alpha[t + 1][u + 1], alpha[t][u] + float(lp[tokens[u]]))
    return alpha[T][U]


@torch.no_grad()
def all_sequence_log_probs(model, enc: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Brute force: enumerate every one-symbol-per-frame path (V^T of them), group by label sequence."""
    V, blank = model.vocab_size, model.decoder.blank_id
    out: dict[tuple[int, ...], float] = {}
    for path in itertools.product(range(V), repeat=enc.size(0)):
        tokens: list[int] = []
        score = 0.0
        for t, k in enumerate(path):
            score += float(_log_probs(model, enc[t], tokens)[k])
            if k != blank:
                tokens.append(k)
        key = tuple(tokens)
        out[key] = _logadd(out.get(key, -math.inf), score)
    return out


def _logadd(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))
