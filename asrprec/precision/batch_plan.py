"""Batches sized by memory: the largest batch of each duration bucket whose projected training step fits a budget.

Legend: B utterances per batch, T padded input frames (100 per second), U padded target tokens, V vocabulary.

The step's memory comes from :func:`asrprec.precision.memory_step.project_step` (fake tensors: the whole step, every
storage counted). Projecting every bucket at every candidate B would cost minutes per point for a large model, so
:func:`fit_cost` projects a few (B, T, U) points and fits the shape the code implies:

    forward+backward peak  = a + B·(b·T + c·T² + d·T·U·J)
    optimizer-step peak    = o + B·T·i

``a``: what does not grow with the batch (weights, gradients, optimizer state, DDP buckets, T-only tables). ``b·T``:
activations per frame (the pruned loss's B·T·prune·V joint is linear in B·T and lands here). ``c·T²``: attention
scores (fits to about 0 without attention). ``d·T·U·J``: the loss lattice, J = V for an unpruned joint (its B·T·U·V
logits and their gradient), J = 1 for the pruned loss (its smoothed "simple" loss's (B, T, U) terms). ``i``: the
batch's own bytes per frame, alive through the update. :func:`plan_batches` then solves for the largest B per bucket
with ``max(peaks) <= budget × safety``.

Safety: a projection is a lower bound of ``torch.cuda.max_memory_allocated``, so the budget is scaled by
:data:`CALIBRATION_SAFETY` (the icefall calibration; ``--memory-safety`` replaces it) and :func:`lower_plan` applies
a measured peak during training. How the calibration was made: ``docs/batch_plan.md``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["CALIBRATION_SAFETY", "FRAMES_PER_SECOND", "PLAN_FILE", "BatchPlan", "BudgetTooSmall", "Bucket",
           "CostFit", "PlannedBucket", "fit_cost", "lower_plan", "parse_memory_size", "plan_batches", "read_plan",
           "write_plan"]

#: projected / measured of icefall's step (the lower of amp-fp16 0.73 and amp-bf16 0.93): see the module docstring
CALIBRATION_SAFETY = 0.73
FRAMES_PER_SECOND = 100  # 10 ms feature frames (asrprec.data.frames)
PLAN_FILE = "batch_plan.json"
PLAN_VERSION = 1


class BudgetTooSmall(ValueError):
    """The budget does not hold one utterance of the longest bucket; the message says what fits and the flag."""


def parse_memory_size(text: str, device_bytes: Optional[int] = None) -> int:
    """Bytes of a ``--max-memory`` value: ``40GB`` (10^9), ``40GiB`` (2^30), ``512MB``, ``2e10`` bytes, or a fraction
    in (0, 1] of ``device_bytes`` (the detected GPU's memory; None: no GPU, and a fraction is an error)."""
    s = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|B)?", s, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-memory {text!r}: not a size; write e.g. 40GB, 40GiB, 512MiB or 0.9 (of the GPU)")
    value, unit = float(m.group(1)), (m.group(2) or "").upper()
    if not unit and value <= 1.0:
        if value <= 0:
            raise ValueError(f"--max-memory {text!r}: a fraction of the GPU's memory must be in (0, 1]")
        if device_bytes is None:
            raise ValueError(f"--max-memory {text!r} is a fraction of the GPU's memory, and this run has no GPU; "
                             "fix: give a size such as --max-memory 8GB")
        return int(value * device_bytes)
    powers = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(value * powers[unit])


@dataclass(frozen=True)
class Bucket:
    """A duration bucket: cuts up to ``max_duration`` s with up to ``max_tokens`` tokens. ``min_duration``,
    ``cuts`` and ``seconds`` (their count and total audio) describe the corpus; 0 when unknown."""

    max_duration: float
    max_tokens: int
    min_duration: float = 0.0
    cuts: int = 0
    seconds: float = 0.0

    @property
    def frames(self) -> int:
        return int(math.ceil(self.max_duration * FRAMES_PER_SECOND))


