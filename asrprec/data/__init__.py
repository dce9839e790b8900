"""Data: the synthetic espeak-ng corpus, fbank features, validation and the lhotse datamodule.

Names are imported on first use, so ``import asrprec.data`` needs neither lhotse nor espeak-ng, and
the corpus generator's spawn workers start without importing torch or lhotse.

* :func:`generate_corpus`, :func:`load_corpus` — :mod:`asrprec.data.synthetic`
* :func:`compute_fbank`, :func:`compute_corpus_fbank`, :class:`OnTheFlyFbank`, :func:`load_fbank_cuts` — :mod:`asrprec.data.features`
* :func:`check_cuts`, :class:`DataReport`, :class:`DataCheckError`, :func:`validate_cuts`, :func:`filter_by_duration` — :mod:`asrprec.data.validate`
* :class:`DataConfig`, :class:`SpecAugmentConfig`, :class:`NoiseMixConfig`, :class:`AsrDataModule` — :mod:`asrprec.data.datamodule`
* :func:`compute_fbank_lazy` — :mod:`asrprec.data.features`
* :func:`load_cuts`, :func:`write_cuts`, :func:`speed_perturbed`, :func:`shuffle_manifests` — :mod:`asrprec.data.manifests`
* LibriSpeech and MUSAN download and manifests (lhotse's recipes) — :mod:`asrprec.data.corpora`
* a corpus of one's own (Kaldi data dirs, NeMo and lhotse manifests) as 16 kHz mono cuts — :mod:`asrprec.data.sources`
* the stages after the manifests (speed perturbation, fbank, tokenizer) — :mod:`asrprec.data.preparation`
* resumable downloads checked against published MD5s — :mod:`asrprec.data.download`
* stage records (a rerun redoes only what changed) — :mod:`asrprec.data.stages`
* :class:`CheckOptions`, :func:`check_splits`, :func:`check_feature_bins` — :mod:`asrprec.data.validate`
* :func:`resample_poly` — :mod:`asrprec.data.resample`
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "generate_corpus": "synthetic",
    "load_corpus": "synthetic",
    "CorpusConfig": "synthetic",
    "compute_fbank": "features",
    "compute_corpus_fbank": "features",
    "OnTheFlyFbank": "features",
    "load_fbank_cuts": "features",
    "fbank_extractor": "features",
    "validate_cuts": "validate",
    "check_cuts": "validate",
    "check_splits": "validate",
    "check_feature_bins": "validate",
    "CheckOptions": "validate",
    "DataReport": "validate",
    "DataCheckError": "validate",
    "filter_by_duration": "validate",
    "DataConfig": "datamodule",
    "SpecAugmentConfig": "datamodule",
    "AsrDataModule": "datamodule",
    "NoiseMixConfig": "datamodule",
    "compute_fbank_lazy": "features",
    "load_cuts": "manifests",
    "ManifestError": "manifests",
    "write_cuts": "manifests",
    "speed_perturbed": "manifests",
    "shuffle_manifests": "manifests",
    "resample_poly": "resample",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"asrprec.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'asrprec.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
