"""Shallow fusion, LODR and phrase boosting as one per-token bonus that the searches add to non-blank tokens.

For a hypothesis whose label sequence is y, a next token v ≠ blank scores::

    log p_am(v | x, y) + λ log p_lm(v | y) − μ log p_lodr(v | y) + boost(v | y)

λ = ``lm_scale`` (shallow fusion), μ = ``lodr_scale`` (LODR: a low-order LM on the training transcripts, subtracted to
take out the internal LM the transducer learnt; Xu et al. 2022, icefall ``modified_beam_search_LODR`` in
``egs/librispeech/ASR/pruned_transducer_stateless2/beam_search.py``), ``boost`` the phrase bonus of
:class:`asrprec.lm.BoostingTrie`. The blank is never scored by them. With every scale 0 the bonus is exactly 0 and
each search makes its plain decisions (the tests check it token for token).

Greedy searches keep the blank / non-blank decision of the acoustic model and pick the non-blank token with the
bonus added (NeMo's greedy fusion, NVIDIA/NeMo ``nemo/collections/asr/parts/submodules/transducer_decoding/
rnnt_label_looping.py``); beam searches add the bonus to the candidates' scores.

:class:`Fusion` holds the models and scales for a whole run; :meth:`Fusion.for_batch` gives the
:class:`BatchFusion` of one batch (each utterance's own phrases compiled with the global list). A fusion state is an
int64 row ``[lm, lodr, global phrases, own phrases]`` per hypothesis.

Legend: B utterances, N hypotheses (rows), V vocabulary (blank included).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from asrprec.lm import BoostingTrie, NgramLm, load_arpa

__all__ = ["BatchFusion", "Fusion", "cut_phrases", "read_phrases"]

log = logging.getLogger(__name__)

#: the manifest field with an utterance's own phrases (in ``cut.custom`` or a supervision's ``custom``)
PHRASES_FIELD = "hotwords"


def read_phrases(path: str | Path) -> list[str]:
    """One phrase a line (blank lines and ``#`` comments skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such hot-phrase file; fix: pass a text file with one phrase a line")
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def cut_phrases(cut: Any, field: str = PHRASES_FIELD) -> list[str]:
    """An utterance's own phrases: ``cut.custom[field]`` or its supervisions' ``custom[field]``; a list of strings or
    one string of phrases separated by ``|``."""
    found: list[str] = []
    sources = [getattr(cut, "custom", None)] + [getattr(s, "custom", None) for s in getattr(cut, "supervisions", [])]
    for custom in sources:
        value = (custom or {}).get(field)
        if value is None:
            continue
        items = value.split("|") if isinstance(value, str) else list(value)
        found += [str(p).strip() for p in items if str(p).strip()]
    return list(dict.fromkeys(found))


class BatchFusion:
    """The fusion of one batch: ``start`` gives each utterance's first state, ``scores`` every token's bonus and
    next state, ``step`` those of chosen tokens, ``final`` what an ending hypothesis gives back (an unfinished phrase).

    Args:
        lm, lodr: n-gram models or None. lm_scale, lodr_scale: λ and μ.
        global_trie: the global phrases (one set) or None. own_trie: the utterances' own phrases, one set per
            utterance (``own_trie.roots[b]``), or None. vocab_size: V. blank_id: the blank.
    """

    def __init__(self, *, lm: NgramLm | None, lm_scale: float, lodr: NgramLm | None, lodr_scale: float,
                 global_trie: BoostingTrie | None, own_trie: BoostingTrie | None, vocab_size: int, blank_id: int = 0):
        self.lm, self.lodr = lm, lodr
        self.lm_scale, self.lodr_scale = float(lm_scale), float(lodr_scale)
        self.global_trie, self.own_trie = global_trie, own_trie
        self.vocab_size, self.blank_id = vocab_size, blank_id

    def to(self, device: torch.device | str) -> "BatchFusion":
        for part in (self.lm, self.lodr, self.global_trie, self.own_trie):
            if part is not None:
                part.to(device)
        return self

    @property
    def device(self) -> torch.device:
        for part in (self.lm, self.lodr, self.global_trie, self.own_trie):
            if part is not None:
                return part.fail.device if isinstance(part, BoostingTrie) else part.device
        return torch.device("cpu")

    def start(self, utterances: torch.Tensor) -> torch.Tensor:
        """(N,) utterance indices (the batch's input order) → (N, 4) int64 start states."""
        N = utterances.shape[0]
        s = torch.zeros(N, 4, dtype=torch.int64, device=self.device)
        if self.lm is not None:
            s[:, 0] = self.lm.start_state
        if self.lodr is not None:
            s[:, 1] = self.lodr.start_state
        if self.global_trie is not None:
            s[:, 2] = self.global_trie.roots[0]
        if self.own_trie is not None:
            s[:, 3] = self.own_trie.roots[utterances.to(self.device)]
        return s

    def _parts(self, states: torch.Tensor, tokens: torch.Tensor | None):
        """(bonus, next states) for ``tokens`` of the shape of states[..., 0], or for every token (tokens None)."""
        parts = ((self.lm, 0, self.lm_scale), (self.lodr, 1, -self.lodr_scale), (self.global_trie, 2, 1.0),
                 (self.own_trie, 3, 1.0))
        N = states.shape[0]
        shape = (N, self.vocab_size) if tokens is None else tokens.shape
        bonus = torch.zeros(shape, dtype=torch.float32, device=states.device)
        nxt = states[:, None, :].expand(N, self.vocab_size, 4) if tokens is None else states
        nxt = nxt.clone()
        for model, col, scale in parts:
            if model is None:
                continue
            if tokens is None:
                value, to = model.score_all(states[:, col])
            else:
                value, to = model.score(states[:, col], tokens)
            bonus = bonus + scale * value
            nxt[..., col] = to
        return bonus, nxt

    def scores(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 4) states → (N, V) float32 bonus of every token (blank 0) and (N, V, 4) next states."""
        return self._parts(states, None)

    @property
    def has_phrases(self) -> bool:
        """Whether any hot phrase is boosted in this batch."""
        return self.global_trie is not None or self.own_trie is not None

    def phrase_scores(self, states: torch.Tensor) -> torch.Tensor:
        """(N, 4) states → (N, V) float32: every token's phrase bonus alone (no LM or LODR)."""
        bonus = torch.zeros(states.shape[0], self.vocab_size, dtype=torch.float32, device=states.device)
        for trie, col in ((self.global_trie, 2), (self.own_trie, 3)):
            if trie is not None:
                bonus = bonus + trie.score_all(states[:, col])[0]
        return bonus

    def step(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 4) states and (N,) tokens → (N,) bonus and (N, 4) next states (blank: 0, unchanged)."""
        return self._parts(states, tokens)

    def final(self, states: torch.Tensor) -> torch.Tensor:
        """(N,) float32: minus the provisional bonus of unfinished phrases."""
        out = torch.zeros(states.shape[0], dtype=torch.float32, device=states.device)
        if self.global_trie is not None:
            out = out + self.global_trie.final(states[:, 2])
        if self.own_trie is not None:
            out = out + self.own_trie.final(states[:, 3])
        return out


class Fusion:
    """Language models, LODR and hot phrases for a decoding run (loaded once; :meth:`for_batch` per batch).

    Args:
        lm, lodr: n-gram models (:func:`asrprec.lm.load_arpa`) or None. lm_scale, lodr_scale: λ, μ.
        phrases: the global phrase list, as token-id sequences. hotword_score: the bonus per phrase token.
        vocab_size: V. blank_id: the blank.
        phrases_by_cut: each utterance's own phrases (token-id sequences) by cut id (:meth:`with_cut_phrases`).
    """

    def __init__(self, *, vocab_size: int, blank_id: int = 0, lm: NgramLm | None = None, lm_scale: float = 0.0,
                 lodr: NgramLm | None = None, lodr_scale: float = 0.0, phrases: Sequence[Sequence[int]] = (),
                 hotword_score: float = 0.0, phrases_by_cut: Mapping[str, Sequence[Sequence[int]]] | None = None):
        self.vocab_size, self.blank_id = vocab_size, blank_id
        self.lm, self.lm_scale, self.lodr, self.lodr_scale = lm, lm_scale, lodr, lodr_scale
        self.hotword_score = float(hotword_score)
        self.phrases = [tuple(p) for p in phrases if len(p)]
        self.global_trie = BoostingTrie([self.phrases], self.hotword_score, vocab_size, blank_id) if self.phrases else None
        self.phrases_by_cut = {k: tuple(tuple(p) for p in v if len(p)) for k, v in (phrases_by_cut or {}).items()}
        self._device = torch.device("cpu")

    @classmethod
    def from_files(cls, tokenizer, *, lm: str | Path | None = None, lm_scale: float = 0.0, lodr: str | Path | None = None,
                   lodr_scale: float = 0.0, hotwords: str | Path | None = None, hotword_score: float = 0.0) -> "Fusion":
        """Load the ARPA files and the phrase file named (their words are ``tokenizer``'s pieces)."""
        pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        kw = dict(blank_id=tokenizer.blank_id, unk_id=tokenizer.unk_id)
        lm_model = load_arpa(lm, pieces, **kw) if lm else None
        lodr_model = load_arpa(lodr, pieces, **kw) if lodr else None
        phrases = tokenizer.encode(read_phrases(hotwords)) if hotwords else []
        for model in (lm_model, lodr_model):
            if model is not None:
                log.info("language model %s", model)
        return cls(vocab_size=tokenizer.vocab_size, blank_id=tokenizer.blank_id, lm=lm_model, lm_scale=lm_scale,
                   lodr=lodr_model, lodr_scale=lodr_scale, phrases=phrases, hotword_score=hotword_score)

    def with_cut_phrases(self, cuts: Iterable[Any], tokenizer, field: str = PHRASES_FIELD) -> "Fusion":
        """Read each cut's own phrases from its manifest ``field`` (:func:`cut_phrases`), tokenised."""
        mapping = {}
        for cut in cuts:
            phrases = cut_phrases(cut, field)
            if phrases:
                mapping[cut.id] = tokenizer.encode(phrases)
        self.phrases_by_cut = {k: tuple(tuple(p) for p in v if len(p)) for k, v in mapping.items()}
        return self

    def to(self, device: torch.device | str) -> "Fusion":
        self._device = torch.device(device)
        for part in (self.lm, self.lodr, self.global_trie):
            if part is not None:
                part.to(self._device)
        return self

    def for_batch(self, cut_ids: Sequence[str] | None = None, *, own_phrases: Sequence[Sequence[Sequence[int]]] | None
                  = None) -> BatchFusion:
        """The :class:`BatchFusion` of a batch: its utterances' own phrases from ``phrases_by_cut`` (by ``cut_ids``)
        or given as ``own_phrases`` (one list per utterance)."""
        if own_phrases is None:
            own_phrases = [self.phrases_by_cut.get(c, ()) for c in cut_ids] if cut_ids is not None else []
        own_trie = None
        if any(len(p) for p in own_phrases):
            known = set(self.phrases)  # a phrase in both lists is boosted once
            sets = [[tuple(p) for p in ps if len(p) and tuple(p) not in known] for ps in own_phrases]
            own_trie = BoostingTrie(sets, self.hotword_score, self.vocab_size, self.blank_id).to(self._device)
        return BatchFusion(lm=self.lm, lm_scale=self.lm_scale, lodr=self.lodr, lodr_scale=self.lodr_scale,
                           global_trie=self.global_trie, own_trie=own_trie, vocab_size=self.vocab_size,
                           blank_id=self.blank_id)

    def __repr__(self) -> str:
        return (f"Fusion(lm={self.lm!r}, lm_scale={self.lm_scale:g}, lodr={self.lodr!r}, "
                f"lodr_scale={self.lodr_scale:g}, phrases={len(self.phrases)}, hotword_score={self.hotword_score:g}, "
                f"utterances with own phrases={len(self.phrases_by_cut)})")


def fused_greedy_tokens(logits: torch.Tensor, fusion: BatchFusion, states: torch.Tensor, blank: int) -> torch.Tensor:
    """Greedy choice with fusion: blank where the acoustic argmax is blank, else the best non-blank token of
    ``logits + bonus``. logits (N, V) any float dtype, states (N, 4) → (N,) int64."""
    am = logits.argmax(dim=-1)
    bonus, _ = fusion.scores(states)
    fused = logits.float() + bonus
    fused[:, blank] = float("-inf")
    return torch.where(am == blank, am, fused.argmax(dim=-1))