@dataclass
class CostFit:
    """The fitted cost model of the module docstring (bytes). ``points``: the projections it was fitted on,
    ``[B, T, U, forward+backward peak, optimizer peak]``; ``max_error``: the largest |fit - projection| / projection
    over them."""

    a: float
    b: float
    c: float
    d: float
    joint: int
    o: float
    i: float
    points: list = field(default_factory=list)
    max_error: float = 0.0

    def per_utterance(self, frames: int, tokens: int) -> float:
        """Forward+backward bytes one more utterance of ``frames`` x ``tokens`` adds."""
        return self.b * frames + self.c * frames**2 + self.d * frames * tokens * self.joint

    def peak(self, batch: int, frames: int, tokens: int) -> float:
        """Projected step peak (bytes) of ``batch`` utterances padded to ``frames`` and ``tokens``."""
        return max(self.a + batch * self.per_utterance(frames, tokens), self.o + batch * frames * self.i)


@dataclass
class PlannedBucket:
    max_duration: float
    batch_size: int
    projected_peak_bytes: int
    frames: int = 0
    tokens: int = 0
    min_duration: float = 0.0
    cuts: int = 0
    seconds: float = 0.0
    verified: bool = False  # projected_peak_bytes is a direct projection, not the fit

    @property
    def padding(self) -> float:
        """Padded share of the frames if every batch held cuts of the bucket's mean duration padded to its upper
        edge (an upper estimate: a batch pads only to its own longest cut); NaN without corpus statistics."""
        if not self.cuts:
            return math.nan
        return 1.0 - (self.seconds / self.cuts) / self.max_duration


@dataclass
class BatchPlan:
    """Batch sizes per duration bucket under a budget; ``batch_plan.json`` holds it (:func:`write_plan`)."""

    buckets: list[PlannedBucket]
    budget_bytes: int
    safety: float
    fit: CostFit
    describe: dict = field(default_factory=dict)  # policy, model, loss, optimizer, world size ... (for the reader)
    notes: list = field(default_factory=list)  # what changed the plan after it was made (lower_plan)

    @property
    def cap_bytes(self) -> int:
        return int(self.budget_bytes * self.safety)

    @property
    def edges(self) -> list[float]:
        return [b.max_duration for b in self.buckets]

    @property
    def batch_sizes(self) -> list[int]:
        return [b.batch_size for b in self.buckets]

    def mean_batch_seconds(self) -> float:
        """Seconds of audio per batch over an epoch: all the audio / the number of batches (per bucket: its cuts /
        its batch size); buckets without statistics count as full batches of their upper edge."""
        seconds = sum(b.seconds if b.cuts else b.batch_size * b.max_duration for b in self.buckets)
        batches = sum(b.cuts / b.batch_size if b.cuts else 1.0 for b in self.buckets)
        return seconds / batches

    def worst(self) -> PlannedBucket:
        """The bucket with the highest projected peak (ties: the longest)."""
        return max(self.buckets, key=lambda b: (b.projected_peak_bytes, b.max_duration))

    def to_dict(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "buckets": [asdict(b) for b in self.buckets],
                "budget_bytes": self.budget_bytes, "safety": self.safety, "cap_bytes": self.cap_bytes,
                "mean_batch_seconds": self.mean_batch_seconds(), "fit": asdict(self.fit), "describe": self.describe,
                "notes": self.notes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BatchPlan":
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"batch plan version {d.get('version')!r}, this asrprec reads {PLAN_VERSION}")
        return cls(buckets=[PlannedBucket(**b) for b in d["buckets"]], budget_bytes=int(d["budget_bytes"]),
                   safety=float(d["safety"]), fit=CostFit(**d["fit"]), describe=dict(d.get("describe", {})),
                   notes=list(d.get("notes", [])))

    def table(self) -> str:
        """The plan as a Markdown table (GB = 10^9 bytes)."""
        lines = [f"batch plan: budget {self.budget_bytes / 1e9:.2f} GB x safety {self.safety:g} = "
                 f"{self.cap_bytes / 1e9:.2f} GB for the projected step; {self.mean_batch_seconds():.0f} s of audio "
                 "per batch on average",
                 "| bucket | max duration (s) | batch size | audio per batch (s) | padding (est.) | projected peak (GB) |",
                 "|---|---|---|---|---|---|"]
        for k, b in enumerate(self.buckets):
            mean = b.seconds / b.cuts if b.cuts else b.max_duration
            pad = f"{b.padding:.1%}" if b.cuts else "-"
            lines.append(f"| {k} | {b.max_duration:.2f} | {b.batch_size} | {b.batch_size * mean:.0f} | {pad} | "
                         f"{b.projected_peak_bytes / 1e9:.2f}{'' if b.verified else ' (fit)'} |")
        return "\n".join(lines)


