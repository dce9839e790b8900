"""bf16 weights without an fp32 master copy: how an update computed in fp32 is written into a bf16 weight.

bf16 keeps 8 significant bits, so ``w + u`` rounds back to ``w`` whenever ``|u|`` is below half the spacing of
bf16 numbers at ``w`` (2^-9 of ``|w|`` or less); Adam-style updates late in a schedule are mostly that small.
Four ways to write the update (``--bf16-update``): ``master`` (an fp32 copy takes it), ``kahan`` (a bf16
compensation buffer carries what rounding lost; Zamirai et al. arXiv 2010.06192), ``stochastic`` (unbiased
stochastic rounding) and ``none`` (round to nearest: small updates are lost). The update is always computed in fp32;
only the final write differs. Bytes per parameter: :func:`bytes_per_parameter`. The rounding noise comes from a
dedicated generator per device, seeded alike on every rank and saved in the optimizer's ``state_dict`` (exact
resume). The table of rules, bf16 moments and why not torchao or optimi: ``docs/precision.md``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

UPDATES = ("master", "kahan", "stochastic", "none")
RULES = ("kahan", "stochastic", "none")  # the updates this module writes (``master`` is a wrapper)
MOMENTS = ("fp32", "bf16")
KAHAN = "kahan_comp"  # the compensation buffer's key in an optimizer's per-parameter state
STATE_KEY = "bf16_update"  # this rule's entry in an optimizer's state_dict


def stochastic_round(x: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """Round fp32 ``x`` to bf16, away from zero with probability (low 16 bits of ``x``) / 2^16: unbiased.

    bf16 is the top half of an fp32 bit pattern; adding a uniform 16-bit integer to the pattern carries into the
    kept half with exactly that probability (sign-magnitude, so the same holds for negative values). The same
    construction as torchao's ``_fp32_to_bf16_sr`` (pytorch/ao ``torchao/optim/quant_utils.py``). Infinities and
    NaNs pass through unchanged.
    """
    x = x.float().contiguous()
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    out = (x.view(torch.int32) + noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isfinite(x), out, x.to(torch.bfloat16))



def closure_loss(closure) -> Any:
    """``torch.optim.Optimizer.step``'s closure convention: the loss it returns, evaluated with gradients on (None
    without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

