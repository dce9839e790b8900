"""Token-level n-gram language models read from ARPA files, held in tensors for batched lookup with back-off.

An ARPA file (KenLM's ``lmplz`` output, or :func:`asrprec.lm.estimate.write_arpa`) lists, for each order n, the
n-grams it has seen with ``log10 p(w | h)`` and, for those that can be a history, a back-off weight
``log10 bo(h w)``. Its words here are the model's BPE pieces (as NeMo's NGPU-LM trains KenLM on token
sequences, NVIDIA/NeMo ``nemo/collections/asr/parts/submodules/ngram_lm/ngram_lm_batched.py``), so one LM step is one
decoded token. A query follows the usual back-off rule (Katz; KenLM ``lm/model.cc``)::

    p(w | h) = p_arpa(w | h)                      if "h w" is listed
             = bo(h) * p(w | h minus its first word)  otherwise

State: an integer id per history the model distinguishes (every listed n-gram below the highest order, and the
empty history). ``score(states, tokens)`` walks the back-off chain for a whole batch at once: each walk step is one
``torch.searchsorted`` over the sorted arc keys ``state * W + word`` (W words), so a batch of N queries costs
``order`` vectorised lookups, with no Python loop over queries. A model with at most ``DENSE_LIMIT`` (state, token)
pairs (S · V) walks every pair once at load and answers from two (S, V) tables, one gather per lookup. Scores come out in natural log: the file's log10
values times ln 10, converted once at load (KenLM reports log10; decoders add natural-log acoustic scores).

Model tokens the file does not list score as ``<unk>`` (KenLM's rule for an unknown word); a file without ``<unk>``
gives them log10 -100 (KenLM's default for a missing ``<unk>``). The blank (token 0) is not a word: it scores 0 and
leaves the state as it is (decoders never ask the LM about it).

Legend: N queries, V model tokens (blank included), W words of the file (its pieces plus <s>, </s>, <unk>).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from asrprec.errors import AsrprecError

__all__ = ["ArpaError", "NgramLm", "load_arpa", "read_arpa"]

LN10 = math.log(10.0)
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
#: KenLM's log10 probability for an unknown word when the file has no <unk>
MISSING_UNK_LOG10 = -100.0
#: models with at most this many (state, token) pairs also keep every lookup's result in two (S, V) tables
DENSE_LIMIT = 1 << 22


class ArpaError(AsrprecError, ValueError):
    """A malformed ARPA file, or one whose words the model cannot spell; the message names the file and line."""


@dataclass
class ArpaContents:
    """An ARPA file as read: ``ngrams[n-1]`` maps each n-gram (a tuple of words) to ``(log10 p, log10 bo)``."""

    ngrams: list[dict[tuple[str, ...], tuple[float, float]]]

    @property
    def order(self) -> int:
        return len(self.ngrams)


def read_arpa(path: str | Path) -> ArpaContents:
    """Parse an ARPA file (checked: the ``\\data\\`` header, sections in order 1..N, each section's count equal to the
    header's, ``\\end\\``, every line's fields). Raises :class:`ArpaError` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ArpaError(f"{path}: no such ARPA file; fix: build one (recipes' prepare stage) or pass the right --lm")
    counts: dict[int, int] = {}
    ngrams: list[dict[tuple[str, ...], tuple[float, float]]] = []
    section = "start"  # start -> header -> grams(n) -> end
    n = 0
    lineno = 0

    def fail(msg: str) -> ArpaError:
        return ArpaError(f"{path}:{lineno}: {msg}")

    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            if section == "start":
                if line == "\\data\\":
                    section = "header"
                continue  # text before \data\ is allowed (KenLM writes none; SRILM may)
            if line.startswith("\\") and line.endswith("-grams:"):
                try:
                    k = int(line[1:-len("-grams:")])
                except ValueError:
                    raise fail(f"bad section header {line!r}") from None
                if section == "header" and not counts:
                    raise fail("the \\data\\ header lists no 'ngram N=count' lines")
                if section.startswith("grams") and len(ngrams[-1]) != counts[n]:
                    raise fail(f"the \\{n}-grams: section has {len(ngrams[-1])} entries but the header says "
                               f"{counts[n]}")
                if k != n + 1:
                    raise fail(f"section \\{k}-grams: out of order: expected \\{n + 1}-grams:")
                if k not in counts:
                    raise fail(f"section \\{k}-grams: is not in the \\data\\ header (orders {sorted(counts)})")
                n, section = k, f"grams{k}"
                ngrams.append({})
                continue
            if line == "\\end\\":
                if not section.startswith("grams"):
                    raise fail("\\end\\ before any n-gram section")
                if len(ngrams[-1]) != counts[n]:
                    raise fail(f"the \\{n}-grams: section has {len(ngrams[-1])} entries but the header says "
                               f"{counts[n]}")
                if n != max(counts):
                    raise fail(f"\\end\\ after \\{n}-grams: but the header lists orders up to {max(counts)}")
                section = "end"
                break
            if section == "header":
                key, _, value = line.partition("=")
                parts = key.split()
                if len(parts) != 2 or parts[0] != "ngram" or not value.strip().isdigit() or not parts[1].isdigit():
                    raise fail(f"expected 'ngram N=count' in the \\data\\ header, got {line!r}")
                k = int(parts[1])
                if k != len(counts) + 1:
                    raise fail(f"header line for order {k} out of order (expected order {len(counts) + 1})")
                counts[k] = int(value)
                continue
            # an n-gram line: log10 p, n words, optional log10 back-off
            fields = line.split()
            if len(fields) not in (n + 1, n + 2):
                raise fail(f"a {n}-gram line needs 'log10prob' + {n} words [+ 'log10backoff'], got {line!r}")
            try:
                logp = float(fields[0])
                bo = float(fields[n + 1]) if len(fields) == n + 2 else 0.0
            except ValueError:
                raise fail(f"not a number in {line!r}") from None
            if logp != logp or bo != bo:
                raise fail(f"not a number in {line!r}")
            # -inf (written by some tools for <s>) floored at SRILM's -99, so that a scale of 0 gives exactly 0
            logp, bo = max(logp, -99.0), max(bo, -99.0)
            words = tuple(fields[1 : n + 1])
            if words in ngrams[-1]:
                raise fail(f"the {n}-gram {' '.join(words)!r} is listed twice")
            ngrams[-1][words] = (logp, bo)
    if section != "end":
        what = "no \\data\\ header" if section == "start" else (
            "no n-gram section" if section == "header" else "no \\end\\ (the file is truncated)")
        raise ArpaError(f"{path}:{lineno}: {what}")
    return ArpaContents(ngrams)