Projector = Callable[[int, int, int], Any]  # (B, T, U) -> StepMemory


def _peaks(res: Any) -> tuple[int, int]:
    """(forward+backward peak, optimizer-step peak) of a StepMemory."""
    return int(res.backward_peak + res.cuda_autocast_extra), int(res.optimizer_peak)


def fit_cost(project: Projector, buckets: Sequence[Bucket], *, joint: int, cap: Optional[float] = None,
             pilot_batch: int = 2, light: bool = False) -> CostFit:
    """Fit :class:`CostFit` on projections near the batch sizes the plan will use.

    A pilot projection (``pilot_batch`` utterances of the longest bucket) gives the step's fixed part (its weights,
    gradients and optimizer state) and a first slope, hence a first guess B* of the longest bucket's batch under
    ``cap``. The fit then uses B*/2 and B* at the longest bucket (the constant and the slope), B* with half the
    tokens (separates T·U from T²), and the shortest and a middle bucket at B* scaled by their shorter T (T's
    curvature): points where the plan lands, so allocator rounding of small tensors does not bend the fit.

    ``project(B, T, U)`` returns a :class:`~asrprec.precision.memory_step.StepMemory`; ``joint``: V for an unpruned
    joint, 1 for the pruned loss (see the module docstring); ``cap``: the bytes the plan may use (None: B* = 8).
    ``light``: four projections instead of six (the pilot as a point; B*, B* with half the tokens and the shortest
    bucket): the four terms exactly determined, for large models on a slow CPU."""
    import torch

    by_len = sorted(buckets, key=lambda b: b.max_duration)
    hi, lo, mid = by_len[-1], by_len[0], by_len[len(by_len) // 2]
    guess, pilot = 8, None
    if cap is not None or light:
        pilot = project(pilot_batch, hi.frames, hi.max_tokens)
        fixed = pilot.persistent + pilot.gradients - pilot.inputs
        slope = max((_peaks(pilot)[0] - fixed) / pilot_batch, 1.0)
        guess = int(min(max((cap - fixed) / slope, 2), 1 << 20)) if cap is not None else guess
    b_hi = max(2, guess)
    shapes = [(max(1, b_hi // 2), hi.frames, hi.max_tokens), (b_hi, hi.frames, hi.max_tokens),
              (b_hi, hi.frames, max(1, hi.max_tokens // 2)),
              (max(2, b_hi * hi.frames // lo.frames), lo.frames, lo.max_tokens),
              (max(2, b_hi * hi.frames // mid.frames), mid.frames, mid.max_tokens)]
    points = []
    if light:
        points.append([pilot_batch, hi.frames, hi.max_tokens, *_peaks(pilot)])
        shapes = [shapes[1], shapes[2], shapes[3]]
    for shape in dict.fromkeys(shapes):  # a one-bucket corpus repeats shapes
        fb, opt = _peaks(project(*shape))
        points.append([*shape, fb, opt])
    rows = torch.tensor([[1.0, B * T, B * T * T, B * T * U * joint] for B, T, U, _, _ in points], dtype=torch.float64)
    target = torch.tensor([p[3] for p in points], dtype=torch.float64)
    # columns scaled to one, so that the least squares weigh them alike
    scale = rows.abs().max(dim=0).values.clamp_min(1.0)
    coef = torch.linalg.lstsq(rows / scale, target[:, None], driver="gelsd").solution[:, 0] / scale
    a, b, c, d = (float(x) for x in coef)
    # the optimizer step: what it holds beyond the batch, plus the batch itself (its bytes per frame)
    per_frame = [(p[4], p[0] * p[1]) for p in points]
    (o1, n1), (o2, n2) = per_frame[0], per_frame[1]  # two batch sizes of the longest bucket
    i = max(0.0, (o2 - o1) / (n2 - n1)) if n2 != n1 else 0.0
    o = max(opt - i * n for opt, n in per_frame)
    fit = CostFit(a=a, b=b, c=c, d=d, joint=joint, o=o, i=i, points=points)
    fit.max_error = max(abs(fit.a + p[0] * fit.per_utterance(p[1], p[2]) - p[3]) / p[3] for p in points)
    return fit


def _too_small(budget: int, safety: float, bucket: Any, one: float) -> str:
    """The one-line error of a budget that does not hold one utterance of ``bucket`` (``one``: that step's bytes)."""
    return (f"--max-memory {budget / 1e9:.3g} GB (x safety {safety:g} = {budget * safety / 1e9:.3g} GB for the "
            f"projected step) does not hold one utterance of the {bucket.max_duration:.2f} s bucket: its step projects "
            f"to {one / 1e9:.3g} GB, so --max-memory must be at least {one / safety / 1e9:.3g} GB; fix: raise "
            "--max-memory, or keep shorter cuts (the recipe's longest cut duration)")


def _largest_batch(fit: CostFit, cap: float, frames: int, tokens: int) -> int:
    per = fit.per_utterance(frames, tokens)
    if not per > 0:  # a step that does not grow with the batch: the projections are not what the fit assumes
        raise ValueError(f"the fitted step cost does not grow with the batch at T={frames}, U={tokens} "
                         f"({per:.3g} bytes per utterance; fit points {fit.points})")
    n_fb = math.floor((cap - fit.a) / per)
    n_opt = math.floor((cap - fit.o) / (frames * fit.i)) if fit.i > 0 else (10**9 if fit.o <= cap else 0)
    return min(n_fb, n_opt)


def plan_from_fit(fit: CostFit, buckets: Sequence[Bucket], budget_bytes: int, safety: float,
                  describe: Optional[dict] = None) -> BatchPlan:
    """The largest batch per bucket under ``budget_bytes × safety`` by the fitted cost.

    Raises:
        BudgetTooSmall: one utterance of the longest bucket does not fit (the message says what would).
    """
    if not 0 < safety <= 1:
        raise ValueError(f"the memory safety factor must be in (0, 1], got {safety}")
    cap = budget_bytes * safety
    out = []
    ordered = sorted(buckets, key=lambda b: b.max_duration)
    sizes = [_largest_batch(fit, cap, bk.frames, bk.max_tokens) for bk in ordered]
    if min(sizes) < 1:
        raise BudgetTooSmall(_too_small(budget_bytes, safety, ordered[-1],
                                        fit.peak(1, ordered[-1].frames, ordered[-1].max_tokens)))
    for bk, n in zip(ordered, sizes):
        out.append(PlannedBucket(max_duration=bk.max_duration, batch_size=n,
                                 projected_peak_bytes=int(fit.peak(n, bk.frames, bk.max_tokens)), frames=bk.frames,
                                 tokens=bk.max_tokens, min_duration=bk.min_duration, cuts=bk.cuts, seconds=bk.seconds))
    return BatchPlan(buckets=out, budget_bytes=int(budget_bytes), safety=safety, fit=fit,
                     describe=dict(describe or {}))


def plan_batches(project: Projector, buckets: Sequence[Bucket], budget_bytes: int, *,
                 safety: float = CALIBRATION_SAFETY, joint: int = 1, verify: str = "worst",
                 describe: Optional[dict] = None, light: bool = False) -> BatchPlan:
    """Fit the step's cost (:func:`fit_cost`), size every bucket (:func:`plan_from_fit`), then settle by direct
    projection: ``verify="worst"`` the longest bucket, ``"all"`` every bucket, ``"none"`` none. A settled bucket
    holds the largest B whose projection is within the cap while B + 1's is not (:func:`_settle`). ``light``: see
    :func:`fit_cost`.

    Raises:
        BudgetTooSmall: as :func:`plan_from_fit`, also when the direct projection of one utterance is over the cap.
    """
    if verify not in ("none", "worst", "all"):
        raise ValueError(f"verify must be none, worst or all, got {verify!r}")
    if not buckets:
        raise ValueError("no duration buckets to plan (no training cuts?)")
    fit = fit_cost(project, buckets, joint=joint, cap=budget_bytes * safety, light=light)
    plan = plan_from_fit(fit, buckets, budget_bytes, safety, describe)
    targets = plan.buckets if verify == "all" else [plan.buckets[-1]] if verify == "worst" else []
    for pb in targets:
        pb.batch_size, pb.projected_peak_bytes = _settle(project, pb, plan.cap_bytes, budget_bytes, safety)
        pb.verified = True
    return plan


def _settle(project: Projector, pb: PlannedBucket, cap: int, budget: int, safety: float) -> tuple[int, int]:
    """The largest B within ``cap`` by direct projection, from the fit's B: a bracket grown by doubling steps of
    ~1 % of B, then bisection (about 2 log2(1 % of B) + 3 projections)."""
    known: dict[int, int] = {}

    def fits(n: int) -> bool:
        if n not in known:
            known[n] = max(_peaks(project(n, pb.frames, pb.tokens)))
        return known[n] <= cap

    step = max(1, pb.batch_size // 100)
    if fits(pb.batch_size):
        lo = pb.batch_size
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi = pb.batch_size
        while True:
            cand = max(1, hi - step)
            if fits(cand):
                lo = cand
                break
            if cand == 1:
                raise BudgetTooSmall(_too_small(budget, safety, pb, known[1]))
            hi, step = cand, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, known[lo]


def lower_plan(plan: BatchPlan, *, measured_bytes: int, projected_bytes: int, headroom: float = 0.95
               ) -> tuple[Optional[BatchPlan], str]:
    """Check a measured step peak against the plan: ``projected / measured`` below the plan's ``safety`` means the
    calibration was optimistic for this run. Then the plan is made again from its fit with safety = the measured
    ratio × ``headroom``; returns (the lower plan, what was done), or (None, the check's line) when it holds."""
    ratio = projected_bytes / max(measured_bytes, 1)
    line = (f"batch plan check: measured peak {measured_bytes / 1e9:.2f} GB, projected {projected_bytes / 1e9:.2f} GB "
            f"(projected / measured {ratio:.2f}, plan safety {plan.safety:g})")
    if ratio >= plan.safety:
        return None, line + ": within the plan"
    safety = ratio * headroom
    lower = plan_from_fit(plan.fit, [Bucket(b.max_duration, b.tokens, b.min_duration, b.cuts, b.seconds)
                                     for b in plan.buckets], plan.budget_bytes, safety, plan.describe)
    # only ever lower: a bucket verified by projection keeps the smaller of its batch sizes
    for new, old in zip(lower.buckets, plan.buckets):
        if old.batch_size < new.batch_size:
            new.batch_size, new.projected_peak_bytes = old.batch_size, old.projected_peak_bytes
    note = (line + f": above the budget's assumption, so the plan is lowered to safety {safety:.2f}: batch sizes "
            f"{plan.batch_sizes} -> {lower.batch_sizes}")
    lower.notes = [*plan.notes, note]
    return lower, note


def write_plan(plan: BatchPlan, exp_dir: str | Path) -> Path:
    """``exp_dir/batch_plan.json``, written atomically."""
    from asrprec.atomic import atomic_write_text

    path = Path(exp_dir) / PLAN_FILE
    atomic_write_text(path, json.dumps(plan.to_dict(), indent=1) + "\n")
    return path


def read_plan(exp_dir: str | Path) -> Optional[BatchPlan]:
    """The plan in ``exp_dir`` (None when there is none)."""
    path = Path(exp_dir) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        return BatchPlan.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is no batch plan this asrprec reads ({e}); fix: delete it to plan again") from None
