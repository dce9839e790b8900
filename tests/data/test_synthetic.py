"""The espeak-ng corpus generator: determinism, disjoint speakers, valid manifests, errors."""

import dataclasses
import itertools
import json

import numpy as np
import pytest
import soundfile as sf

from asrprec.data import synthetic
from asrprec.data.synthetic import WORDS, CorpusConfig, generate_corpus, plan_corpus, random_text, speaker_split

from .conftest import TINY, needs_espeak


def _audio_by_id(cuts):
    return {c.id: (c.supervisions[0].text, c.load_audio()) for split in cuts.values() for c in split}


@needs_espeak
def test_same_seed_same_audio_in_fresh_processes(tiny_corpus, tmp_path):
    # The fixture used 2 workers; 1 worker must give bit-identical audio (shards run in fresh processes).
    out_a, cuts_a = tiny_corpus
    cuts_b = generate_corpus(tmp_path, num_workers=1, **TINY)
    a, b = _audio_by_id(cuts_a), _audio_by_id(cuts_b)
    assert a.keys() == b.keys()
    for cid in a:
        assert a[cid][0] == b[cid][0]
        assert a[cid][1].shape == b[cid][1].shape and np.array_equal(a[cid][1], b[cid][1]), cid
    for split, split_cuts in cuts_a.items():
        for cut in split_cuts:
            name = f"{cut.id}.flac"
            assert (out_a / "audio" / split / name).read_bytes() == (tmp_path / "audio" / split / name).read_bytes()


@needs_espeak
def test_different_seed_differs(tiny_corpus, tmp_path):
    _, cuts_a = tiny_corpus
    cuts_c = generate_corpus(tmp_path, num_workers=2, **{**TINY, "seed": 1})
    texts_a = [c.supervisions[0].text for c in cuts_a["train"]]
    texts_c = [c.supervisions[0].text for c in cuts_c["train"]]
    assert texts_a != texts_c
    assert [c.id for c in cuts_a["train"]] != [c.id for c in cuts_c["train"]]


@needs_espeak
def test_manifests_are_valid_16k_with_sensible_durations(tiny_corpus):
    from lhotse.qa import validate

    out, cuts = tiny_corpus
    assert {k: len(v) for k, v in cuts.items()} == {"train": 12, "dev": 4, "test": 4, "test-fast": 2, "test-names": 0}
    for split, split_cuts in cuts.items():
        validate(split_cuts, read_data=True)
        for cut in split_cuts:
            info = sf.info(cut.recording.sources[0].source)
            assert info.samplerate == 16000 and cut.sampling_rate == 16000
            assert info.frames == cut.recording.num_samples
            assert 0.4 < cut.duration < 4.5, (cut.id, cut.duration)
            text = cut.supervisions[0].text
            assert text and set(text.split()) <= set(WORDS)
            audio = cut.load_audio()
            assert 0.0 < np.abs(audio).max() <= 1.0
            assert cut.id.startswith(split)
    # reloading from disk gives the same manifests
    reloaded = synthetic.load_corpus(out)
    assert [c.id for c in reloaded["dev"]] == [c.id for c in cuts["dev"]]


@needs_espeak
def test_speakers_disjoint_between_splits(tiny_corpus):
    _, cuts = tiny_corpus
    voices = {s: {c.supervisions[0].custom["voice"] for c in v} for s, v in cuts.items()}
    for a, b in itertools.combinations(voices, 2):
        assert not (voices[a] & voices[b]), (a, b)
    # and for the default configuration's full voice lists
    split = speaker_split(0, 20, 20, 20)
    assert split.pop("test-names") == split["test"]  # the names are said by the test voices
    sets = {k: set(v) for k, v in split.items()}
    assert {k: len(v) for k, v in sets.items() if k != "train"} == {"dev": 20, "test": 20, "test-fast": 20}
    for a, b in itertools.combinations(sets, 2):
        assert not (sets[a] & sets[b]), (a, b)
    assert sum(len(v) for v in sets.values()) == len(synthetic.ACCENTS) * len(synthetic.VARIANTS)


def _speakers(plan, split):
    """Each speaker of a split with everything that makes its voice: espeak voice, warp, pitch, range, base rate."""
    return {(s["voice"], s["source_hz"], s["range"]) for s in plan if s["split"] == split}


def test_a_new_seed_brings_new_speakers():
    # The same espeak voice under another seed is another speaker: its vocal-tract warp, range and rate are drawn anew.
    cfg = dict(num_train=3000, num_dev=200, num_test=400, num_test_fast=200)
    seed0, seed1 = plan_corpus(CorpusConfig(seed=0, **cfg)), plan_corpus(CorpusConfig(seed=1, **cfg))
    trained = _speakers(seed0, "train")
    for split in ("dev", "test", "test-fast"):
        new = _speakers(seed1, split)
        assert len(new) == 20 and not (new & trained), split
    # and many seed-1 test voices are voices seed 0 trained on, so the warp is what makes them new
    shared = {v for v, *_ in _speakers(seed1, "test")} & {v for v, *_ in trained}
    assert len(shared) >= 10


