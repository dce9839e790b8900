"""A minimal ctypes binding to libespeak-ng (shipped by the optional ``espeakng-loader`` wheel).

Only what the synthetic corpus needs: initialise in synchronous mode (22,050 Hz, 16-bit mono
PCM delivered to a callback), pick a voice by name (``"en-us+m3"``), set rate / pitch / range /
word gap, seed the noise generator, and synthesise one utterance into memory together with each
word's start and end, read from espeak's events.

Word times: espeak reports an event where each word begins and, with phoneme events switched on
(``espeakINITIALIZE_PHONEME_EVENTS``, which changes no sample of the audio), an event where each
phoneme begins, pauses included (phonemes named ``_``, ``_:``, ...); each event carries the sample it
starts at. A word spans from its word event to the first pause after one of its spoken phonemes, or
to the next word's event, or to the end of the audio: the silence espeak puts between words belongs
to no word. Word events rather than first phonemes mark starts because espeak reports a word's first
phoneme up to ~50 ms into its sound (measured against the audio's energy in
``tests/data/test_word_alignment.py``).

This module imports only numpy and ctypes so that the spawn workers of the corpus generator start
fast; the C header it follows is espeak-ng ``src/include/espeak-ng/speak_lib.h``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from asrprec._optional import require

ESPEAK_SAMPLE_RATE = 22050

# speak_lib.h enums
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_EVENT_LIST_TERMINATED = 0
_EVENT_WORD = 1
_EVENT_END = 5
_EVENT_MSG_TERMINATED = 6
_EVENT_PHONEME = 7
_INITIALIZE_PHONEME_EVENTS = 0x0001
_PARAM = {"rate": 1, "volume": 2, "pitch": 3, "range": 4, "wordgap": 7}


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),  # milliseconds from the start of the utterance
        ("sample", ctypes.c_int),  # the sample the event starts at, from the start of the utterance
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass(frozen=True)
class Utterance:
    """One synthesised utterance: 16-bit PCM at :data:`ESPEAK_SAMPLE_RATE` and its words' times.

    ``samples``: (N,) int16. ``word_starts_s``: the time in seconds of each word event espeak sent, in
    text order (may be empty for an empty text). ``word_spans_s``: each word's (start, end) in
    seconds (module docstring).
    """

    samples: np.ndarray
    word_starts_s: tuple[float, ...]
    word_spans_s: tuple[tuple[float, float], ...] = ()


def word_spans_from_events(events: list[tuple[int, int, str]], num_samples: int) -> list[tuple[int, int]]:
    """Each word's (start sample, end sample) from espeak's events in order: ``(type, sample, phoneme)``
    with type 1 (word), 7 (phoneme; ``phoneme`` its name) or 5 / 6 (end); spans within ``[0, num_samples]``."""
    words: list[list[int]] = []  # [start, end]
    open_word = None  # the word whose spoken phonemes run until the next pause, word or end
    for kind, sample, name in events:
        pause = kind == _EVENT_PHONEME and name.startswith("_")
        if open_word is not None and (kind in (_EVENT_WORD, _EVENT_END, _EVENT_MSG_TERMINATED) or pause):
            open_word[1] = sample
            open_word = None
        if kind == _EVENT_WORD:
            words.append([sample, sample])
        elif kind == _EVENT_PHONEME and words and not pause:
            open_word = words[-1]
    if open_word is not None:
        open_word[1] = num_samples
    return [(min(a, num_samples), min(max(a, b), num_samples)) for a, b in words]


class Espeak:
    """A process-wide espeak-ng engine (the C library has global state: create one per process)."""

    _instance: "Espeak | None" = None

    def __init__(self) -> None:
        loader = require("espeakng_loader")
        self._lib = ctypes.CDLL(loader.get_library_path())
        lib = self._lib
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_ng_SetRandSeed.restype = None
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_uint),
            ctypes.c_void_p,
        ]
        lib.espeak_Synchronize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]

        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, loader.get_data_path().encode(),
                                     _INITIALIZE_PHONEME_EVENTS)
        if rate != ESPEAK_SAMPLE_RATE:
            raise RuntimeError(
                f"espeak_Initialize returned {rate} (expected {ESPEAK_SAMPLE_RATE} Hz); the espeak-ng data in "
                f"{loader.get_data_path()} may be missing or corrupt. Fix: pip install --force-reinstall espeakng-loader"
            )
        self._chunks: list[np.ndarray] = []
        self._words_ms: list[int] = []
        self._events: list[tuple[int, int, str]] = []
        self._cb = _CALLBACK(self._on_audio)  # keep a reference: ctypes must not free the thunk
        lib.espeak_SetSynthCallback(self._cb)
        self._voice: str | None = None

    @classmethod
    def get(cls) -> "Espeak":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _on_audio(self, wav, num_samples, events) -> int:
        if num_samples > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
        i = 0
        while events[i].type != _EVENT_LIST_TERMINATED:
            ev = events[i]
            if ev.type == _EVENT_WORD:
                self._words_ms.append(int(ev.audio_position))
            if ev.type in (_EVENT_WORD, _EVENT_END, _EVENT_MSG_TERMINATED):
                self._events.append((int(ev.type), int(ev.sample), ""))
            elif ev.type == _EVENT_PHONEME:
                name = ev.id.string.split(b"\0", 1)[0].decode("ascii", "replace")
                self._events.append((_EVENT_PHONEME, int(ev.sample), name))
            i += 1
        return 0  # 0 = continue synthesis

    def set_voice(self, name: str) -> None:
        if name != self._voice:
            if self._lib.espeak_SetVoiceByName(name.encode()) != 0:
                raise ValueError(f"espeak-ng has no voice {name!r}; use '<language>+<variant>', e.g. 'en-us+m3'")
            self._voice = name

    def synthesize(
        self,
        text: str,
        *,
        voice: str = "en-us",
        rate: int = 175,
        pitch: int = 50,
        pitch_range: int = 50,
        word_gap: int = 0,
        seed: int = 0,
    ) -> Utterance:
        """Speak ``text`` (words, not numerals) and return 22,050 Hz int16 PCM and its words' times.

        ``rate`` words per minute (80–450), ``pitch`` and ``pitch_range`` 0–100 (espeak's scale),
        ``word_gap`` extra pause between words in units of 10 ms, ``seed`` seeds espeak's noise generator.
        """
        self.set_voice(voice)
        for key, value in (("rate", rate), ("pitch", pitch), ("range", pitch_range), ("wordgap", word_gap)):
            self._lib.espeak_SetParameter(_PARAM[key], int(value), 0)
        self._lib.espeak_ng_SetRandSeed(int(seed) & 0x7FFFFFFF)
        self._chunks, self._words_ms, self._events = [], [], []
        data = text.encode("utf-8") + b"\0"
        buf = ctypes.create_string_buffer(data, len(data))
        err = self._lib.espeak_Synth(buf, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed with status {err} for text {text!r}")
        self._lib.espeak_Synchronize()
        samples = np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.int16)
        spans = word_spans_from_events(self._events, len(samples))
        return Utterance(samples.astype(np.int16, copy=False), tuple(ms / 1000.0 for ms in self._words_ms),
                         tuple((a / ESPEAK_SAMPLE_RATE, b / ESPEAK_SAMPLE_RATE) for a, b in spans))
