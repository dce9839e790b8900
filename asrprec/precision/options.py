"""The ``precision`` section of every program's config (``--precision``, ``--device``, ``--bf16-update``,
``precision.bf16_moments``): :meth:`PrecisionOptions.policy` builds the policy it names. The policies and update
rules are explained in docs/configuration.md and :mod:`asrprec.precision.policy`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asrprec.config import option

from .policy import BF16_UPDATES, POLICIES, PrecisionPolicy, get_policy

__all__ = ["PrecisionOptions"]


@dataclass
class PrecisionOptions:
    """Which precision policy a run uses, on which device."""

    precision: str = option("fp32", choices=POLICIES,
                            help="precision policy (losses, log-softmax, norm statistics stay fp32)")
    device: str | None = option(None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    bf16_update: str = option("master", choices=BF16_UPDATES,
                              help="bf16: how the optimizer writes bf16 weights")
    bf16_moments: bool = option(False, help="bf16 with kahan/stochastic/none: bf16 moment buffers too")

    def policy(self, device: str | torch.device) -> PrecisionPolicy:
        """The policy these options name, on ``device`` (this process's, already resolved)."""
        return get_policy(self.precision, device, bf16_update=self.bf16_update, bf16_moments=self.bf16_moments)
