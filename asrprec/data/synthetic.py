"""A synthetic English speech corpus spoken by espeak-ng, written as lhotse manifests.

The task: spoken digit strings ("THREE ONE FOUR") and short sentences from a fixed grammar
("THE SMALL DOG FINDS A GREEN BOX NOW"); 48 words, 0.5–4 s per utterance (median 1.7 s). Learnable by a tiny
transducer in minutes on a CPU, yet not trivial: speakers of dev and test are never heard in training, and
speakers differ by accent, variant, vocal-tract length, pitch, range and rate.

* Speakers: each split draws its own espeak voices ``<accent>+<variant>`` (8 English accents × 31 variants,
  disjoint between splits) and gives each one a vocal-tract scale, base pitch, pitch range and speaking rate,
  all drawn from the seed (``train_speakers_per_voice`` > 1: that many training speakers per training voice,
  the utterance's speaker drawn among them; the held-out splits keep one per voice). The vocal-tract scale α
  (``vtl_range``) plays espeak's 22,050 Hz output as if it had been recorded at 22,050·α Hz, which moves every
  formant and the pitch by α (the warp behind VTLP and speed perturbation); espeak is asked for the rate
  divided by α, so the heard rate is the planned one. So a new seed brings speakers no earlier seed had, even
  on a voice it shares.
* Rates (words per minute as heard): train, dev and test speakers draw a base rate from ``rate_wpm``; the
  ``test-fast`` split's speakers (voices of their own) draw theirs from ``fast_rate_wpm``, so that every one
  of its utterances is faster than any other split's (checked by :class:`CorpusConfig`). Each utterance then
  varies its speaker's rate by ``rate_jitter``.
* ``test-names`` (the test voices, drawn anew): sentences of which about half (``name_prob``) begin with a name
  from :data:`NAMES`, words no other split says, for measuring hot-phrase boosting on words a model never heard.
  With ``train_name_count`` > 0, each name also begins that many training sentences (boosting words a model
  heard only a few times).
* Audio: espeak's 22,050 Hz resampled to 16 kHz (:mod:`asrprec.data.resample`), levelled to a
  random loudness, optionally reverberated (synthetic exponential RIR) and noised at an SNR
  (:mod:`asrprec.data.augment`); written as 16-bit FLAC.
* Determinism: every random choice is drawn in the parent from ``seed``; espeak's noise generator
  is seeded before each utterance; and because espeak's output also depends on what its process
  spoke before, utterances are synthesised in fixed shards of ``shard_size``, each in a fresh
  Python process (``python -m asrprec.data.synthetic`` reading its shard as JSON on stdin; up to
  ``num_workers`` at a time). The corpus is therefore bit-exact for a seed whatever ``num_workers``
  is. A plain subprocess rather than a multiprocessing spawn pool, because spawn re-imports the
  caller's ``__main__`` (e.g. a recipe script importing torch) in every shard's process.
* Word times: each supervision holds every word's start and end in its audio (lhotse's
  ``alignment={"word": [AlignmentItem(symbol, start, duration), ...]}``), read from espeak's phoneme events
  (:mod:`asrprec.data.espeak`: a word spans from espeak's word event to the pause or word after it). They hold
  for the written audio: resampling keeps times (its delay is compensated), levelling and noise move nothing,
  the synthetic room response has its direct path at lag 0, and nothing is padded before the speech.
  Recording them changes no random draw and no sample. A corpus generated before they were recorded has none;
  ``generate_corpus(..., force=True)`` rewrites it with the same audio.
* Idempotent: :func:`generate_corpus` returns the stored manifests when ``corpus.json`` in the
  output folder records the same configuration, and regenerates otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asrprec._optional import require
from asrprec.atomic import atomic_path, atomic_write_text
from asrprec.data.espeak import ESPEAK_SAMPLE_RATE

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
SPLITS = ("train", "dev", "test", "test-fast", "test-names")
CORPUS_VERSION = 2  # bump when the generator changes what a given config produces
VTL_STEP_HZ = 50  # the vocal-tract warp is quantised to 50 Hz steps of the source rate (a short polyphase filter)

DIGITS = ("ZERO", "ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE")
# The sentence grammar avoids homophones of the digit words (to/too/for/won/ate) and of each other.
DETERMINERS = ("THE", "A")  # "A" becomes "AN" before a vowel
ADJECTIVES = ("BIG", "SMALL", "RED", "GREEN", "BLUE", "BLACK", "WHITE", "OLD", "NEW", "HAPPY")
NOUNS = ("CAT", "DOG", "BIRD", "FISH", "BOX", "CAR", "BALL", "HOUSE", "TREE", "BOOK", "CUP", "HAT")
VERBS = ("SEES", "FINDS", "LIKES", "WANTS", "TAKES", "HOLDS", "PUSHES", "MOVES")
ADVERBS = ("NOW", "TODAY", "QUICKLY", "SLOWLY", "AGAIN")
WORDS = DIGITS + DETERMINERS + ("AN",) + ADJECTIVES + NOUNS + VERBS + ADVERBS
# Names no other split says: the test-names split puts one in about half its sentences (hot-phrase boosting's test).
NAMES = ("ALICE", "OSCAR", "MARTHA", "VICTOR", "HELEN", "RUPERT")

ACCENTS = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
VARIANTS = (
    tuple(f"m{i}" for i in range(1, 9))
    + tuple(f"f{i}" for i in range(1, 6))
    + ("klatt", "klatt2", "klatt3", "klatt4", "klatt5", "klatt6")
    + ("adam", "benjamin", "david", "ed", "john", "linda", "paul", "robert", "steph", "travis", "michael", "belinda")
)


@dataclass(frozen=True)
class CorpusConfig:
    """Everything that determines the corpus' content (``num_workers`` does not)."""

    num_train: int = 2500
    num_dev: int = 200
    num_test: int = 200
    num_test_fast: int = 0
    num_test_names: int = 0
    name_prob: float = 0.5  # share of test-names sentences that hold a name
    train_name_count: int = 0  # training sentences that begin with each name (module doc)
    seed: int = 0
    num_dev_speakers: int = 20
    num_test_speakers: int = 20
    num_test_fast_speakers: int = 20
    digit_prob: float = 0.5  # share of digit strings; the rest are sentences
    min_digits: int = 3
    max_digits: int = 7
    rate_wpm: tuple[int, int] = (120, 250)  # base speaking rate range of train, dev and test speakers
    fast_rate_wpm: tuple[int, int] = (310, 350)  # the test-fast speakers' base rate range
    rate_jitter: float = 0.1  # each utterance's rate: its speaker's times U(1 - jitter, 1 + jitter)
    vtl_range: tuple[float, float] = (0.88, 1.12)  # speaker vocal-tract scale α (module doc)
    train_speakers_per_voice: int = 1  # training speakers drawn per training voice (module doc)
    snr_db: tuple[float, float] | None = None  # additive noise SNR range, None = clean
    noise_prob: float = 1.0  # with snr_db set: share of utterances that get noise
    reverb_prob: float = 0.0
    rt60_s: tuple[float, float] = (0.15, 0.6)
    shard_size: int = 100
    version: int = CORPUS_VERSION

    def __post_init__(self) -> None:
        if int(self.train_speakers_per_voice) < 1:
            raise ValueError(f"train_speakers_per_voice must be >= 1, got {self.train_speakers_per_voice}")
        for name in ("num_train", "num_dev", "num_test", "num_test_fast", "num_test_names", "train_name_count"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        n_voices = len(ACCENTS) * len(VARIANTS)
        held_out = self.num_dev_speakers + self.num_test_speakers + self.num_test_fast_speakers
        if min(self.num_dev_speakers, self.num_test_speakers, self.num_test_fast_speakers) < 1 or held_out >= n_voices:
            raise ValueError(
                f"num_dev_speakers + num_test_speakers + num_test_fast_speakers must each be >= 1 and sum to less than "
                f"{n_voices} (there are {n_voices} voices), got {self.num_dev_speakers} + {self.num_test_speakers} + "
                f"{self.num_test_fast_speakers}"
            )
        if not 0.0 <= self.rate_jitter < 1.0:
            raise ValueError(f"rate_jitter must be in [0, 1), got {self.rate_jitter}")
        for name in ("rate_wpm", "fast_rate_wpm"):
            low, high = getattr(self, name)
            if not 80 <= low <= high:
                raise ValueError(f"{name} must be a (low, high) pair with 80 <= low <= high (espeak's slowest is 80), "
                                 f"got {getattr(self, name)}")
        if self.fast_rate_wpm[0] * (1 - self.rate_jitter) <= self.rate_wpm[1] * (1 + self.rate_jitter):
            raise ValueError(
                f"test-fast must be faster than every other utterance: fast_rate_wpm[0] x (1 - rate_jitter) = "
                f"{self.fast_rate_wpm[0] * (1 - self.rate_jitter):g} is not above rate_wpm[1] x (1 + rate_jitter) = "
                f"{self.rate_wpm[1] * (1 + self.rate_jitter):g}; raise fast_rate_wpm or lower rate_wpm / rate_jitter")
        if not 0.5 <= self.vtl_range[0] <= self.vtl_range[1] <= 2.0:
            raise ValueError(f"vtl_range must be a (low, high) pair within [0.5, 2], got {self.vtl_range}")
        if self.snr_db is not None and (len(self.snr_db) != 2 or self.snr_db[0] > self.snr_db[1]):
            raise ValueError(f"snr_db must be None or a (low, high) pair with low <= high, got {self.snr_db}")
        for name in ("digit_prob", "noise_prob", "reverb_prob", "name_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # the corpus.json of folders made before these fields existed still matches
        if not d["train_name_count"]:
            del d["train_name_count"]
        if d["train_speakers_per_voice"] == 1:
            del d["train_speakers_per_voice"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


# ----------------------------------------------------------------------------------------------
# Plan: every random decision, made in the parent from the seed


def random_text(rng: np.random.Generator, cfg: CorpusConfig, *, names: bool = False) -> str:
    """One transcript (upper-case words from :data:`WORDS`; with ``names``, a sentence whose first noun phrase is
    one of :data:`NAMES` with probability ``cfg.name_prob``)."""
    if names:
        text = random_text(rng, dataclasses.replace(cfg, digit_prob=0.0))
        if rng.random() < cfg.name_prob:
            text = _with_name(text, NAMES[rng.integers(len(NAMES))])
        return text
    if rng.random() < cfg.digit_prob:
        n = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
        return " ".join(DIGITS[i] for i in rng.integers(0, 10, n))

    def noun_phrase() -> list[str]:
        det = DETERMINERS[rng.integers(len(DETERMINERS))]
        words = [ADJECTIVES[rng.integers(len(ADJECTIVES))]] if rng.random() < 0.6 else []
        words.append(NOUNS[rng.integers(len(NOUNS))])
        if det == "A" and words[0][0] in "AEIOU":
            det = "AN"
        return [det] + words

    words = noun_phrase() + [VERBS[rng.integers(len(VERBS))]] + noun_phrase()
    if rng.random() < 0.3:
        words.append(ADVERBS[rng.integers(len(ADVERBS))])
    return " ".join(words)


def _with_name(sentence: str, name: str) -> str:
    """The sentence with ``name`` in place of its first noun phrase (the words before its verb)."""
    words = sentence.split()
    verb = next(i for i, w in enumerate(words) if w in VERBS)
    return " ".join([name] + words[verb:])


def _names_in_train(plan: list[dict[str, Any]], cfg: CorpusConfig) -> None:
    """Begin ``cfg.train_name_count`` training sentences with each of :data:`NAMES` (chosen by their own generator:
    every other utterance stays as planned)."""
    sentences = [s for s in plan if s["split"] == "train" and any(w in VERBS for w in s["text"].split())]
    wanted = cfg.train_name_count * len(NAMES)
    if wanted > len(sentences):
        raise ValueError(f"train_name_count={cfg.train_name_count} needs {wanted} training sentences, the corpus "
                         f"plans {len(sentences)}; fix: a smaller train_name_count or a larger num_train")
    picked = np.random.default_rng([cfg.seed, 3]).choice(len(sentences), size=wanted, replace=False)
    for k, i in enumerate(picked.tolist()):
        sentences[i]["text"] = _with_name(sentences[i]["text"], NAMES[k % len(NAMES)])


def speaker_split(seed: int, num_dev: int, num_test: int, num_test_fast: int = 0) -> dict[str, list[str]]:
    """Disjoint voice names (``"<accent>+<variant>"``) per split, a seeded permutation of all voices."""
    voices = [f"{a}+{v}" for a in ACCENTS for v in VARIANTS]
    order = np.random.default_rng([seed, 1]).permutation(len(voices))
    voices = [voices[i] for i in order]
    ends = np.cumsum([num_dev, num_test, num_test_fast])
    return {"dev": voices[: ends[0]], "test": voices[ends[0] : ends[1]], "test-fast": voices[ends[1] : ends[2]],
            "test-names": voices[ends[0] : ends[1]], "train": voices[ends[2] :]}


def _speaker_id(voice: str) -> str:
    return voice.replace("+", "_")


def _draw_speaker(rng: np.random.Generator, vtl_steps: list[int], rate_range: tuple[int, int]) -> tuple[int, ...]:
    """One speaker's source rate of the vocal-tract warp, base pitch, pitch range and base rate."""
    source_hz = ESPEAK_SAMPLE_RATE + VTL_STEP_HZ * int(rng.integers(vtl_steps[0], vtl_steps[1] + 1))
    return (source_hz, int(rng.integers(25, 76)), int(rng.integers(25, 81)),
            int(rng.integers(rate_range[0], rate_range[1] + 1)))


def plan_corpus(cfg: CorpusConfig) -> list[dict[str, Any]]:
    """The specification of every utterance (text, voice, prosody, augmentation, seeds), in corpus order."""
    speakers = speaker_split(cfg.seed, cfg.num_dev_speakers, cfg.num_test_speakers, cfg.num_test_fast_speakers)
    vtl_steps = [round(ESPEAK_SAMPLE_RATE * (a - 1.0) / VTL_STEP_HZ) for a in cfg.vtl_range]
    plan: list[dict[str, Any]] = []
    for split_idx, split in enumerate(SPLITS):
        rng = np.random.default_rng([cfg.seed, 2, split_idx])
        voices = speakers[split]
        rate_range = cfg.fast_rate_wpm if split == "test-fast" else cfg.rate_wpm
        # each speaker's own settings: source rate of the vocal-tract warp, pitch, pitch range, base rate
        speaker = {}
        for v in voices:
            speaker[v] = [_draw_speaker(rng, vtl_steps, rate_range)]
        # further training speakers come from a stream of their own: the first speaker of each voice, and every
        # other draw of the corpus, stay what they are with one speaker per voice
        extra_rng = np.random.default_rng([cfg.seed, 3])
        if split == "train" and cfg.train_speakers_per_voice > 1:
            for v in voices:
                speaker[v] += [_draw_speaker(extra_rng, vtl_steps, rate_range)
                               for _ in range(cfg.train_speakers_per_voice - 1)]
        num = {"train": cfg.num_train, "dev": cfg.num_dev, "test": cfg.num_test, "test-fast": cfg.num_test_fast,
               "test-names": cfg.num_test_names}[split]
        for i in range(num):
            voice = voices[int(rng.integers(len(voices)))]
            drawn = speaker[voice]
            source_hz, pitch, prange, rate = drawn[int(extra_rng.integers(len(drawn)))] if len(drawn) > 1 else drawn[0]
            rate = int(round(rate * rng.uniform(1.0 - cfg.rate_jitter, 1.0 + cfg.rate_jitter)))
            speaker_id = f"{_speaker_id(voice)}_{source_hz}"
            spec = {
                "id": f"{split}-{speaker_id}-{i:06d}",
                "split": split,
                "speaker": speaker_id,
                "voice": voice,
                "text": random_text(rng, cfg, names=split == "test-names"),
                "rate": rate,  # as heard
                "source_hz": source_hz,  # espeak's output is played as if recorded at this rate
                "espeak_rate": max(80, int(round(rate * ESPEAK_SAMPLE_RATE / source_hz))),
                "pitch": int(np.clip(pitch + rng.integers(-5, 6), 0, 100)),
                "range": prange,
                "word_gap": int(rng.integers(1, 4)) if rng.random() < 0.3 else 0,
                "level_db": float(rng.uniform(-28.0, -18.0)),  # RMS level in dBFS
                "espeak_seed": int(rng.integers(1, 2**31 - 1)),
                "aug_seed": int(rng.integers(0, 2**63 - 1)),
                "snr_db": None,
                "noise_color": None,
                "rt60_s": None,
                "drr_db": None,
            }
            if cfg.snr_db is not None and rng.random() < cfg.noise_prob:
                spec["snr_db"] = float(rng.uniform(*cfg.snr_db))
                spec["noise_color"] = "white" if rng.random() < 0.5 else "pink"
            if rng.random() < cfg.reverb_prob:
                spec["rt60_s"] = float(rng.uniform(*cfg.rt60_s))
                spec["drr_db"] = float(rng.uniform(0.0, 8.0))
            plan.append(spec)
    if cfg.train_name_count:
        _names_in_train(plan, cfg)
    return plan


# ----------------------------------------------------------------------------------------------
# Synthesis (runs in fresh worker processes: imports only numpy, soundfile and the ctypes binding)


def render_utterance(spec: dict[str, Any]) -> np.ndarray:
    """Synthesise one planned utterance: (N,) float64 at 16 kHz in [-1, 1]."""
    return render_aligned_utterance(spec)[0]


def render_aligned_utterance(spec: dict[str, Any]) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """:func:`render_utterance` and its words' ``(WORD, start s, end s)`` in that audio, within ``[0, N / 16000]``
    (:mod:`asrprec.data.espeak` says how they are read); ``[]`` when espeak spoke a different number of words than
    the text has (none seen; the caller counts them)."""
    from asrprec.data.augment import add_noise, reverberate, synthetic_rir
    from asrprec.data.espeak import Espeak
    from asrprec.data.resample import resample_poly

    utt = Espeak.get().synthesize(
        spec["text"].lower(),  # espeak reads a lone capital "A" as the letter name
        voice=spec["voice"],
        rate=spec["espeak_rate"],
        pitch=spec["pitch"],
        pitch_range=spec["range"],
        word_gap=spec["word_gap"],
        seed=spec["espeak_seed"],
    )
    if len(utt.samples) == 0:
        raise RuntimeError(f"espeak produced no audio for {spec['id']} ({spec['text']!r}, voice {spec['voice']})")
    # the vocal-tract warp: espeak's samples played at source_hz (times scale by ESPEAK_SAMPLE_RATE / source_hz)
    y = resample_poly(utt.samples.astype(np.float64) / 32768.0, spec["source_hz"], SAMPLE_RATE)
    warp = ESPEAK_SAMPLE_RATE / spec["source_hz"]
    rng = np.random.default_rng(spec["aug_seed"])
    if spec["rt60_s"] is not None:
        y = reverberate(y, synthetic_rir(spec["rt60_s"], SAMPLE_RATE, rng, direct_to_reverb_db=spec["drr_db"]))
    rms = float(np.sqrt(np.mean(y**2)))
    if rms > 0:
        y *= 10.0 ** (spec["level_db"] / 20.0) / rms
    if spec["snr_db"] is not None:
        y = add_noise(y, spec["snr_db"], rng, color=spec["noise_color"])
    peak = float(np.max(np.abs(y)))
    if peak > 0.99:
        y *= 0.99 / peak
    words = spec["text"].split()
    end_s = len(y) / SAMPLE_RATE
    if len(utt.word_spans_s) != len(words):
        return y, []
    return y, [(w, min(a * warp, end_s), min(b * warp, end_s)) for w, (a, b) in zip(words, utt.word_spans_s)]


def _synth_shard(audio_dir: str, specs: list[dict[str, Any]]) -> tuple[list[tuple[str, int]], float, dict]:
    import soundfile as sf

    cpu_start = time.process_time()
    out, words = [], {}
    for spec in specs:
        y, words[spec["id"]] = render_aligned_utterance(spec)
        path = Path(audio_dir) / spec["split"] / f"{spec['id']}.flac"
        sf.write(str(path), y.astype(np.float32), SAMPLE_RATE, subtype="PCM_16", format="FLAC")
        out.append((spec["id"], len(y)))
    return out, time.process_time() - cpu_start, words


def _run_shard_process(audio_dir: Path, shard: list[dict[str, Any]]) -> tuple[list[tuple[str, int]], float, dict]:
    """Synthesise one shard in a fresh interpreter (see the module doc for why)."""
    import asrprec

    root = str(Path(asrprec.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("OMP_NUM_THREADS", "1")
    job = json.dumps({"audio_dir": str(audio_dir), "specs": shard})
    proc = subprocess.run(
        [sys.executable, "-m", "asrprec.data.synthetic"], input=job, capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"synthesis of shard starting at {shard[0]['id']} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return [tuple(r) for r in out["num_samples"]], float(out["cpu_s"]), out["words"]


def _synthesize_all(plan: list[dict[str, Any]], audio_dir: Path, shard_size: int, num_workers: int,
                    words: dict[str, list] | None = None) -> dict[str, int]:
    """Synthesise every shard; returns ``{id: num_samples}`` and fills ``words`` with ``{id: [(word, start, end)]}``."""
    for split in SPLITS:
        (audio_dir / split).mkdir(parents=True, exist_ok=True)
    shards = [plan[i : i + shard_size] for i in range(0, len(plan), shard_size)]
    num_samples: dict[str, int] = {}
    cpu_s = 0.0
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(num_workers, len(shards)))) as pool:
        futures = [pool.submit(_run_shard_process, audio_dir, shard) for shard in shards]
        for k, fut in enumerate(futures, 1):
            try:
                res, shard_cpu_s, shard_words = fut.result()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # don't start the remaining shards
                raise
            num_samples.update(res)
            if words is not None:
                words.update(shard_words)
            cpu_s += shard_cpu_s
            if k % 10 == 0 or k == len(shards):
                log.info("synthesised %d/%d shards (%.1f s)", k, len(shards), time.perf_counter() - start)
    log.info(
        "synthesis: %d utterances, %.1f s wall, %.1f CPU-s in workers (%.1f ms per utterance)",
        len(plan), time.perf_counter() - start, cpu_s, 1000 * cpu_s / max(1, len(plan)),
    )
    return num_samples


# ----------------------------------------------------------------------------------------------
# Manifests


def manifest_paths(out_dir: Path | str, split: str) -> dict[str, Path]:
    out_dir = Path(out_dir)
    return {kind: out_dir / f"espeak_{kind}_{split}.jsonl.gz" for kind in ("recordings", "supervisions", "cuts")}


def _word_alignment(words: list) -> dict | None:
    from lhotse.supervision import AlignmentItem

    if not words:
        return None
    return {"word": [AlignmentItem(symbol=w, start=round(a, 4), duration=round(b - a, 4)) for w, a, b in words]}


def _write_manifests(plan: list[dict[str, Any]], num_samples: dict[str, int], out_dir: Path, audio_dir: Path,
                     words: dict[str, list] | None = None) -> dict:
    lhotse = require("lhotse")
    from lhotse.audio import AudioSource

    words = words or {}
    unaligned = [s["id"] for s in plan if not words.get(s["id"])]
    if unaligned:
        log.warning("%d utterances have no word alignment (espeak spoke another number of words than their text "
                    "has), e.g. %s", len(unaligned), unaligned[:3])

    result = {}
    for split in SPLITS:
        recs, sups = [], []
        for spec in (s for s in plan if s["split"] == split):
            n = num_samples[spec["id"]]
            path = (audio_dir / split / f"{spec['id']}.flac").resolve()
            recs.append(
                lhotse.Recording(
                    id=spec["id"],
                    sources=[AudioSource(type="file", channels=[0], source=str(path))],
                    sampling_rate=SAMPLE_RATE,
                    num_samples=n,
                    duration=n / SAMPLE_RATE,
                )
            )
            custom = {k: spec[k] for k in ("voice", "source_hz", "rate", "pitch", "range", "word_gap", "snr_db", "rt60_s")}
            sups.append(
                lhotse.SupervisionSegment(
                    id=spec["id"],
                    recording_id=spec["id"],
                    start=0.0,
                    duration=n / SAMPLE_RATE,
                    channel=0,
                    text=spec["text"],
                    language="English",
                    speaker=spec["speaker"],
                    custom=custom,
                    alignment=_word_alignment(words.get(spec["id"], [])),
                )
            )
        recordings = lhotse.RecordingSet.from_recordings(recs)
        supervisions = lhotse.SupervisionSet.from_segments(sups)
        cuts = lhotse.CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
        cuts = cuts.modify_ids(lambda cut_id: cut_id.rsplit("-", 1)[0])  # lhotse appends "-0": keep the utterance id
        paths = manifest_paths(out_dir, split)
        for manifest, key in ((recordings, "recordings"), (supervisions, "supervisions"), (cuts, "cuts")):
            with atomic_path(paths[key]) as tmp:
                manifest.to_file(tmp)
        result[split] = cuts
    return result


def load_corpus(out_dir: Path | str) -> dict:
    """The stored CutSets of a generated corpus, ``{"train": CutSet, "dev": ..., "test": ..., "test-fast": ...}``."""
    lhotse = require("lhotse")
    out = {}
    for split in SPLITS:
        path = manifest_paths(out_dir, split)["cuts"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; generate the corpus first with asrprec.data.generate_corpus({str(out_dir)!r})")
        cuts = lhotse.CutSet.from_file(path)
        out[split] = lhotse.CutSet.from_cuts([]) if cuts is None else cuts.to_eager()  # None: an empty split
    return out


def generate_corpus(
    out_dir: Path | str,
    *,
    num_train: int = 2500,
    num_dev: int = 200,
    num_test: int = 200,
    num_test_fast: int = 0,
    num_test_names: int = 0,
    seed: int = 0,
    num_workers: int = 2,
    snr_db: tuple[float, float] | None = None,
    reverb_prob: float = 0.0,
    force: bool = False,
    **options: Any,
) -> dict:
    """Synthesise the corpus into ``out_dir`` and return ``{split: CutSet}`` for :data:`SPLITS` (``test-fast`` and
    ``test-names`` are empty unless ``num_test_fast`` / ``num_test_names``).

    Writes ``audio/<split>/<id>.flac`` (16 kHz, 16-bit), ``espeak_{recordings,supervisions,cuts}_<split>.jsonl.gz``
    and ``corpus.json`` (the configuration, written last). If ``corpus.json`` already records the same
    configuration the stored manifests are returned without synthesising anything (unless ``force``).
    Further ``options`` are :class:`CorpusConfig` fields (e.g. ``noise_prob``, ``shard_size``).
    Needs the optional ``espeakng-loader`` package (``pip install 'asrprec[synth]'``).
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(CorpusConfig)}
    if unknown:
        raise TypeError(f"generate_corpus got unknown options {sorted(unknown)}; valid: {[f.name for f in dataclasses.fields(CorpusConfig)]}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1 (synthesis always runs in fresh worker processes), got {num_workers}")
    if snr_db is not None:
        snr_db = (float(snr_db[0]), float(snr_db[1]))
    cfg = CorpusConfig(
        num_train=num_train, num_dev=num_dev, num_test=num_test, num_test_fast=num_test_fast,
        num_test_names=num_test_names, seed=seed, snr_db=snr_db, reverb_prob=reverb_prob, **options
    )
    out_dir = Path(out_dir)
    marker = out_dir / "corpus.json"
    if not force and marker.is_file():
        try:
            stored = json.loads(marker.read_text())
        except json.JSONDecodeError:
            stored = None
        if stored == cfg.to_json() and all(manifest_paths(out_dir, s)["cuts"].is_file() for s in SPLITS):
            log.info("corpus in %s is up to date (%s); not regenerating", out_dir, marker)
            return load_corpus(out_dir)
        log.info("corpus in %s was made with a different configuration; regenerating", out_dir)
    require("espeakng_loader")  # fail early, in the parent, with the install hint
    audio_dir = out_dir / "audio"
    if marker.is_file() and audio_dir.is_dir():
        shutil.rmtree(audio_dir)  # our own stale audio; `corpus.json` marks the folder as ours
        marker.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    plan = plan_corpus(cfg)
    words: dict[str, list] = {}
    num_samples = _synthesize_all(plan, audio_dir, cfg.shard_size, num_workers, words)
    cuts = _write_manifests(plan, num_samples, out_dir, audio_dir, words)
    atomic_write_text(marker, json.dumps(cfg.to_json(), indent=1, sort_keys=True))
    hours = sum(num_samples.values()) / SAMPLE_RATE / 3600
    log.info(
        "generated %d utterances (%.2f h of audio) in %s in %.1f s with %d workers",
        len(plan), hours, out_dir, time.perf_counter() - start, num_workers,
    )
    return cuts


if __name__ == "__main__":  # a shard worker: JSON job on stdin, JSON result on the last line of stdout
    _job = json.loads(sys.stdin.read())
    _res, _cpu, _words = _synth_shard(_job["audio_dir"], _job["specs"])
    print(json.dumps({"num_samples": _res, "cpu_s": _cpu, "words": _words}))