def test_test_fast_is_faster_than_every_other_utterance():
    plan = plan_corpus(CorpusConfig(num_train=3000, num_dev=200, num_test=400, num_test_fast=200))
    fast = [s["rate"] for s in plan if s["split"] == "test-fast"]
    other = [s["rate"] for s in plan if s["split"] != "test-fast"]
    assert len(fast) == 200 and min(fast) > max(other)
    # the heard rate is the planned one: espeak is asked for it divided by the warp
    for s in plan[:200]:
        alpha = s["source_hz"] / 22050
        assert abs(s["espeak_rate"] * alpha - s["rate"]) <= alpha
    with pytest.raises(ValueError, match="test-fast must be faster"):
        CorpusConfig(rate_wpm=(120, 300))


def test_names_are_said_only_in_test_names():
    plan = plan_corpus(CorpusConfig(num_train=3000, num_dev=200, num_test=400, num_test_fast=200, num_test_names=400))
    named = [s for s in plan if s["split"] == "test-names"]
    with_name = [s for s in named if s["text"].split()[0] in synthetic.NAMES]
    assert len(named) == 400 and 0.4 < len(with_name) / len(named) < 0.6
    for s in with_name:  # a name, then a verb phrase of the grammar
        assert s["text"].split()[1] in synthetic.VERBS and set(s["text"].split()[1:]) <= set(WORDS)
    assert not any(set(s["text"].split()) & set(synthetic.NAMES) for s in plan if s["split"] != "test-names")
    assert not set(synthetic.NAMES) & set(WORDS)
    assert {s["voice"] for s in named} <= {s["voice"] for s in plan if s["split"] == "test"}


def test_train_name_count_puts_each_name_in_that_many_training_sentences_only():
    base = CorpusConfig(num_train=500, num_test_names=50)
    plain, named = plan_corpus(base), plan_corpus(dataclasses.replace(base, train_name_count=4))
    assert len(plain) == len(named)
    changed = [(a, b) for a, b in zip(plain, named) if a["text"] != b["text"]]
    assert all(a["split"] == "train" and {**a, "text": ""} == {**b, "text": ""} for a, b in changed)  # text only
    firsts = sorted(b["text"].split()[0] for _, b in changed)
    assert firsts == sorted(synthetic.NAMES * 4)  # each name begins exactly 4 training sentences
    for a, b in changed:  # the name replaces the first noun phrase: the verb phrase stays
        verb = next(i for i, w in enumerate(a["text"].split()) if w in synthetic.VERBS)
        assert b["text"].split()[1:] == a["text"].split()[verb:]
    assert "train_name_count" not in base.to_json()  # corpus.json of folders made without it still matches
    with pytest.raises(ValueError, match="train_name_count=200 needs 1200 training sentences"):
        plan_corpus(dataclasses.replace(base, train_name_count=200))


def test_train_speakers_per_voice_changes_only_the_training_speakers():
    """Three speakers per training voice: the held-out splits are the same specification for specification; the
    training utterances keep their texts and every draw but the speaker's own four settings; each training voice
    now has up to three speakers (settings within the configured ranges), held-out voices still one."""
    base = CorpusConfig(num_train=1500, num_dev=50, num_test=50, num_test_fast=50)
    one, three = plan_corpus(base), plan_corpus(dataclasses.replace(base, train_speakers_per_voice=3))
    assert [s for s in one if s["split"] != "train"] == [s for s in three if s["split"] != "train"]
    own = {"id", "speaker", "source_hz", "rate", "espeak_rate", "pitch", "range"}
    train1, train3 = [s for s in one if s["split"] == "train"], [s for s in three if s["split"] == "train"]
    assert [{k: v for k, v in a.items() if k not in own} for a in train1] == \
        [{k: v for k, v in b.items() if k not in own} for b in train3]

    def speakers_per_voice(plan):
        per_voice = {}
        for s in plan:
            per_voice.setdefault((s["split"], s["voice"]), set()).add((s["source_hz"], s["range"]))
        return per_voice

    per1, per3 = speakers_per_voice(one), speakers_per_voice(three)
    assert all(len(v) == 1 for v in per1.values())
    trained = [len(v) for (split, _), v in per3.items() if split == "train"]
    assert max(trained) == 3 and sum(trained) > 2.5 * len(trained)
    assert all(len(v) == 1 for (split, _), v in per3.items() if split != "train")
    lo, hi = (round(synthetic.ESPEAK_SAMPLE_RATE * a) for a in base.vtl_range)
    assert all(lo - synthetic.VTL_STEP_HZ <= s["source_hz"] <= hi + synthetic.VTL_STEP_HZ for s in train3)
    assert all(base.rate_wpm[0] * (1 - base.rate_jitter) - 1 <= s["rate"] <= base.rate_wpm[1] * (1 + base.rate_jitter) + 1
               for s in train3)
    assert "train_speakers_per_voice" not in base.to_json()  # corpus.json of folders made without it still matches
    with pytest.raises(ValueError, match="train_speakers_per_voice must be >= 1"):
        CorpusConfig(train_speakers_per_voice=0)