class NgramLm:
    """A back-off n-gram model over a decoder's tokens, in tensors (see the module docstring).

    Attributes:
        order: the highest n. vocab_size: V. start_state: the state after ``<s>`` (where an utterance starts).
        token_word: (V,) the word id of each model token (-1 for the blank).
        keys: (A,) sorted ``state * W + word`` of every listed n-gram, A arcs. arc_logp: (A,) its natural-log
            probability. arc_next: (A,) the state after it. backoff: (S,) natural-log back-off weight of each state.
        parent: (S,) the state of the history without its first word (the root's is itself).
    """

    def __init__(self, contents: ArpaContents, pieces: Sequence[str], *, blank_id: int = 0, unk_id: int | None = 1,
                 source: str = "<memory>", lines: dict | None = None):
        self.order = contents.order
        self.vocab_size = len(pieces)
        self.source = source
        words = [BOS, EOS, UNK]
        index = {w: i for i, w in enumerate(words)}
        piece_ids = {p: i for i, p in enumerate(pieces)}
        unigrams = dict(contents.ngrams[0])
        for gram in unigrams:
            w = gram[0]
            if w in index:
                continue
            if w not in piece_ids or piece_ids[w] == blank_id:
                where = f"{source}:{lines[gram]}" if lines and gram in lines else source
                raise ArpaError(f"{where}: the word {w!r} is not a token of the model's vocabulary ({len(pieces)} "
                                f"pieces); fix: build the LM on the model's BPE pieces (the tokenizer of this model)")
            index[w] = len(words)
            words.append(w)
        for order_grams in contents.ngrams[1:]:
            for gram in order_grams:
                for w in gram:
                    if w not in index or (w != BOS and (w,) not in unigrams):
                        where = f"{source}:{lines[gram]}" if lines and gram in lines else source
                        raise ArpaError(f"{where}: the n-gram {' '.join(gram)!r} uses {w!r}, which has no unigram; "
                                        "fix: an ARPA file lists every word as a 1-gram")
        if (UNK,) not in unigrams:
            unigrams[(UNK,)] = (MISSING_UNK_LOG10, 0.0)
        self.num_words = W = len(words)

        # states: the empty history (0) and every listed n-gram below the highest order
        state_of: dict[tuple[str, ...], int] = {(): 0}
        grams_by_order = [unigrams] + [dict(g) for g in contents.ngrams[1:]]
        for k, grams in enumerate(grams_by_order[:-1], 1):
            for gram in grams:
                state_of[gram] = len(state_of)
        S = len(state_of)
        backoff = [0.0] * S
        parent = [0] * S
        for gram, s in state_of.items():
            if gram:
                backoff[s] = grams_by_order[len(gram) - 1][gram][1] * LN10
                parent[s] = self._longest_state(gram[1:], state_of)

        keys, logp, nxt = [], [], []
        for grams in grams_by_order:
            for gram, (lp, _) in grams.items():
                hist = state_of.get(gram[:-1])
                if hist is None:  # "h w" listed without "h": ARPA files from KenLM always list h
                    raise ArpaError(f"{source}: the n-gram {' '.join(gram)!r} is listed but its history "
                                    f"{' '.join(gram[:-1])!r} is not; fix: rebuild the LM (a pruned file must keep "
                                    "every history of a listed n-gram)")
                keys.append(hist * W + index[gram[-1]])
                logp.append(lp * LN10)
                nxt.append(self._longest_state(gram, state_of))
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.keys = torch.tensor([keys[i] for i in order], dtype=torch.int64)
        self.arc_logp = torch.tensor([logp[i] for i in order], dtype=torch.float32)
        self.arc_next = torch.tensor([nxt[i] for i in order], dtype=torch.int64)
        self.backoff = torch.tensor(backoff, dtype=torch.float32)
        self.parent = torch.tensor(parent, dtype=torch.int64)
        self.num_states = S
        token_word = [index.get(p, index[UNK]) for p in pieces]
        if unk_id is not None and 0 <= unk_id < len(pieces):
            token_word[unk_id] = index[UNK]
        token_word[blank_id] = -1
        self.blank_id = blank_id
        self.token_word = torch.tensor(token_word, dtype=torch.int64)
        self.start_state = state_of.get((BOS,), 0)
        self.eos_word = index[EOS]
        self.dense_logp = self.dense_next = None
        if S * len(pieces) <= DENSE_LIMIT:  # every back-off walk done once: a lookup is then one gather
            states = torch.arange(S)
            self.dense_logp, self.dense_next = self._walk_all(states)

    @staticmethod
    def _longest_state(gram: tuple[str, ...], state_of: dict) -> int:
        """The state of the longest suffix of ``gram`` that is a state (the history a next word is scored after)."""
        for i in range(len(gram) + 1):
            s = state_of.get(gram[i:])
            if s is not None:
                return s
        return 0

    def to(self, device: torch.device | str) -> "NgramLm":
        for name in ("keys", "arc_logp", "arc_next", "backoff", "parent", "token_word", "dense_logp", "dense_next"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def start(self, n: int) -> torch.Tensor:
        """(n,) int64 start states (after ``<s>``)."""
        return torch.full((n,), self.start_state, dtype=torch.int64, device=self.device)

    def _lookup(self, states: torch.Tensor, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Back-off walk for word ids (any shape, same as ``states``): natural-log probability and next state."""
        total = torch.zeros(states.shape, dtype=torch.float32, device=self.device)
        result = torch.zeros_like(total)
        nxt = torch.zeros_like(states)
        done = torch.zeros(states.shape, dtype=torch.bool, device=self.device)
        s = states.clone()
        A = self.keys.numel()
        for _ in range(self.order):  # at most order-1 back-offs, then the root lists every word
            key = s * self.num_words + words
            idx = torch.searchsorted(self.keys, key).clamp(max=A - 1)
            hit = (self.keys[idx] == key) & ~done
            result = torch.where(hit, total + self.arc_logp[idx], result)
            nxt = torch.where(hit, self.arc_next[idx], nxt)
            done = done | hit
            miss = ~done
            total = torch.where(miss, total + self.backoff[s], total)
            s = torch.where(miss, self.parent[s], s)
        return result, nxt

    def score(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(token | state) in natural log and the next state, for states and model tokens of one shape.
        The blank scores 0 and keeps its state."""
        if self.dense_logp is not None:
            return self.dense_logp[states, tokens], self.dense_next[states, tokens]
        return self._walk(states, tokens)

    def _walk(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        words = self.token_word[tokens]
        blank = words < 0
        logp, nxt = self._lookup(states, words.clamp(min=0))
        return logp.masked_fill(blank, 0.0), torch.where(blank, states, nxt)

    def score_all(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) states → (N, V) log-probabilities of every model token (blank column 0) and (N, V) next states."""
        if self.dense_logp is not None:
            return self.dense_logp[states], self.dense_next[states]
        return self._walk_all(states)

    def _walk_all(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, V = states.shape[0], self.vocab_size
        tokens = torch.arange(V, device=self.device).expand(N, V)
        return self._walk(states[:, None].expand(N, V), tokens)

    def final(self, states: torch.Tensor) -> torch.Tensor:
        """(N,) log p(</s> | state), natural log."""
        return self._lookup(states, torch.full_like(states, self.eos_word))[0]

    def sentence_logprob(self, tokens: Sequence[int], *, eos: bool = True) -> float:
        """Natural-log probability of a token sequence from ``<s>`` (plus ``</s>`` with ``eos``), one at a time."""
        s = self.start(1)
        total = 0.0
        for t in tokens:
            lp, s = self.score(s, torch.tensor([t], device=self.device))
            total += float(lp)
        return total + (float(self.final(s)) if eos else 0.0)

    def __repr__(self) -> str:
        return f"NgramLm({self.source!r}, order={self.order}, states={self.num_states}, arcs={self.keys.numel()})"


def load_arpa(path: str | Path, pieces: Sequence[str], *, blank_id: int = 0, unk_id: int | None = 1) -> NgramLm:
    """Read an ARPA file whose words are the pieces of a model's tokenizer (``pieces[i]`` = the piece of token i)."""
    contents = read_arpa(path)
    lines = _gram_lines(path) if _needs_lines(contents, pieces) else None
    return NgramLm(contents, pieces, blank_id=blank_id, unk_id=unk_id, source=str(path), lines=lines)


def _needs_lines(contents: ArpaContents, pieces: Sequence[str]) -> bool:
    known = set(pieces) | {BOS, EOS, UNK}
    return any(w not in known for grams in contents.ngrams for gram in grams for w in gram)


def _gram_lines(path: str | Path) -> dict[tuple[str, ...], int]:
    """Line number of each n-gram of a file (read again only to name the line of an error)."""
    out: dict[tuple[str, ...], int] = {}
    n = 0
    with Path(path).open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if line.startswith("\\") and line.endswith("-grams:"):
                n = int(line[1:-len("-grams:")])
            elif n and line and not line.startswith("\\"):
                out.setdefault(tuple(line.split()[1 : n + 1]), lineno)
    return out
