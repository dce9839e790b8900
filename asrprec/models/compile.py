"""``torch.compile`` for a transducer's parts, in place: the compiled model keeps its module tree and state-dict names.

The Zipformer and the Conformer trace whole (no graph break) in training and eval mode, in fp32 and under autocast:
Python ``random`` draws are replayed by dynamo before the graph
and applied as masks (:func:`asrprec.models.tracing.random_below`), and length checks become in-graph asserts. The
one boundary left is the Zipformer's position-score skip while its rate is above 0 (the first 4000 batches by
default; ``attention.py`` says why), and a causal Zipformer's random chunk size, a Python choice per call that
specialises the graph. Schedules that still move are read from tensors at run time, so a new batch count does not
recompile; a schedule that settles does, once (docs/compile.md).

``nn.Module.compile`` (not ``torch.compile(module)``) keeps the module itself in the tree: checkpoints never see
``_orig_mod.`` names, DDP wraps the model that holds the compiled encoder (the layout PyTorch's DDP notes recommend:
compile the module DDP wraps, not the wrapper), and ``asrprec.export`` reads the plain modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from asrprec.config import option

from .unwrap import unwrap_model
from .schedule import hold_schedules_in_graph
from .tracing import compiled_regions

__all__ = ["COMPILE_DYNAMIC", "COMPILE_MODES", "COMPILE_PARTS", "COMPILE_REGIONS", "COMPILE_SCHEDULES",
           "CompileOptions", "compile_model", "compiled_graph_count", "compiled_regions", "prepare_for_tracing", "recompile_limit_hits"]

#: the parts :func:`compile_model` can compile
COMPILE_PARTS = ("encoder", "joiner")
#: ``dynamic`` choices: ``auto`` = torch's default (static first, dynamic once a shape changes), ``true`` = every
#: size symbolic from the first call, ``false`` = a graph per shape
COMPILE_DYNAMIC = ("auto", "true", "false")
#: ``mode`` choices of ``torch.compile`` (``default`` = None); on a GPU ``max-autotune-no-cudagraphs`` tries more
#: kernel configurations at a longer compile, and CUDA graphs (``reduce-overhead``) need static shapes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: ``regions`` choices: ``model`` = each part is one compiled function (inductor fuses across layers; the longest
#: compile); ``layers`` = the encoder's front-end and each of its layers are compiled on their own (the encoder's
#: ``compile_regions()``), and layers of the same shape share one compiled code, so the compile time grows with the
#: number of distinct layers rather than with the depth (PyTorch's "regional compilation" recipe)
COMPILE_REGIONS = ("model", "layers")
#: ``schedules`` choices: ``constant`` = a training schedule past its last point is compiled in as a constant (a rate
#: that settles at 0 drops its masks from the graph; each settling compiles the functions that read it again);
#: ``tensor`` = schedules stay run-time tensors all through training (no recompile when one settles; the settled
#: zero rates' masks are still drawn, so the torch random stream departs from eager mode's)
COMPILE_SCHEDULES = ("constant", "tensor")



@dataclass
class CompileOptions:
    """torch.compile of the encoder, shared by training and decoding (one declaration, one set of defaults); the
    why of each choice is in docs/compile.md."""

    compile: bool = option(False, help="torch.compile the encoder (same results; pays on long runs)")
    compile_dynamic: str = option("true", choices=COMPILE_DYNAMIC,
                                  help="shapes: true = symbolic (B, T); auto = static first; false = a graph per shape")
    compile_mode: str = option("default", choices=COMPILE_MODES, help="torch.compile's mode")
    compile_regions: str = option("model", choices=COMPILE_REGIONS,
                                  help="model = the encoder whole; layers = each layer on its own (shorter compile)")

    def __post_init__(self) -> None:
        if isinstance(self.compile_dynamic, bool):  # config.json of a run made when the flag was a switch
            self.compile_dynamic = "true" if self.compile_dynamic else "auto"
        for name, allowed in (("compile_dynamic", COMPILE_DYNAMIC), ("compile_mode", COMPILE_MODES),
                              ("compile_regions", COMPILE_REGIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

def _dynamic_arg(dynamic: str) -> Optional[bool]:
    if dynamic not in COMPILE_DYNAMIC:
        raise ValueError(f"dynamic must be one of {COMPILE_DYNAMIC}, got {dynamic!r}")
    return {"auto": None, "true": True, "false": False}[dynamic]


def compile_model(model: nn.Module, *, parts: Sequence[str] = ("encoder",), dynamic: str = "auto",
                  backend: str = "inductor", mode: Optional[str] = None, eager_random: bool = True,
                  recompile_limit: Optional[int] = None, regions: str = "model",
                  schedules: str = "constant") -> nn.Module:
    """Compile ``parts`` of ``model`` (a Transducer, bare or DDP-wrapped) in place and return ``model``.

    Args:
        parts: submodule names from :data:`COMPILE_PARTS` (``joiner`` compiles the joiner's forward, which the
            pruned and full losses call on their (B, T, K or U+1, J) inputs).
        dynamic: one of :data:`COMPILE_DYNAMIC`; the bucketing sampler's (B, T) vary every batch.
        backend: a ``torch.compile`` backend: ``inductor`` generates kernels; ``aot_eager`` traces forward and
            backward as inductor would but runs them with eager kernels, in a fraction of the compile time: a cheap
            check that a model traces and trains as in eager mode.
        mode: one of :data:`COMPILE_MODES` (None = ``default``).
        eager_random: generated code draws dropout masks and other random tensors with torch's own kernels
            (``torch._inductor.config.fallback_random``), so a compiled run draws the same numbers as an eager
            one and resumes exactly; False lets inductor fuse its own random number generation.
        recompile_limit: graphs each compiled function may have before dynamo runs it eager (torch.compile's
            per-region limit; None = ``torch._dynamo.config.recompile_limit``, 8). Early in training the Zipformer's
            functions are specialised, a bounded number of times, on each schedule that settles, on training against
            validation, on a batch of one utterance and on inductor's choice of reduction code by size: more than 8
            during the embedded recipe, whose schedules run 30x faster. With ``regions="layers"`` every region of
            a part gets this many graphs: the regions share one compiled code object (``nn.Module.__call__``'s),
            which dynamo counts together, so a part of N regions is given N times the limit.
        regions: one of :data:`COMPILE_REGIONS`. ``layers`` applies to a part whose module names its regions
            (``compile_regions()``: both encoders); other parts (the joiner) are compiled whole either way.
        schedules: one of :data:`COMPILE_SCHEDULES`, for the parts' ``ScheduledFloat`` values in training
            (:func:`asrprec.models.schedule.hold_schedules_in_graph`; the Conformer has none).

    Raises:
        ValueError: an unknown part, ``dynamic``, ``backend``, ``mode``, ``regions``, ``schedules`` or
            ``recompile_limit``, or a model without that part.
    """
    dyn = _dynamic_arg(dynamic)
    if recompile_limit is not None and recompile_limit < 1:
        raise ValueError(f"recompile_limit must be >= 1 (or None for torch's default), got {recompile_limit}")
    if mode == "default":
        mode = None
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    if regions not in COMPILE_REGIONS:
        raise ValueError(f"regions must be one of {COMPILE_REGIONS}, got {regions!r}")
    if schedules not in COMPILE_SCHEDULES:
        raise ValueError(f"schedules must be one of {COMPILE_SCHEDULES}, got {schedules!r}")
    import torch._dynamo
    import torch._dynamo.config as dynamo_config

    backends = torch._dynamo.list_backends(exclude_tags=())
    if isinstance(backend, str) and backend not in backends:
        raise ValueError(f"unknown torch.compile backend {backend!r}: choose from {', '.join(sorted(backends))}")
    bare = unwrap_model(model)
    for part in parts:
        if part not in COMPILE_PARTS:
            raise ValueError(f"cannot compile {part!r}: choose from {COMPILE_PARTS}")
        if not isinstance(getattr(bare, part, None), nn.Module):
            raise ValueError(f"the model has no {part} to compile")
    if eager_random:
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    prepare_for_tracing(bare)
    for part in parts:
        module = getattr(bare, part)
        hold_schedules_in_graph(module, schedules == "tensor")
        targets = module.compile_regions() if regions == "layers" and hasattr(module, "compile_regions") else None
        if targets is None:
            module.compile(dynamic=dyn, backend=backend, mode=mode, recompile_limit=recompile_limit)
            continue
        limit = (recompile_limit or dynamo_config.recompile_limit) * len(targets)
        # dynamo's cap on all graphs of one code object, whatever the per-call limits (256 by default)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 2 * limit)
        for target in targets:
            target.compile(dynamic=dyn, backend=backend, mode=mode, recompile_limit=limit)
        # the transducer reads it: an encoder with compiled parts gets its warm-up as a tensor (transducer.py)
        module.compiled_regions = len(targets)
    logging.info("torch.compile: %s (backend=%s, dynamic=%s%s%s%s%s)", ", ".join(parts), backend, dynamic,
                 "" if mode is None else f", mode={mode}",
                 "" if recompile_limit is None else f", recompile_limit={recompile_limit}",
                 "" if regions == "model" else f", regions={regions}",
                 "" if schedules == "constant" else f", schedules={schedules}")
    return model


def prepare_for_tracing(model: nn.Module) -> nn.Module:
    """Switch the modules that keep Python state between calls (the Zipformer's Whiten probability) to the tensor
    form a traced graph updates in place; eager results are the same. :func:`compile_model` calls it; call it
    before ``torch._dynamo.explain`` or your own ``torch.compile``."""
    for m in model.modules():
        if hasattr(m, "prepare_for_tracing") and m is not model:
            m.prepare_for_tracing()
    return model


class _RecompileLimitRecorder(logging.Filter):
    """Notes each function for which dynamo gives up recompiling (its "hit config.recompile_limit" warning: from
    then on the function runs eager), so a training loop can name it; every record passes through unchanged."""

    hits: list = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            lines = record.getMessage().splitlines()
            self.hits.append(next((ln.strip()[len("function: "):] for ln in lines if "function:" in ln), lines[0]))
        return True


_RECORDER = _RecompileLimitRecorder()
# torch/_dynamo/convert_frame.py logs the warning through its module logger
logging.getLogger("torch._dynamo.convert_frame").addFilter(_RECORDER)


def recompile_limit_hits() -> list:
    """The functions (name, file and line) that reached ``torch._dynamo.config.recompile_limit`` in this process,
    in order: dynamo runs each of them eager from then on."""
    return list(_RECORDER.hits)


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles, every module): logged by
    the training loop each epoch, so that shapes or schedules that recompile every batch show up."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
