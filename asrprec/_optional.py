"""The one place where optional dependencies are probed and imported.

Every optional package (torchaudio, k2, numba-cuda, espeakng-loader, scipy, onnx, onnxruntime, sherpa-onnx) is
imported lazily through
:func:`require`, so importing :mod:`asrprec` never needs them, and a missing one raises an
ImportError that names the pip extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# module name -> (pip extra or command that provides it, what it is for)
_HINTS: dict[str, tuple[str, str]] = {
    "torchaudio": ("pip install 'asrprec[torchaudio]'", "the torchaudio RNN-T loss adapter"),
    "k2": (
        "install k2 for your torch/CUDA version (https://k2-fsa.github.io/k2/installation/)",
        "the k2 RNN-T loss adapter",
    ),
    "numba.cuda": ("pip install 'asrprec[cuda]'", "the numba-cuda RNN-T loss kernels"),
    "espeakng_loader": ("pip install 'asrprec[synth]'", "the synthetic espeak-ng speech corpus"),
    "scipy.signal": ("pip install 'asrprec[synth]'", "resampling espeak-ng's 22,050 Hz audio to 16 kHz"),
    "numba": ("pip install numba", "the numba CPU RNN-T loss"),
    "onnx": ("pip install 'asrprec[export]'", "ONNX export"),
    "onnxscript": ("pip install 'asrprec[export]'", "ONNX export (torch.onnx.export with dynamo=True)"),
    "onnxruntime": ("pip install 'asrprec[export]'", "running exported ONNX models"),
    "sherpa_onnx": ("pip install 'asrprec[export]'", "decoding with sherpa-onnx"),
}


def is_available(name: str) -> bool:
    """True when ``name`` imports (a package that is installed but fails to load counts as absent)."""
    try:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            return False
        require(name)
        return True
    except (ImportError, ValueError):
        return False


def require(name: str) -> ModuleType:
    """Import and return the optional module ``name``, or raise an ImportError with the install hint.

    Binary packages built for another torch (torchaudio, k2) fail with OSError/RuntimeError rather than
    ImportError; those are reported the same way.
    """
    try:
        return importlib.import_module(name)
    except (ImportError, OSError, RuntimeError) as e:
        hint, purpose = _HINTS.get(name, (f"pip install {name.split('.')[0]}", name))
        raise ImportError(f"{name} is needed for {purpose} but cannot be imported ({e}). Fix: {hint}") from e


def install_hint(name: str) -> str:
    return _HINTS.get(name, (f"pip install {name.split('.')[0]}", name))[0]
