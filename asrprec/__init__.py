"""asrprec: transducer (RNN-T) speech recognition trained and decoded in low precision.

Subpackages: :mod:`asrprec.precision` (fp32 / amp-fp16 / amp-bf16 / bf16 policies),
:mod:`asrprec.models`, :mod:`asrprec.losses`, :mod:`asrprec.decoding`, :mod:`asrprec.data`,
:mod:`asrprec.optim`, :mod:`asrprec.training`. Nothing optional is imported here.
"""

__version__ = "0.1.0"
