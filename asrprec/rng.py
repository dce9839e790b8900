"""Random-number generator states: seed, capture, restore, and run code without disturbing them.

One place for what an exact resume needs: Python's ``random``, numpy's global generator, torch's CPU
generator and (when CUDA is in use) every CUDA generator. :func:`get_rng_state` returns a dict that
``torch.load(weights_only=True)`` can read back, so checkpoints store it; :func:`set_rng_state` restores it;
:func:`preserved_rng` runs a block (a validation pass, an OOM scan) and then puts every generator back where it
was, so the block cannot shift the random draws of the training that follows; :func:`seeded_rng` runs a block
with generators seeded from a key (per-batch data augmentation that does not depend on which process or worker
computes it) and then restores the previous states.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import warnings
from typing import Any, Iterator

import torch

__all__ = ["get_rng_state", "set_rng_state", "seed_everything", "preserved_rng", "seeded_rng", "seed_from"]


def _numpy():
    try:
        import numpy as np
    except ImportError:  # numpy is a torch dependency in practice
        return None
    return np


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (if CUDA is initialised) CUDA generator states, weights_only-loadable."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached),
        }
    # Only if CUDA is in use: querying the states would otherwise create a CUDA context (hundreds of MB) in a
    # CPU-only run; an uninitialised CUDA generator has produced nothing that a resume would need.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured (components missing on either side are skipped)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    np = _numpy()
    if "numpy" in state and np is not None:
        s = state["numpy"]
        keys = s["keys"].numpy().astype(np.uint32)
        np.random.set_state((s["name"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            warnings.warn(
                f"the saved state has CUDA RNG states for {len(saved)} devices, this process sees "
                f"{torch.cuda.device_count()}; restoring the first {min(len(saved), torch.cuda.device_count())}"
            )
        for i, s in enumerate(saved[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the block, then restore every generator to its state before the block (also on an exception)."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def seed_from(*parts: Any) -> int:
    """A 63-bit seed from the text of ``parts`` (stable across processes, unlike ``hash()`` of a string)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Run the block with every generator seeded from ``seed``, then restore the previous states.

    CUDA generators are left alone (seeding them would create a CUDA context in CPU-only data workers).
    """
    state = get_rng_state()
    state.pop("cuda", None)
    random.seed(seed)
    torch.random.default_generator.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        set_rng_state(state)