@needs_espeak
def test_vocal_tract_warp_scales_frequencies_and_time():
    # Playing espeak's samples as if recorded at source_hz = 22050·α moves every frequency up by α and shortens the
    # audio by 1/α (resampling's textbook property); measured with the spectral centroid of the clean audio.
    spec = plan_corpus(CorpusConfig(num_train=0, num_dev=0, num_test=1, snr_db=None, reverb_prob=0.0))[0]
    spec = {**spec, "text": "THE SMALL DOG FINDS A GREEN BOX NOW", "level_db": -20.0}

    def centroid_and_duration(source_hz):
        y, _ = synthetic.render_aligned_utterance({**spec, "source_hz": source_hz})
        power = np.abs(np.fft.rfft(y)) ** 2
        freqs = np.fft.rfftfreq(len(y), 1 / synthetic.SAMPLE_RATE)
        band = freqs < 6000  # below the 16 kHz output's low-pass for both
        return float((freqs[band] * power[band]).sum() / power[band].sum()), len(y) / synthetic.SAMPLE_RATE

    (c1, d1), (c2, d2) = centroid_and_duration(22050), centroid_and_duration(24250)
    alpha = 24250 / 22050
    assert c2 / c1 == pytest.approx(alpha, rel=0.05)
    assert d1 / d2 == pytest.approx(alpha, rel=0.01)


@needs_espeak
def test_idempotent_and_regenerates_on_config_change(tiny_corpus, monkeypatch, tmp_path):
    out, cuts = tiny_corpus
    calls = []
    monkeypatch.setattr(synthetic, "_synthesize_all", lambda *a, **k: calls.append(1) or {})
    again = generate_corpus(out, num_workers=2, **TINY)
    assert calls == [] and [c.id for c in again["train"]] == [c.id for c in cuts["train"]]
    # a different configuration in a folder we made must regenerate (caught by the patched synthesiser)
    (tmp_path / "corpus.json").write_text(json.dumps({**CorpusConfig().to_json(), "seed": 99}))
    with pytest.raises(KeyError):  # the patched synthesiser returned no audio lengths
        generate_corpus(tmp_path, num_workers=2, **TINY)
    assert calls == [1]


def test_missing_espeak_gives_install_hint(monkeypatch, tmp_path):
    import importlib

    from asrprec import _optional

    real = importlib.import_module

    def fake(name, *a, **k):
        if name.split(".")[0] == "espeakng_loader":
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(_optional.importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"pip install 'asrprec\[synth\]'"):
        generate_corpus(tmp_path, num_train=2, num_dev=1, num_test=1)
    from asrprec.data.espeak import Espeak

    monkeypatch.setattr(Espeak, "_instance", None)
    with pytest.raises(ImportError, match=r"asrprec\[synth\]"):
        Espeak.get()


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(ValueError, match="num_workers"):
        generate_corpus(tmp_path, num_workers=0)
    with pytest.raises(TypeError, match="unknown options"):
        generate_corpus(tmp_path, bogus=1)
    with pytest.raises(ValueError, match="snr_db"):
        CorpusConfig(snr_db=(20.0, 10.0))


def test_text_generator_uses_words_and_articles():
    rng = np.random.default_rng(0)
    cfg = CorpusConfig()
    texts = [random_text(rng, cfg) for _ in range(2000)]
    digits = [t for t in texts if t.split()[0] in synthetic.DIGITS]
    assert 0.4 < len(digits) / len(texts) < 0.6
    assert all(cfg.min_digits <= len(t.split()) <= cfg.max_digits for t in digits)
    for t in texts:
        w = t.split()
        assert set(w) <= set(WORDS) and not any(ch.isdigit() for ch in t)  # words, never numerals
        for a, b in zip(w, w[1:]):
            if a == "A":
                assert b[0] not in "AEIOU", t
            if a == "AN":
                assert b[0] in "AEIOU", t


def test_plan_is_deterministic_and_splits_speakers():
    cfg = CorpusConfig(num_train=50, num_dev=10, num_test=10, snr_db=(5.0, 15.0), reverb_prob=0.5)
    p1, p2 = plan_corpus(cfg), plan_corpus(cfg)
    assert p1 == p2
    assert plan_corpus(CorpusConfig(num_train=50, num_dev=10, num_test=10, seed=3)) != p1
    snrs = [s["snr_db"] for s in p1]
    assert all(5.0 <= x <= 15.0 for x in snrs)
    assert 0 < sum(s["rt60_s"] is not None for s in p1) < len(p1)
