"""Optimizers and learning-rate schedules: :class:`ScaledAdam`, :class:`Eden`, and
:func:`get_parameter_groups_with_lrs` (per-module ``lr_scale``)."""

from .eden import Eden, eden_factor
from .scaled_adam import ScaledAdam, get_parameter_groups_with_lrs

__all__ = ["Eden", "ScaledAdam", "eden_factor", "get_parameter_groups_with_lrs"]
