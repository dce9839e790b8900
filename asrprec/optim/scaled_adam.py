"""ScaledAdam: Adam with updates relative to each tensor's RMS and a learned overall scale per tensor.

Semantics follow k2-fsa/icefall ``egs/librispeech/ASR/zipformer/optim.py`` (ScaledAdam, _get_clipping_scale,
_size_update, _step, _step_scalar); the code is ours. Differences:

* Tensors of one shape are stacked and updated together (on accelerators, ``batched=None``), the state staying
  per parameter; state is float32, bf16/fp16 weights are updated through an fp32 value (``param_fp32`` or a
  ``weight_update`` rule); None gradients are skipped; :meth:`ScaledAdam.compile` makes the update one graph.
  Why each, and what the batching costs: ``docs/optim.md``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .bf16_update import STATE_KEY, Bf16Update, closure_loss, load_state_keeping_dtypes

log = logging.getLogger(__name__)


class ScaledAdam(Optimizer):
    """ScaledAdam.

    Args:
      params: parameters or parameter groups (dicts; an ``lr`` per group is honoured, extra keys such as
        ``names`` are kept).
      lr: base learning rate (icefall default for Zipformer: 0.045, used with :class:`Eden`).
      clipping_scale: clip the RMS-weighted global gradient norm at ``clipping_scale`` x median of the last
        ``clipping_update_period`` norms (None: no clipping).
      betas: (momentum on the update, second-moment decay).
      scalar_lr_scale: lr multiplier for scalars and for the learned tensor scales.
      param_min_rms / param_max_rms: the update is scaled by max(RMS(p), param_min_rms); the learned scale never
        shrinks a tensor below param_min_rms nor grows it above param_max_rms.
      scalar_max: scalar parameters are clamped to [-scalar_max, scalar_max].
      size_update_period: learn the tensor scale every this many steps.
      batched: stack same-shaped tensors and update them together (see the module docstring); None = only
        for parameters that are not on the CPU.
      weight_update: how bf16 parameters take their fp32-computed update
        (:class:`~asrprec.optim.bf16_update.Bf16Update`); None = through an fp32 copy kept in the state.
    """

    def __init__(self, params: Iterable, lr: float = 3e-2, clipping_scale: Optional[float] = None,
                 betas: Tuple[float, float] = (0.9, 0.98), scalar_lr_scale: float = 0.1, eps: float = 1.0e-8,
                 param_min_rms: float = 1.0e-5, param_max_rms: float = 3.0, scalar_max: float = 10.0,
                 size_update_period: int = 4, clipping_update_period: int = 100, batched: Optional[bool] = None,
                 weight_update: Optional[Bf16Update] = None):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not (0 <= betas[0] < 1 and 0 < betas[1] < 1):
            raise ValueError(f"betas must be in [0,1) x (0,1), got {betas}")
        if clipping_scale is not None and clipping_scale <= 0:
            raise ValueError(f"clipping_scale must be positive or None, got {clipping_scale}")
        if not 0 < param_min_rms < param_max_rms:
            raise ValueError(f"need 0 < param_min_rms < param_max_rms, got {param_min_rms}, {param_max_rms}")
        defaults = dict(lr=lr, clipping_scale=clipping_scale, betas=betas, scalar_lr_scale=scalar_lr_scale,
                        eps=eps, param_min_rms=param_min_rms, param_max_rms=param_max_rms, scalar_max=scalar_max,
                        size_update_period=size_update_period, clipping_update_period=clipping_update_period)
        super().__init__(params, defaults)
        self.batched = batched
        self.weight_update = weight_update
        self._compiled_update = None
        self._compiled_note = False
        self._zero_grads: Dict[Tensor, Tensor] = {}  # the compiled update's stand-in for a missing gradient
        # global clipping state (icefall keeps it in the first parameter's state)
        self._clip: Dict[str, Any] = {"step": 0, "norms": None, "threshold": None, "num_clipped": 0}

    # ---- state -----------------------------------------------------------------------------------------------
    def _init_state(self, group: dict, p: Tensor, state: dict) -> None:
        pf = p.detach().float()
        state["step"] = 0
        wu = self.weight_update
        if wu is not None:
            wu.init_state(p, state)
            state["delta"] = wu.new_moment(p)
            state["exp_avg_sq"] = wu.new_moment(p)
        else:
            if p.dtype != torch.float32:
                state["param_fp32"] = pf.clone()
            state["delta"] = torch.zeros_like(pf)
            state["exp_avg_sq"] = torch.zeros_like(pf)
        if p.numel() > 1:
            rms = (pf ** 2).mean().sqrt().reshape(1)
            state["param_rms"] = rms
            state["scale_exp_avg_sq"] = torch.zeros_like(rms)
            state["scale_grads"] = torch.zeros(group["size_update_period"], device=p.device, dtype=torch.float32)

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["clipping"] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self._clip.items()}
        if self.weight_update is not None:
            sd[STATE_KEY] = self.weight_update.state_dict()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        clip = state_dict.pop("clipping", None)
        rule = state_dict.pop(STATE_KEY, None)
        if (rule is None) != (self.weight_update is None):
            saved = "with" if rule is not None else "without"
            raise ValueError(f"this ScaledAdam state was saved {saved} a bf16 update rule and the optimizer given is "
                             f"{'with' if self.weight_update is not None else 'without'} one. Fix: resume under the "
                             "precision policy and --bf16-update of the run that saved it")
        if rule is not None:
            self.weight_update.load_state_dict(rule)
        super().load_state_dict(state_dict)
        # torch's loader casts floating state to the parameter's dtype; put back the saved tensors (fp32 state
        # of a bf16 parameter, bf16 moments or Kahan buffers) as they were
        load_state_keeping_dtypes(self, state_dict)
        if clip is not None:
            self._clip = clip

    # ---- clipping ---------------------------------------------------------------------------------------------
    def _clipping_active(self) -> bool:
        return self.defaults["clipping_scale"] is not None and self._clip["step"] > 0

    def _clipping_factor(self, sq_norms: List[Tensor]) -> float:
        """``sq_norms``: squared gradient norms whose sum is the step's RMS-weighted norm squared (scalars
        weighted by ``scalar_lr_scale``, tensors by their RMS)."""
        clip = self._clip
        scale = self.defaults["clipping_scale"]
        step = clip["step"]
        if not self._clipping_active() or not sq_norms:
            return 1.0
        period = self.defaults["clipping_update_period"]
        device = sq_norms[0].device
        norm = torch.stack([t.reshape(()) for t in sq_norms]).sum().sqrt()
        if clip["norms"] is None:
            clip["norms"] = torch.zeros(period, device=device, dtype=torch.float32)
        clip["norms"][step % period] = norm
        irregular = [i for i in (10, 20, 40) if i < period]
        if step % period == 0 or step in irregular:
            norms = clip["norms"].sort()[0].cpu()
            if step in irregular:
                norms = norms[-step:]
            n = norms.numel()
            quartiles = [norms[min(n - 1, (n // 4) * k)].item() for k in range(5)]
            median = quartiles[2]
            if median != median:
                raise RuntimeError("Too many grads were not finite (median gradient norm is NaN); lower the "
                                   "learning rate or check the data / precision policy")
            threshold = scale * median * (2.0 if step in irregular else 1.0)
            log.info("Clipping_scale=%s, grad-norm quartiles %s, threshold=%.3e, percent-clipped=%.1f", scale,
                     " ".join(f"{q:.3e}" for q in quartiles), threshold, clip["num_clipped"] * 100.0 / n)
            clip["threshold"] = threshold
            clip["num_clipped"] = 0
        if clip["threshold"] is None:
            return 1.0
        ans = min(1.0, (clip["threshold"] / (norm + 1.0e-20)).item())
        if ans != ans:
            ans = 0.0
        if ans < 1.0:
            clip["num_clipped"] += 1
        return ans

    # ---- step -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if self._compiled_update is not None and self._can_fuse():
            self._step_fused()
            self._clip["step"] += 1
            return loss
        todo: List[Tuple[dict, Tensor, Tensor, dict]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ScaledAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(group, p, state)
                todo.append((group, p, p.grad.float(), state))
        batched = self.batched if self.batched is not None else bool(todo) and todo[0][1].device.type != "cpu"
        if batched:
            self._step_batched(todo)
        else:
            sq_norms = []
            if self._clipping_active():
                for group, p, g, state in todo:
                    sq_norms.append((g ** 2).sum() * group["scalar_lr_scale"] ** 2 if p.numel() == 1
                                    else ((g * state["param_rms"]) ** 2).sum())
            factor = self._clipping_factor(sq_norms)
            for group, p, g, state in todo:
                if factor != 1.0:
                    g = g * factor
                self._step_one(group, p, g, state)
        self._clip["step"] += 1
        return loss

    # ---- compiled step ----------------------------------------------------------------------------------------
    def compile(self, backend: str = "inductor", mode: Optional[str] = None) -> "ScaledAdam":
        """Run every later :meth:`step` as one ``torch.compile``'d function over all parameters (``backend`` and
        ``mode`` as for ``torch.compile``); returns ``self``. The first step compiles it (minutes on a CPU for a
        model of a few hundred tensors). One graph serves every step: what changes per step (learning rates, step
        counts, the clipping factor, which parameters have a gradient) enters as tensors. The update is the eager
        one's up to float rounding (tests/optim/test_optim.py). bf16 parameters updated in place and a
        ``weight_update`` rule are not compiled: those steps run eager, with one log line."""
        self._compiled_update = torch.compile(_fused_update, backend=backend, mode=mode, dynamic=False,
                                              fullgraph=True)
        return self

    _SHARED = ("betas", "eps", "param_min_rms", "param_max_rms", "scalar_max", "size_update_period")

    def _can_fuse(self) -> bool:
        params = [p for gr in self.param_groups for p in gr["params"]]
        if all(p.grad is None for p in params):
            return False  # nothing to update (the eager path records no gradient norm either)
        why = None
        if self.weight_update is not None:
            why = "a bf16 weight-update rule"
        elif any(p.dtype != torch.float32 or (p.grad is not None and p.grad.dtype != torch.float32) for p in params):
            why = "parameters or gradients that are not float32"
        elif any(p.grad is not None and p.grad.is_sparse for p in params):
            why = "sparse gradients"
        elif len({tuple(gr[k] for k in self._SHARED) for gr in self.param_groups}) > 1:
            why = "parameter groups that differ in more than lr and scalar_lr_scale"
        if why is not None and not self._compiled_note:
            log.info("ScaledAdam: the compiled update does not take %s; steps run eager", why)
            self._compiled_note = True
        return why is None

    def _step_fused(self) -> None:
        """Every parameter (those without a gradient are masked out and keep their values and step count), so
        the graph's inputs are the same list every step."""
        items = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:  # what the eager path would set up when the first gradient arrives
                    self._init_state(group, p, state)
                items.append((group, p, state))
        tensors = [it for it in items if it[1].numel() > 1]
        scalars = [it for it in items if it[1].numel() == 1]
        group0 = self.param_groups[0]
        beta1, beta2 = group0["betas"]
        period = group0["size_update_period"]
        beta2_corr = beta2 ** period

        def grad(p: Tensor) -> Tensor:
            if p.grad is not None:
                return p.grad
            if p not in self._zero_grads:
                self._zero_grads[p] = torch.zeros_like(p)
            return self._zero_grads[p]

        sq_norms = []
        if self._clipping_active():
            # the eager paths' sum over the parameters with a gradient: sum((g * rms)^2) = (|g| * rms)^2 per
            # tensor, scalars weighted by scalar_lr_scale (a missing gradient counts as 0)
            if tensors:
                norms = torch.stack(torch._foreach_norm([grad(p) for _, p, _ in tensors]))
                sq_norms.append((norms * torch.cat([st["param_rms"] for _, _, st in tensors])).square().sum())
            if scalars:
                sq_norms.append(sum(grad(p).square().sum() * gr["scalar_lr_scale"] ** 2 for gr, p, _ in scalars))
        factor = self._clipping_factor(sq_norms)
        # per tensor: (has a gradient, -lr (1 - beta1), the scale's step coefficient, measures its RMS this step,
        # learns its scale this step, second-moment factor, step % period)
        rows = []
        for gr, p, st in tensors:
            step = st["step"]
            bias_correction2 = 1 - beta2 ** (step + 1)
            rms_step = step % period == period - 1
            size_bias = (1 - beta2_corr ** ((step + 1) // period)) ** 0.5
            rows.append([float(p.grad is not None), -gr["lr"] * (1 - beta1),
                         -gr["lr"] * gr["scalar_lr_scale"] * size_bias, float(rms_step), float(rms_step and step > 0),
                         1.0 / bias_correction2 if bias_correction2 < 0.99 else 1.0, float(step % period)])
        # per scalar: (has a gradient, -lr scalar_lr_scale (1 - beta1), bias correction 2)
        srows = [[float(p.grad is not None), -gr["lr"] * gr["scalar_lr_scale"] * (1 - beta1),
                  1 - beta2 ** (st["step"] + 1)] for gr, p, st in scalars]
        dev = items[0][1].device
        hyper = (beta1, beta2, group0["eps"], group0["param_min_rms"], group0["param_max_rms"],
                 group0["scalar_max"], beta2_corr, period)

        def states(its, key):
            return [st[key] for _, _, st in its]

        self._compiled_update(
            [p.data for _, p, _ in tensors], [grad(p) for _, p, _ in tensors], states(tensors, "delta"),
            states(tensors, "exp_avg_sq"), states(tensors, "param_rms"), states(tensors, "scale_grads"),
            states(tensors, "scale_exp_avg_sq"), [p.data for _, p, _ in scalars], [grad(p) for _, p, _ in scalars],
            states(scalars, "delta"), states(scalars, "exp_avg_sq"), torch.tensor(factor, device=dev),
            torch.tensor(rows or [[0.0] * 7], device=dev), torch.tensor(srows or [[0.0] * 3], device=dev), hyper)
        for _, p, st in items:
            if p.grad is not None:
                st["step"] += 1

    # ---- batched step -----------------------------------------------------------------------------------------
    def _step_batched(self, todo: List[Tuple[dict, Tensor, Tensor, dict]]) -> None:
        buckets: Dict[tuple, List[Tuple[dict, Tensor, Tensor, dict]]] = {}
        for item in todo:
            group, p, _, state = item
            key = (id(group), tuple(p.shape), p.dtype, p.device, state["step"])
            buckets.setdefault(key, []).append(item)
        stacked = []
        wu = self.weight_update
        for items in buckets.values():
            group, p0, _, state0 = items[0]
            low_precision = "param_fp32" in state0
            if low_precision:
                for _, p, _, state in items:
                    if not torch.equal(state["param_fp32"].to(p.dtype), p.data):
                        state["param_fp32"].copy_(p.data.float())  # changed outside the optimizer: resync
            if wu is not None:
                pfs = [wu.read(p.data, st) for _, p, _, st in items]
            else:
                pfs = [st["param_fp32"] if low_precision else p.data for _, p, _, st in items]
            st = {"pf": torch.stack(pfs).float(), "g": torch.stack([g for _, _, g, _ in items])}
            for k in ("delta", "exp_avg_sq", "param_rms", "scale_exp_avg_sq", "scale_grads"):
                if k in state0:
                    st[k] = torch.stack([it[3][k] for it in items]).float()
            stacked.append((group, items, st))
        sq_norms = []
        if self._clipping_active():
            for group, items, st in stacked:
                if "param_rms" in st:
                    sq_norms.append((st["g"] * _bcast(st["param_rms"], st["g"])).square().sum())
                else:
                    sq_norms.append(st["g"].square().sum() * group["scalar_lr_scale"] ** 2)
        factor = self._clipping_factor(sq_norms)
        for group, items, st in stacked:
            if factor != 1.0:
                st["g"].mul_(factor)
            step = items[0][3]["step"]
            st["delta"].mul_(group["betas"][0])
            if "param_rms" in st:
                self._step_tensors_batched(group, st, step)
            else:
                self._step_scalars_batched(group, st, step)
            for k, v in st.items():
                if k == "g":
                    continue
                if k == "pf" and wu is not None:
                    for it, row in zip(items, v.unbind(0)):
                        wu.write(it[1].data, row, it[3])
                    continue
                if k == "pf":
                    dst = [it[3]["param_fp32"] if "param_fp32" in it[3] else it[1].data for it in items]
                else:
                    dst = [it[3][k] for it in items]
                if wu is not None and dst[0].dtype != torch.float32:
                    for d, row in zip(dst, v.unbind(0)):
                        wu.store_moment(d, row)
                else:
                    torch._foreach_copy_(dst, list(v.unbind(0)))
            if "param_fp32" in items[0][3]:
                torch._foreach_copy_([it[1].data for it in items], list(st["pf"].unbind(0)))
            for it in items:
                it[3]["step"] = step + 1

    def _step_tensors_batched(self, group: dict, st: Dict[str, Tensor], step: int) -> None:
        """:meth:`_step_one` for K stacked tensors (leading dim K; per-tensor statistics over the rest)."""
        beta1, beta2 = group["betas"]
        pf, g, delta = st["pf"], st["g"], st["delta"]
        period = group["size_update_period"]
        st["scale_grads"][:, step % period] = (pf * g).flatten(1).sum(1)
        if step % period == period - 1:
            st["param_rms"] = pf.square().flatten(1).mean(1).sqrt().unsqueeze(1)
            if step > 0:
                # _size_update, per row
                size_lr = group["lr"] * group["scalar_lr_scale"]
                scale_grads, param_rms, sea = st["scale_grads"], st["param_rms"], st["scale_exp_avg_sq"]
                beta2_corr = beta2 ** period
                sea.mul_(beta2_corr).add_(scale_grads.square().mean(1, keepdim=True), alpha=1 - beta2_corr)
                bias_correction2 = 1 - beta2_corr ** ((step + 1) // period)
                scale_step = scale_grads.sum(1, keepdim=True).div_(sea.sqrt().add_(group["eps"]))
                scale_step.mul_(-size_lr * (bias_correction2 ** 0.5))
                scale_step = scale_step.masked_fill(param_rms < group["param_min_rms"], 0.0)
                scale_step = torch.minimum(scale_step, (group["param_max_rms"] - param_rms) / param_rms)
                delta.add_(pf * _bcast(scale_step, pf), alpha=1 - beta1)
        exp_avg_sq = st["exp_avg_sq"]
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (step + 1)
        if bias_correction2 < 0.99:
            exp_avg_sq = exp_avg_sq * (1.0 / bias_correction2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        alpha = st["param_rms"].clamp(min=group["param_min_rms"]).mul(-group["lr"] * (1 - beta1))
        delta.add_(g.div(denom).mul_(_bcast(alpha, g)))
        pf.add_(delta)

    def _step_scalars_batched(self, group: dict, st: Dict[str, Tensor], step: int) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"] * group["scalar_lr_scale"]
        g, exp_avg_sq = st["g"], st["exp_avg_sq"]
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (step + 1)
        denom = (exp_avg_sq / bias_correction2).sqrt() + group["eps"]
        st["delta"].add_(g / denom, alpha=-lr * (1 - beta1))
        st["pf"].clamp_(min=-group["scalar_max"], max=group["scalar_max"])
        st["pf"].add_(st["delta"])

    def _step_one(self, group: dict, p: Tensor, g: Tensor, state: dict) -> None:
        wu = self.weight_update
        low_precision = "param_fp32" in state
        data = p.data
        if wu is not None:
            pf = wu.read(data, state)
            moments = {k: state[k] for k in ("delta", "exp_avg_sq")}
            for k, v in moments.items():
                state[k] = wu.load_moment(v)
        else:
            pf = state["param_fp32"] if low_precision else data
            if low_precision and not torch.equal(pf.to(p.dtype), data):
                pf.copy_(data.float())  # parameter changed outside the optimizer (e.g. loaded): resync
        beta1 = group["betas"][0]
        step = state["step"]
        delta = state["delta"]
        delta.mul_(beta1)
        if p.numel() > 1:
            period = group["size_update_period"]
            state["scale_grads"][step % period] = (pf * g).sum()
            if step % period == period - 1:
                state["param_rms"].copy_((pf ** 2).mean().sqrt())
                if step > 0:
                    self._size_update(group, pf, state)
            self._step_tensor(group, pf, g, state)
        else:
            self._step_scalar(group, pf, g, state)
        state["step"] = step + 1
        if wu is not None:
            wu.write(data, pf, state)
            for k, v in moments.items():
                wu.store_moment(v, state[k])
                state[k] = v
        elif low_precision:
            data.copy_(pf)

    def _size_update(self, group: dict, pf: Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        size_lr = group["lr"] * group["scalar_lr_scale"]
        scale_grads = state["scale_grads"]
        period = scale_grads.shape[0]
        param_rms = state["param_rms"]
        beta2_corr = beta2 ** period  # faster decay at this level
        sea = state["scale_exp_avg_sq"]
        sea.mul_(beta2_corr).add_((scale_grads ** 2).mean(), alpha=1 - beta2_corr)
        size_step = (state["step"] + 1) // period
        bias_correction2 = 1 - beta2_corr ** size_step
        denom = sea.sqrt() + group["eps"]
        scale_step = -size_lr * (bias_correction2 ** 0.5) * scale_grads.sum() / denom
        scale_step = scale_step.masked_fill(param_rms < group["param_min_rms"], 0.0)
        scale_step = torch.minimum(scale_step, (group["param_max_rms"] - param_rms) / param_rms)
        state["delta"].add_(pf * scale_step, alpha=1 - beta1)

    def _step_tensor(self, group: dict, pf: Tensor, g: Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        exp_avg_sq = state["exp_avg_sq"]
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (state["step"] + 1)
        if bias_correction2 < 0.99:
            exp_avg_sq = exp_avg_sq * (1.0 / bias_correction2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        alpha = -group["lr"] * (1 - beta1) * state["param_rms"].clamp(min=group["param_min_rms"])
        state["delta"].add_(g / denom * alpha)
        pf.add_(state["delta"])

    def _step_scalar(self, group: dict, pf: Tensor, g: Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"] * group["scalar_lr_scale"]
        exp_avg_sq = state["exp_avg_sq"]
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (state["step"] + 1)
        denom = (exp_avg_sq / bias_correction2).sqrt() + group["eps"]
        state["delta"].add_(g / denom, alpha=-lr * (1 - beta1))
        pf.clamp_(min=-group["scalar_max"], max=group["scalar_max"])
        pf.add_(state["delta"])


def _fused_update(pfs: List[Tensor], gs: List[Tensor], deltas: List[Tensor], exp_avg_sqs: List[Tensor],
                  param_rmss: List[Tensor], scale_gradss: List[Tensor], scale_seas: List[Tensor], spfs: List[Tensor],
                  sgs: List[Tensor], sdeltas: List[Tensor], sexp_avg_sqs: List[Tensor], factor: Tensor,
                  rows: Tensor, srows: Tensor, hyper: tuple) -> None:
    """:meth:`ScaledAdam._step_one` for every parameter in one function (compiled by :meth:`ScaledAdam.compile`):
    tensors ``pfs`` with their gradients and state, then scalars ``spfs``. ``rows`` and ``srows`` hold the
    per-parameter values of this step (:meth:`ScaledAdam._step_fused`). Each state tensor is written as
    ``torch.where(selected, new, old)``: a parameter without a gradient, and the RMS and scale terms on the steps
    that do not learn them, keep their values exactly."""
    beta1, beta2, eps, min_rms, max_rms, scalar_max, beta2_corr, period = hyper
    for i, pf in enumerate(pfs):
        has, lr_coef, size_coef, rms_step, size_step, second_moment_scale, col = rows[i].unbind(0)
        has, measure, learn_scale = has > 0, rms_step > 0, size_step > 0
        g = gs[i] * factor
        delta_old, rms_old, scale_grads_old, sea_old = deltas[i], param_rmss[i], scale_gradss[i], scale_seas[i]
        delta = delta_old * beta1
        scale_grads = torch.where(torch.arange(period, device=pf.device) == col, (pf * g).sum(), scale_grads_old)
        rms = torch.where(measure, pf.square().mean().sqrt().reshape(1), rms_old)
        sea = torch.where(learn_scale, sea_old * beta2_corr + scale_grads.square().mean() * (1 - beta2_corr),
                          sea_old)
        scale_step = size_coef * scale_grads.sum() / (sea.sqrt() + eps)
        scale_step = scale_step.masked_fill(rms < min_rms, 0.0)
        scale_step = torch.minimum(scale_step, (max_rms - rms) / rms)
        delta = torch.where(learn_scale, delta + pf * scale_step * (1 - beta1), delta)
        exp_avg_sq = exp_avg_sqs[i] * beta2 + g * g * (1 - beta2)
        denom = (exp_avg_sq * second_moment_scale).sqrt() + eps
        delta = delta + g / denom * (rms.clamp(min=min_rms) * lr_coef)
        for old, new in ((pf, pf + delta), (delta_old, delta), (exp_avg_sqs[i], exp_avg_sq), (rms_old, rms),
                         (scale_grads_old, scale_grads), (sea_old, sea)):
            old.copy_(torch.where(has, new, old))
    for i, pf in enumerate(spfs):
        has, lr_coef, bias_correction2 = srows[i].unbind(0)
        has = has > 0
        g = sgs[i] * factor
        delta = sdeltas[i] * beta1
        exp_avg_sq = sexp_avg_sqs[i] * beta2 + g * g * (1 - beta2)
        delta = delta + g / ((exp_avg_sq / bias_correction2).sqrt() + eps) * lr_coef
        new_pf = pf.clamp(min=-scalar_max, max=scalar_max) + delta
        for old, new in ((pf, new_pf), (sdeltas[i], delta), (sexp_avg_sqs[i], exp_avg_sq)):
            old.copy_(torch.where(has, new, old))


def _bcast(per_row: Tensor, like: Tensor) -> Tensor:
    """(K, 1) per-tensor values viewed to broadcast against a stacked (K, ...) tensor."""
    return per_row.reshape((like.shape[0],) + (1,) * (like.ndim - 1))


def get_parameter_groups_with_lrs(model: nn.Module, lr: float, include_names: bool = False,
                                  freeze_modules: Iterable[str] = ()) -> List[Dict[str, Any]]:
    """Group parameters by effective learning rate: ``lr`` times the product of the ``lr_scale`` attributes of
    every module on the parameter's path (icefall/utils.py ``get_parameter_groups_with_lrs``).

    Returns ``[{"params": [...], "lr": lr_eff, ("names": [...])}, ...]``; ``freeze_modules`` names top-level
    children whose parameters are left out.
    """
    frozen = set(freeze_modules)
    modules = dict(model.named_modules())
    groups: Dict[float, Dict[str, Any]] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] in frozen or not p.requires_grad:
            continue
        scale = float(getattr(model, "lr_scale", 1.0))
        for i in range(1, len(parts)):
            m = modules.get(".".join(parts[:i]))
            if m is not None:
                scale *= float(getattr(m, "lr_scale", 1.0))
        eff = lr * scale
        grp = groups.setdefault(eff, {"params": [], "lr": eff, "names": []})
        grp["params"].append(p)
        grp["names"].append(name)
    out = list(groups.values())
    if not include_names:
        for g in out:
            del g["names"]
    return out
