"""Optimizer wrappers for models whose parameters are bfloat16 (policy ``bf16``).

:class:`MasterWeightOptimizer` keeps an fp32 master copy of every bf16 parameter; the inner optimizer
(built by the user's factory) only ever sees the fp32 copies, so its state is fp32 and no update is lost
to bf16 rounding. After each step the masters are rounded to nearest into the bf16 model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def _groups(params: Iterable) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g) for g in params]
    return [{"params": params}]


class _Wrapper:
    """Shared plumbing: behaves like a torch optimizer (param_groups, state_dict, zero_grad)."""

    inner: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class MasterWeightOptimizer(_Wrapper):
    """Run ``factory(param_groups_with_fp32_masters)`` and keep the bf16 model in sync with the masters."""

    def __init__(self, params: Iterable, factory: Callable[[Any], torch.optim.Optimizer]):
        groups = _groups(params)
        self._model_params: list[torch.nn.Parameter] = []
        self._masters: list[torch.Tensor] = []
        master_groups = []
        for g in groups:
            ms = []
            for p in g["params"]:
                m = p.detach().clone().float().requires_grad_(p.requires_grad)
                self._model_params.append(p)
                self._masters.append(m)
                ms.append(m)
            master_groups.append({**g, "params": ms})
        self.inner = factory(master_groups)

    def step(self, closure=None):
        for p, m in zip(self._model_params, self._masters):
            m.grad = None if p.grad is None else p.grad.float()
        out = self.inner.step(closure) if closure is not None else self.inner.step()
        with torch.no_grad():
            for p, m in zip(self._model_params, self._masters):
                p.copy_(m)
                m.grad = None  # the fp32 gradient copies live for the step only (4 bytes per parameter)
        return out

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self._masters]}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for p, m, saved in zip(self._model_params, self._masters, state["masters"]):
                m.copy_(saved)
                p.copy_(m)
