"""The precision flags of every recipe (``--precision``, ``--device``, ``--bf16-update``, ``--bf16-moments``) as one
dataclass: :func:`asrprec.config.add_dataclass_args` declares them, :meth:`PrecisionOptions.policy` builds the
policy they name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asrprec.config import option

from .policy import BF16_UPDATES, POLICIES, PrecisionPolicy, get_policy

__all__ = ["PrecisionOptions"]


@dataclass
class PrecisionOptions:
    """Which precision policy a run uses, on which device."""

    precision: str = option(
        "fp32", choices=POLICIES,
        help="precision policy: fp32 (float32 everywhere); amp-fp16 (autocast float16 + grad scaler); amp-bf16 "
             "(autocast bfloat16, fp32 weights); bf16 (whole model cast to bfloat16, fp32 master weights in the "
             "optimizer). Losses, log-softmax and normalisation statistics always run in fp32.")
    device: str | None = option(None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    bf16_update: str = option(
        "master", choices=BF16_UPDATES,
        help="bf16 policy only, how the optimizer writes bf16 weights: master (fp32 master weights, +4 B/parameter; "
             "default), kahan (bf16 compensation buffer, +2 B), stochastic (stochastic rounding, +0 B) or none (round "
             "to nearest: small updates are lost; for comparison)")
    bf16_moments: bool = option(False, help="bf16 policy with --bf16-update kahan|stochastic|none only: keep the "
                                            "optimizer's moment buffers in bf16 too (-4 B/parameter)")

    def policy(self, device: str | torch.device) -> PrecisionPolicy:
        """The policy these options name, on ``device`` (this process's, already resolved)."""
        return get_policy(self.precision, device, bf16_update=self.bf16_update, bf16_moments=self.bf16_moments)
