"""Precision policies (``fp32``, ``amp-fp16``, ``amp-bf16``, ``bf16``), fp32 islands and loss scalers."""

from .capabilities import Capabilities, probe
from .islands import autocast_dtype, compute_dtype, fp32_island, is_kept_fp32, keep_fp32, upcast, upcast_dtype
from .master import MasterWeightOptimizer
from .policy import (
    POLICIES,
    PrecisionPolicy,
    UnsupportedPrecisionError,
    effective_dtypes,
    get_policy,
)
from .options import PrecisionOptions
from .scaler import GradScaleCollapse, LossScaler, NoOpScaler, nonfinite_grad_modules

__all__ = [
    "POLICIES", "Capabilities", "GradScaleCollapse", "LossScaler", "MasterWeightOptimizer", "NoOpScaler",
    "PrecisionOptions", "PrecisionPolicy", "UnsupportedPrecisionError", "autocast_dtype", "compute_dtype",
    "effective_dtypes", "fp32_island", "get_policy", "is_kept_fp32", "keep_fp32", "nonfinite_grad_modules", "probe",
    "upcast", "upcast_dtype",
]
