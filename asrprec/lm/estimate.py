"""Estimate a token n-gram model (interpolated Kneser-Ney) and write it as an ARPA file.

So that a recipe builds its LM from its own training transcripts with nothing to install or download. The
estimate is interpolated Kneser-Ney with one absolute discount per order, D = n1 / (n1 + 2 n2) from the counts of
counts (Chen & Goodman 1998, §3.4; KenLM's ``lmplz`` uses three discounts per order, "modified" KN, which matters
little at these sizes). Counts below the highest order are continuation counts (the number of distinct words seen
before the n-gram), except for n-grams that start with ``<s>``, which cannot be extended to the left and keep their
raw counts (as KenLM does, ``lm/builder/adjust_counts.cc``). The lowest order interpolates with the uniform
distribution over the vocabulary (``</s>`` and ``<unk>`` included, ``<s>`` never predicted).

Interpolated KN written as ARPA: for a seen n-gram "h w" the file's probability is the interpolated one,
``p(w|h) = (a(h w) - D) / a(h ·) + γ(h) p(w|h')``, and h's back-off weight is ``γ(h) = D · N1+(h ·) / a(h ·)``, so
the back-off rule of a reader (:class:`asrprec.lm.NgramLm`) gives ``γ(h) p(w|h')`` for an unseen "h w": exactly
the interpolated value, and every history's distribution sums to one.

The words are whatever the sentences hold; recipes pass BPE pieces (:func:`build_token_lm`), as NeMo's NGPU-LM
trains KenLM on the model's tokens.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from asrprec.atomic import atomic_write_text

from .arpa import BOS, EOS, UNK

__all__ = ["build_token_lm", "estimate_kneser_ney", "write_arpa"]

log = logging.getLogger(__name__)


def _discount(adjusted: Counter) -> float:
    n1 = sum(1 for c in adjusted.values() if c == 1)
    n2 = sum(1 for c in adjusted.values() if c == 2)
    if n1 == 0 or n2 == 0:
        return 0.5  # too few counts to estimate it (a tiny corpus)
    return min(max(n1 / (n1 + 2 * n2), 0.1), 0.9)


def estimate_kneser_ney(sentences: Iterable[Sequence[str]], order: int
                        ) -> list[dict[tuple[str, ...], tuple[float, float | None]]]:
    """Interpolated Kneser-Ney estimates: ``out[n-1][gram] = (log10 p, log10 back-off or None)`` for every seen n-gram
    of order n (plus ``<unk>`` and ``<s>`` among the 1-grams; ``<s>`` gets log10 p = -99, as KenLM writes it)."""
    if order < 1:
        raise ValueError(f"order must be >= 1, got {order}")
    raw: list[Counter] = [Counter() for _ in range(order)]
    for sent in sentences:
        words = [BOS, *sent, EOS]
        for w in sent:
            if w in (BOS, EOS) or not w or any(ch.isspace() for ch in w):
                raise ValueError(f"sentence word {w!r} is empty, holds whitespace, or is a reserved symbol")
        for n in range(1, order + 1):
            c = raw[n - 1]
            for i in range(len(words) - n + 1):
                c[tuple(words[i : i + n])] += 1
    if not raw[0]:
        raise ValueError("no sentences to estimate the LM on")
    # adjusted counts: raw at the highest order and for n-grams starting with <s>, else continuation counts
    adjusted: list[Counter] = [Counter() for _ in range(order)]
    adjusted[order - 1] = Counter(raw[order - 1])
    for n in range(order - 1, 0, -1):
        cont = Counter(g[1:] for g in raw[n] )  # distinct left extensions of each n-gram (raw[n]: order n+1)
        adj = adjusted[n - 1]
        for g, c in raw[n - 1].items():
            adj[g] = c if g[0] == BOS else cont.get(g, 0)
        for g in [g for g, c in adj.items() if c == 0]:  # seen only after nothing: e.g. <s> handled above
            del adj[g]
    adjusted[0].pop((BOS,), None)
    vocab = sorted({g[0] for g in raw[0]} - {BOS} | {UNK, EOS})
    discounts = [_discount(a) for a in adjusted]

    # per history: total adjusted count and number of distinct continuations
    probs: list[dict[tuple[str, ...], float]] = []
    gammas: list[dict[tuple[str, ...], float]] = []
    for n in range(1, order + 1):
        D = discounts[n - 1]
        total: dict[tuple[str, ...], int] = defaultdict(int)
        types: dict[tuple[str, ...], int] = defaultdict(int)
        for g, c in adjusted[n - 1].items():
            total[g[:-1]] += c
            types[g[:-1]] += 1
        gamma = {h: D * types[h] / total[h] for h in total}
        p: dict[tuple[str, ...], float] = {}
        if n == 1:
            g0 = gamma.get((), 1.0)
            for w in vocab:
                p[(w,)] = max(adjusted[0].get((w,), 0) - D, 0.0) / total[()] + g0 / len(vocab)
        else:
            lower = probs[n - 2]
            for g, c in adjusted[n - 1].items():
                p[g] = (c - D) / total[g[:-1]] + gamma[g[:-1]] * _backed_off(g[1:], lower, probs, gammas)
        probs.append(p)
        gammas.append(gamma)
    out: list[dict[tuple[str, ...], tuple[float, float | None]]] = []
    for n in range(1, order + 1):
        grams: dict[tuple[str, ...], tuple[float, float | None]] = {}
        higher = gammas[n] if n < order else {}
        for g, pr in probs[n - 1].items():
            bo = higher.get(g)
            grams[g] = (math.log10(pr), math.log10(bo) if bo is not None else None)
        if n == 1:
            bo = higher.get((BOS,))
            grams[(BOS,)] = (-99.0, math.log10(bo) if bo is not None else None)
        out.append(grams)
    return out


def _backed_off(g: tuple[str, ...], lower: dict, probs: list[dict], gammas: list[dict]) -> float:
    """p(g[-1] | g[:-1]) from the estimates so far, backing off through unseen histories."""
    n = len(g)
    if g in probs[n - 1]:
        return probs[n - 1][g]
    return gammas[n - 1].get(g[:-1], 1.0) * _backed_off(g[1:], lower, probs, gammas)


def write_arpa(path: str | Path, grams: list[dict[tuple[str, ...], tuple[float, float | None]]]) -> Path:
    """Write n-gram estimates (:func:`estimate_kneser_ney`'s form) as an ARPA file (atomically)."""
    lines = ["", "\\data\\"]
    lines += [f"ngram {n}={len(g)}" for n, g in enumerate(grams, 1)]
    for n, g in enumerate(grams, 1):
        lines += ["", f"\\{n}-grams:"]
        for gram in sorted(g):
            lp, bo = g[gram]
            lines.append(f"{lp:.6f}\t{' '.join(gram)}" + (f"\t{bo:.6f}" if bo is not None else ""))
    lines += ["", "\\end\\", ""]
    path = Path(path)
    atomic_write_text(path, "\n".join(lines))
    return path


def build_token_lm(texts: Iterable[str], tokenizer, path: str | Path, order: int) -> Path:
    """Estimate an ``order``-gram LM on the BPE pieces of ``texts`` (the model's tokens; ``tokenizer`` an
    :class:`asrprec.tokenizer.Tokenizer`) and write it to ``path`` as ARPA."""
    texts = [t.strip() for t in texts if t and t.strip()]
    sentences = [[tokenizer.id_to_piece(i) for i in ids] for ids in tokenizer.encode(texts)] if texts else []
    grams = estimate_kneser_ney(sentences, order)
    log.info("%d-gram LM on %d transcripts: %s n-grams -> %s", order, len(sentences),
             "/".join(str(len(g)) for g in grams), path)
    return write_arpa(path, grams)
