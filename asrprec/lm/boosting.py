"""Phrase boosting: a token trie with failure arcs (an Aho-Corasick automaton), compiled to tensors.

The facts follow icefall's context graph (k2-fsa/icefall ``icefall/context_graph.py``, ``ContextGraph``: a per-token
score along a phrase, failure arcs that take back the score of an abandoned partial match, a bonus kept once a
phrase is complete) and NeMo's GPU boosting tree (NVIDIA/NeMo
``nemo/collections/asr/parts/context_biasing/boosting_graph_batched.py``: the same automaton as sorted arc tensors,
per-utterance trees since NeMo 2.7). The code is ours.

Bonus of a token sequence (what a decoder adds, λ = ``score`` per token)::

    bonus = Σ over completed phrase occurrences p (overlaps included): λ · len(p)
          + λ · depth(state)   when the automaton's state is a partial match (not itself a phrase end)

so each token's bonus is ``out(next) + prov(next) - prov(state)``: ``out(n)`` = λ · Σ len(p) over the phrases that
end at node n (n itself and, through the failure chain, its suffixes), ``prov(n)`` = λ · depth(n) for a node that
is no phrase end, else 0. A prefix that leaves the phrase (the failure arc to a shallower node) gets back exactly
the provisional bonus it was given; a completed phrase keeps its bonus. :meth:`BoostingTrie.final` takes back the
provisional bonus of an utterance that ends inside a partial match (icefall's ``ContextGraph.finalize``).

Several phrase sets (one per utterance, or one global set) are compiled into one node array; each set has its own
root (:attr:`BoostingTrie.roots`) and a state never leaves its set's nodes.

Legend: N queries, V model tokens (blank included), S trie nodes, A arcs.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

__all__ = ["BoostingTrie"]


class BoostingTrie:
    """Aho-Corasick automata over token ids for one or more phrase sets, as tensors.

    Args:
        phrase_sets: for each set, its phrases as token-id sequences (empty sequences and duplicates are ignored).
        score: the bonus per matched token (λ).
        vocab_size: V. blank_id: the token that neither matches nor breaks a match (it scores 0, state unchanged).

    Attributes:
        roots: (num_sets,) the root node of each set. keys: (A,) sorted ``node * V + token``. child: (A,).
        fail: (S,) failure node. is_root: (S,). out, prov: (S,) float32 (see the module docstring). max_depth.
    """

    def __init__(self, phrase_sets: Sequence[Sequence[Sequence[int]]], score: float, vocab_size: int,
                 blank_id: int = 0):
        self.score_per_token = float(score)
        self.vocab_size = V = int(vocab_size)
        self.blank_id = blank_id
        children: list[dict[int, int]] = []
        depth: list[int] = []
        end: list[bool] = []
        fail: list[int] = []
        roots: list[int] = []
        for phrases in phrase_sets:
            root = len(children)
            roots.append(root)
            children.append({})
            depth.append(0)
            end.append(False)
            fail.append(root)
            for phrase in phrases:
                node = root
                for tok in phrase:
                    tok = int(tok)
                    if not 0 <= tok < V or tok == blank_id:
                        raise ValueError(f"phrase token {tok} is outside the vocabulary (V={V}) or the blank")
                    nxt = children[node].get(tok)
                    if nxt is None:
                        nxt = len(children)
                        children[node][tok] = nxt
                        children.append({})
                        depth.append(depth[node] + 1)
                        end.append(False)
                        fail.append(root)
                    node = nxt
                if node != root:
                    end[node] = True
            # failure arcs by breadth-first order: fail(child of n by t) = goto(fail(n), t)
            queue = deque(children[root].values())  # depth-1 nodes fail to the root
            while queue:
                n = queue.popleft()
                for tok, c in children[n].items():
                    f = fail[n]
                    while tok not in children[f] and f != root:
                        f = fail[f]
                    fail[c] = children[f].get(tok, root)  # a child of f is shallower than c: never c itself
                    queue.append(c)
        S = len(children)
        lam = self.score_per_token
        # out(n) = λ·depth(n) if n is an end, plus out(fail(n)): nodes in breadth-first order (fail is shallower)
        by_depth = sorted(range(S), key=depth.__getitem__)
        out = [0.0] * S
        for n in by_depth:
            out[n] = (lam * depth[n] if end[n] else 0.0) + (out[fail[n]] if fail[n] != n else 0.0)
        prov = [0.0 if end[n] else lam * depth[n] for n in range(S)]
        arcs = sorted((n * V + tok, c) for n in range(S) for tok, c in children[n].items())
        self.keys = torch.tensor([k for k, _ in arcs], dtype=torch.int64)
        self.child = torch.tensor([c for _, c in arcs], dtype=torch.int64)
        self.fail = torch.tensor(fail, dtype=torch.int64)
        is_root = [False] * S
        for r in roots:
            is_root[r] = True
        self.is_root = torch.tensor(is_root, dtype=torch.bool)
        self.out = torch.tensor(out, dtype=torch.float32)
        self.prov = torch.tensor(prov, dtype=torch.float32)
        self.roots = torch.tensor(roots, dtype=torch.int64)
        self.max_depth = max(depth, default=0)
        self.num_nodes = S

    def to(self, device: torch.device | str) -> "BoostingTrie":
        for name in ("keys", "child", "fail", "is_root", "out", "prov", "roots"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def goto(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The automaton's next node for states and non-blank tokens of one shape (failure arcs followed)."""
        s = states.clone()
        nxt = s.clone()
        done = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
        A = self.keys.numel()
        for _ in range(self.max_depth + 1):  # each failure arc is shallower: at most max_depth of them
            if A:
                key = s * self.vocab_size + tokens
                idx = torch.searchsorted(self.keys, key).clamp(max=A - 1)
                hit = (self.keys[idx] == key) & ~done
                nxt = torch.where(hit, self.child[idx], nxt)
                done = done | hit
            at_root = ~done & self.is_root[s]
            nxt = torch.where(at_root, s, nxt)
            done = done | at_root
            s = torch.where(done, s, self.fail[s])
        return nxt

    def score(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bonus of each token (float32) and the next state, for states and tokens of one shape; blank: 0, same
        state."""
        blank = tokens == self.blank_id
        nxt = torch.where(blank, states, self.goto(states, tokens))
        bonus = self.out[nxt] + self.prov[nxt] - self.prov[states]
        return bonus.masked_fill(blank, 0.0), nxt

    def score_all(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) states → (N, V) bonuses of every token and (N, V) next states."""
        N, V = states.shape[0], self.vocab_size
        return self.score(states[:, None].expand(N, V), torch.arange(V, device=states.device).expand(N, V))

    def final(self, states: torch.Tensor) -> torch.Tensor:
        """(N,) what an utterance ending in ``states`` gives back: minus the provisional bonus of a partial match."""
        return -self.prov[states]

    def __repr__(self) -> str:
        return f"BoostingTrie(sets={self.roots.numel()}, nodes={self.num_nodes}, score={self.score_per_token:g})"
