"""The stages every corpus's preparation runs once its manifests exist, whatever the corpus: cuts with audio (speed
perturbed for training), a shuffled training manifest, fbank, the tokenizer. Each output is made unless its record
says it is current (:func:`asrprec.data.stages.make_unless_done`), so a rerun continues after an interruption and
follows changed inputs. ``recipes/librispeech/prepare.py`` and ``recipes/custom/prepare.py`` call these."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .corpora import CorpusError
from .stages import content_digest, make_unless_done

log = logging.getLogger(__name__)


def input_digests(paths: Iterable[Path], hint: str) -> dict[str, str]:
    """The content digests of a stage's input files, by file name (what its record compares on a rerun); a missing
    one is a FileNotFoundError naming it and ``hint`` (how to make it)."""
    paths = list(paths)
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"{p} is missing; fix: {hint}")
    return {Path(p).name: content_digest(p) for p in paths}


def make_audio_cuts(out: Path, inputs: Sequence[Path], load: Callable[[], Any], factors: Sequence[float],
                    hint: str) -> None:
    """``out``: the cuts ``load()`` gives (made from the manifests ``inputs``), followed by their copies at each speed
    of ``factors`` (:func:`~asrprec.data.manifests.speed_perturbed`; none for dev and test parts)."""
    from .manifests import speed_perturbed, write_cuts

    factors = list(factors)
    made_from = {"manifests": input_digests(inputs, hint), "speed_factors": factors}

    def make():
        cuts = load()
        n = write_cuts(speed_perturbed(cuts, factors) if factors else cuts, out)
        log.info("%d cuts -> %s", n, out)

    make_unless_done([out], made_from, make)


def make_shuffled_cuts(parts: Sequence[Path], out: Path, *, seed: int, hint: str) -> None:
    """``out``: the cuts of ``parts`` in one seeded random order (:func:`~asrprec.data.manifests.shuffle_manifests`)."""
    from .manifests import shuffle_manifests

    made_from = {"parts": input_digests(parts, hint), "seed": seed}
    make_unless_done([out], made_from, lambda: shuffle_manifests(parts, out, seed=seed))


def make_fbank(source: Path, storage: Path, out: Path, *, chunk_size: int, num_jobs: int, max_bad_audio: int,
               hint: str) -> None:
    """``out``: the cuts of ``source`` with 80-dim fbank in ``storage`` (:func:`~asrprec.data.features.
    compute_fbank_lazy`, resumed by chunk); cuts whose audio cannot be read are named and left out, up to
    ``max_bad_audio``."""
    from .features import compute_fbank_lazy
    from .manifests import load_cuts

    cuts = load_cuts(source, hint=hint)
    compute_fbank_lazy(cuts, storage, out, chunk_size=chunk_size, num_jobs=num_jobs, max_unreadable=max_bad_audio,
                       made_from={"cuts": input_digests([source], hint)})


def train_tokenizer(texts: list[str], model: Path, vocab_size: int, *, model_type: str, stage: str) -> Any:
    """The sentencepiece model ``model`` (``<folder>/bpe.model``) trained on ``texts`` (reused when trained on the
    same texts and settings); a vocabulary the texts cannot fill is a CorpusError naming ``--vocab-size``."""
    from asrprec.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.train(texts, Path(model).with_suffix(""), vocab_size, model_type=model_type)
    except ValueError as e:
        why = str(e).split("; fix:")[0]  # the tokenizer's own fix names its Python argument
        raise CorpusError(f"{stage}: {why}. Fix: a smaller --vocab-size for prepare.py, and the same --vocab-size "
                          "for train.py and decode.py") from None
    log.info("tokenizer: %s", tokenizer)
    return tokenizer


def run_stages(stages: Sequence[Callable[[Any, Any], None]], args: Any, data: Any, start: int, stop: int) -> None:
    """Run ``stages[start..stop]`` (a recipe's ``--stage`` / ``--stop-stage``) in order, each as ``stage(args, data)``,
    logging its name and time."""
    import time

    for i, stage in enumerate(stages):
        if start <= i <= stop:
            began = time.perf_counter()
            logging.info("stage %d: %s", i, stage.__name__.removeprefix("stage_"))
            stage(args, data)
            logging.info("stage %d done in %.1f s", i, time.perf_counter() - began)
