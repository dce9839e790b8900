"""n-gram language models (ARPA files read into tensors, a Kneser-Ney estimator writing ARPA) and the phrase-boosting
trie, for decoding with shallow fusion, LODR and hot phrases (:mod:`asrprec.decoding.fusion`). Imports no model."""

from .arpa import ArpaError, NgramLm, load_arpa, read_arpa
from .boosting import BoostingTrie
from .estimate import build_token_lm, estimate_kneser_ney, write_arpa

__all__ = ["ArpaError", "BoostingTrie", "NgramLm", "build_token_lm", "estimate_kneser_ney", "load_arpa", "read_arpa",
           "write_arpa"]
