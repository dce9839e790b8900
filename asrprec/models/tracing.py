"""Whether code runs inside a graph capture: ``torch.export`` (deployment) or ``torch.compile`` (speed), where a
model must not branch on data or keep state between calls; the model keeps the same numerics either way."""

from __future__ import annotations

import random
from typing import Union

import torch
from torch import Tensor, nn


def is_exporting() -> bool:
    """True inside ``torch.export`` (``torch.compiler.is_exporting``, missing from older torch versions)."""
    probe = getattr(torch.compiler, "is_exporting", None)
    return bool(probe()) if probe is not None else False


def is_tracing() -> bool:
    """True while ``torch.compile`` or ``torch.export`` traces the code (``torch.compiler.is_compiling`` is also
    true under export). Branches taken here must compute what eager mode computes, only without data-dependent
    Python control flow (``.item()``, ``bool(tensor)``) or state kept between calls."""
    probe = getattr(torch.compiler, "is_compiling", None)
    return is_exporting() or (bool(probe()) if probe is not None else False)


def random_below(p: Union[float, Tensor]) -> Union[bool, Tensor]:
    """``random.random() < p``: a bool in eager mode, a 0-dim bool tensor while tracing.

    The draw is the same Python ``random.random()`` call either way: dynamo replays a compiled frame's Python
    random calls, in program order, before it runs the graph, so compiled and eager runs draw the same numbers
    and take the same decisions. The tensor form lets the compiled graph apply the decision as a mask instead of
    a Python branch (a branch on a random value would need a guard that fails on the next call).
    """
    r = random.random()
    if is_tracing():
        return torch.full((), r, dtype=torch.float64) < p
    return r < p


def check_lengths_in_graph(lens: Tensor, min_len: int, max_len: int) -> None:
    """Assert ``min_len <= lens <= max_len`` inside a compiled graph (a RuntimeError when the graph runs), where
    eager code raises a ValueError after reading the lengths."""
    torch._assert_async((lens.min() >= min_len) & (lens.max() <= max_len),
                        f"every length must lie in [{min_len}, T] feature frames (T: the padded length)")


def compiled_regions(module: nn.Module) -> int:
    """How many compiled functions run inside ``module``'s forward: 1 for a module compiled whole, the number of
    regions for one compiled by ``asrprec.models.compile.compile_model(regions="layers")``, 0 for an eager module."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return 1
    return int(getattr(module, "compiled_regions", 0))
