"""Optimizers and learning-rate schedules: :class:`ScaledAdam`, :class:`Eden`,
:func:`get_parameter_groups_with_lrs` (per-module ``lr_scale``), and the bf16 weight-update rules
(:mod:`asrprec.optim.bf16_update`)."""

from .bf16_attach import with_bf16_update
from .bf16_update import AdamWBf16, Bf16Update, stochastic_round
from .eden import Eden, eden_factor
from .scaled_adam import ScaledAdam, get_parameter_groups_with_lrs

__all__ = ["AdamWBf16", "Bf16Update", "Eden", "ScaledAdam", "eden_factor", "get_parameter_groups_with_lrs",
           "stochastic_round", "with_bf16_update"]
