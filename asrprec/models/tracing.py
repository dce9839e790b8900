"""Whether code runs inside ``torch.export`` (graph capture for deployment), where a model must not branch on data
or keep state between calls; the model keeps the same numerics either way."""

from __future__ import annotations

import torch


def is_exporting() -> bool:
    """True inside ``torch.export`` (``torch.compiler.is_exporting``, missing from older torch versions)."""
    probe = getattr(torch.compiler, "is_exporting", None)
    return bool(probe()) if probe is not None else False
