"""RNN-T losses: one dispatcher (:func:`rnnt_loss`) over registered backends, and the TDT loss (:func:`tdt_loss`).

Backends: ``torch`` (reference), ``numba`` (CPU), ``numba-cuda``, ``torchaudio``, ``k2``; see
:func:`available_backends`. Optional packages are imported only when their backend runs.
"""

from .api import BackendSpec, available_backends, register_backend, resolve_backend, rnnt_loss
from .lean import rnnt_loss_lean
from .pruned import do_rnnt_pruning, get_rnnt_prune_ranges, rnnt_loss_pruned, rnnt_loss_smoothed
from .tdt import tdt_loss, validate_tdt_inputs
from .validate import validate_rnnt_inputs

__all__ = [
    "BackendSpec",
    "available_backends",
    "do_rnnt_pruning",
    "get_rnnt_prune_ranges",
    "register_backend",
    "resolve_backend",
    "rnnt_loss",
    "rnnt_loss_lean",
    "rnnt_loss_pruned",
    "rnnt_loss_smoothed",
    "tdt_loss",
    "validate_rnnt_inputs",
    "validate_tdt_inputs",
]
