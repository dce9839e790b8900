"""Which weights of an experiment a program loads: decoding and export share one declaration of the choice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asrprec.config import option

from .icefall import icefall_args_option, parse_icefall_source

__all__ = ["WeightsOptions"]


@dataclasses.dataclass
class WeightsOptions:
    """Which weights of an experiment to load (decoding and export share it): ``epoch-N.pt`` averaged over ``avg``
    epochs, or their running average, or an icefall checkpoint."""

    epoch: int | None = option(None, help="load epoch-N.pt (averaged with --avg); required unless --init-from")
    avg: int = option(1, help="average the last AVG epoch checkpoints ending at --epoch")
    use_averaged_model: bool = option(False, help="the running average of the weights over those epochs (icefall's)")
    init_from: str = option("", metavar="icefall:FILE", help="an icefall Zipformer checkpoint instead of the folder's")
    icefall_args: str = icefall_args_option()
    allow_nonfinite: bool = option(False, help="load weights holding NaN or Inf (with a warning), to debug a run")

    def __post_init__(self) -> None:
        if self.init_from and parse_icefall_source(self.init_from) is None:
            raise ValueError(f"--init-from {self.init_from!r}: this program takes an icefall checkpoint as "
                             "icefall:FILE; an asrprec run is loaded with --exp-dir and --epoch")
        if self.epoch is not None and self.epoch < 1:
            raise ValueError(f"--epoch {self.epoch}: epochs count from 1 (epoch-N.pt is written at the end of epoch "
                             "N). Fix: pass --epoch N of an epoch-N.pt in --exp-dir")
        if self.avg < 1:
            raise ValueError(f"--avg {self.avg}: the number of epochs averaged is at least 1. Fix: --avg 1 (epoch-N.pt "
                             "alone) or --avg A to average the A epochs ending at --epoch")

    def require_weights(self, what: str = "load") -> None:
        """Raise ValueError unless an epoch or an icefall checkpoint is named."""
        if self.epoch is None and not self.init_from:
            raise ValueError(f"--epoch is required: the epoch-N.pt to {what} (or --init-from icefall:FILE)")

    def weights_tag(self) -> str:
        """``epoch-E-avg-A[-use-averaged-model]`` or ``icefall-<stem>``."""
        if self.init_from:
            return f"icefall-{Path(parse_icefall_source(self.init_from)).stem}"
        return f"epoch-{self.epoch}-avg-{self.avg}" + ("-use-averaged-model" if self.use_averaged_model else "")