class Bf16Update:
    """How an optimizer writes an fp32-computed value into a bf16 tensor (weights, and bf16-stored moments).

    The optimizer asks :meth:`read` for the fp32 working value of a weight, updates that in fp32, and hands it
    to :meth:`write`. Tensors that are not bf16 (modules the ``bf16`` policy keeps fp32) are read and written
    as they are.

    Args:
      rule: ``"kahan"``, ``"stochastic"`` or ``"none"``.
      moments: ``"fp32"`` or ``"bf16"`` (stored with stochastic rounding) for the optimizer's moment buffers.
      seed: the rounding generators' seed; the same on every rank, so data-parallel replicas stay identical.
    """

    def __init__(self, rule: str, *, moments: str = "fp32", seed: int = 0):
        if rule not in RULES:
            hint = (" (fp32 master weights come from asrprec.precision.MasterWeightOptimizer)" if rule == "master"
                    else "")
            raise ValueError(f"bf16 update rule must be one of {RULES}, got {rule!r}{hint}")
        if moments not in MOMENTS:
            raise ValueError(f"moments must be one of {MOMENTS}, got {moments!r}")
        self.rule = rule
        self.moments = moments
        self.seed = int(seed)
        # one generator per device type (a process trains on one device); keyed by type, not index, so that every
        # rank of a data-parallel run restores the same state from rank 0's checkpoint
        self._generators: Dict[str, torch.Generator] = {}
        self._saved: Dict[str, Tensor] = {}  # loaded generator states, applied at first use
        # Counting (off by default: it costs two comparisons per element): elements whose fp32 target differs
        # from the value they had, and those of them whose bf16 weight did not change. Under "none" those updates
        # are lost; under "kahan" and "stochastic" they are carried or rounded up later.
        self.counting = False
        self.counts: Dict[str, Tensor] = {}

    @property
    def moment_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.moments == "bf16" else torch.float32

    def __repr__(self) -> str:
        return f"Bf16Update(rule={self.rule!r}, moments={self.moments!r}, seed={self.seed})"

    # ---- weights ------------------------------------------------------------------------------------------
    def init_state(self, p: Tensor, state: dict) -> None:
        if self.rule == "kahan" and p.dtype == torch.bfloat16:
            state[KAHAN] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def read(self, p: Tensor, state: dict) -> Tensor:
        """The fp32 value the update applies to: ``p`` (+ its Kahan compensation). An fp32 ``p`` is returned
        itself, so updating the result in place updates the parameter."""
        if p.dtype == torch.float32:
            return p
        _check_bf16(p)
        w = p.float()
        if KAHAN in state:
            w.add_(state[KAHAN])
        return w

    def write(self, p: Tensor, target: Tensor, state: dict) -> None:
        """Store the fp32 ``target`` into ``p`` by the rule (``p`` and ``target`` of one shape)."""
        if target is p:
            return
        if p.dtype == torch.float32:
            p.copy_(target)
            return
        old = p.clone() if self.counting else None
        if self.rule == "stochastic":
            p.copy_(stochastic_round(target, self.generator(p.device)))
        else:
            p.copy_(target)  # round to nearest even
            if KAHAN in state:
                state[KAHAN].copy_(target - p.float())
        if old is not None:
            self._count(old, p, target)

    def _count(self, old: Tensor, new: Tensor, target: Tensor) -> None:
        wanted = target != old.float()
        stuck = wanted & (new == old)
        key = str(new.device)
        c = self.counts.setdefault(key, torch.zeros(2, dtype=torch.int64, device=new.device))
        c[0] += wanted.sum()
        c[1] += stuck.sum()

    def take_counts(self) -> Tuple[int, int]:
        """(updated elements, of them left unchanged in bf16) since the last call; resets the counters."""
        tot = [0, 0]
        for c in self.counts.values():
            tot[0] += int(c[0])
            tot[1] += int(c[1])
        self.counts.clear()
        return tot[0], tot[1]

    # ---- moments ------------------------------------------------------------------------------------------
    def new_moment(self, p: Tensor) -> Tensor:
        return torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)

    def load_moment(self, m: Tensor) -> Tensor:
        """An fp32 working copy of a bf16 moment (the moment itself when fp32)."""
        return m if m.dtype == torch.float32 else m.float()

    def store_moment(self, dst: Tensor, src: Tensor) -> None:
        if src is dst:
            return
        if dst.dtype == torch.bfloat16:
            dst.copy_(stochastic_round(src, self.generator(dst.device)))
        else:
            dst.copy_(src)

    # ---- random state -------------------------------------------------------------------------------------
    def generator(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        g = self._generators.get(device.type)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            saved = self._saved.pop(device.type, None)
            if saved is not None:
                g.set_state(saved.cpu())
            self._generators[device.type] = g
        return g

    def state_dict(self) -> Dict[str, Any]:
        states = {**self._saved, **{k: g.get_state() for k, g in self._generators.items()}}
        return {"rule": self.rule, "moments": self.moments, "seed": self.seed, "generators": states}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if (sd["rule"], sd["moments"]) != (self.rule, self.moments):
            raise ValueError(
                f"the optimizer state was saved with bf16 update {sd['rule']!r} and {sd['moments']} moments, this "
                f"optimizer uses {self.rule!r} and {self.moments} moments. Fix: resume with --bf16-update "
                f"{sd['rule']} (get_policy(..., bf16_moments={sd['moments'] == 'bf16'})), or load only the weights "
                "(optimizer=None) and start the optimizer afresh")
        self.seed = int(sd["seed"])
        self._generators.clear()
        self._saved = {k: v.detach().cpu().clone() for k, v in sd["generators"].items()}


def _check_bf16(p: Tensor) -> None:
    if p.dtype != torch.bfloat16:
        raise TypeError(f"a bf16 update rule writes bfloat16 or float32 tensors, got {p.dtype}; cast the model with "
                        "the bf16 precision policy (asrprec.precision.get_policy('bf16'))")


def load_state_keeping_dtypes(opt: Optimizer, state_dict: Dict[str, Any]) -> None:
    """Restore per-parameter state tensors with their saved dtypes after ``Optimizer.load_state_dict``, which casts
    floating state to the parameter's dtype (fp32 moments of a bf16 parameter would lose 16 bits)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for i, p in zip(saved_ids, params):
        for k, v in state_dict["state"].get(i, {}).items():
            if isinstance(v, Tensor) and v.is_floating_point() and k != "step":
                opt.state[p][k] = v.to(device=p.device, copy=True)


class AdamWBf16(Optimizer):
    """AdamW (``torch.optim.AdamW``'s formulas, decoupled weight decay) for bf16 parameters, written by a
    :class:`Bf16Update` rule. The update is computed in fp32 per parameter tensor.

    Args: as ``torch.optim.AdamW`` (no ``amsgrad`` / ``maximize``), and ``update`` (the rule).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, update: Bf16Update):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.update = update

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        u = self.update
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamWBf16 does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = u.new_moment(p)
                    state["exp_avg_sq"] = u.new_moment(p)
                    u.init_state(p, state)
                state["step"] += 1
                g = p.grad.float()
                m, v = u.load_moment(state["exp_avg"]), u.load_moment(state["exp_avg_sq"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - beta1 ** state["step"]
                bc2 = 1 - beta2 ** state["step"]
                w = u.read(p, state)
                if wd != 0:
                    w.mul_(1 - lr * wd)
                denom = (v.sqrt() / bc2 ** 0.5).add_(eps)
                w.addcdiv_(m, denom, value=-lr / bc1)
                u.write(p, w, state)
                u.store_moment(state["exp_avg"], m)
                u.store_moment(state["exp_avg_sq"], v)
        return loss

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd[STATE_KEY] = self.update.state_dict()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rule = state_dict.pop(STATE_KEY, None)
        if rule is None:
            raise ValueError("this optimizer state has no bf16 update rule (it was saved by another optimizer); "
                             "resume under the precision policy and --bf16-update of the run that saved it")
        self.update.load_state_dict(rule)
        super().load_state_dict(state_dict)
        load_state_keeping_dtypes(self, state_dict)


def bytes_per_parameter(update: str, moments: str = "fp32") -> int:
    """Bytes per parameter of bf16 weight + gradient + optimizer state for an Adam-family optimizer with two
    moment buffers (AdamW, ScaledAdam), per the table in the module docstring."""
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
    if moments not in MOMENTS:
        raise ValueError(f"moments must be one of {MOMENTS}, got {moments!r}")
    if update == "master" and moments == "bf16":
        raise ValueError("master weights keep the inner optimizer fp32; bf16 moments need kahan, stochastic or none")
    moment_bytes = 8 if moments == "fp32" else 4
    extra = {"master": 8, "kahan": 2, "stochastic": 0, "none": 0}[update]
    return 2 + 2 + extra + moment_bytes
