"""validate_cuts (check_cuts' strict form, for data preparation) names the bad cut, its problem and the fix."""

import shutil

import pytest

from asrprec.data import validate_cuts

from .conftest import needs_espeak


@needs_espeak
def test_valid_corpus_passes(tiny_fbank):
    _, cuts = tiny_fbank
    assert validate_cuts(cuts["dev"], check_audio=True, check_features=True) == len(cuts["dev"])


@needs_espeak
def test_empty_transcript_is_named(tiny_corpus):
    from lhotse import CutSet
    from lhotse.utils import fastcopy

    _, cuts = tiny_corpus
    good = list(cuts["dev"])
    victim = good[1]
    bad = good[:1] + [fastcopy(victim, supervisions=[fastcopy(victim.supervisions[0], text="  ")])] + good[2:]
    with pytest.raises(ValueError, match=rf"cut '{victim.id}': empty transcript; fix: the transcript is empty"):
        validate_cuts(CutSet.from_cuts(bad), check_audio=False)


@needs_espeak
def test_corrupt_audio_is_named(tiny_corpus, tmp_path):
    from lhotse import CutSet
    from lhotse.audio import AudioSource
    from lhotse.utils import fastcopy

    _, cuts = tiny_corpus
    cut = next(iter(cuts["test"]))
    broken = tmp_path / "broken.flac"
    shutil.copy(cut.recording.sources[0].source, broken)
    broken.write_bytes(broken.read_bytes()[:64])  # truncated: header only
    rec = fastcopy(cut.recording, sources=[AudioSource(type="file", channels=[0], source=str(broken))])
    with pytest.raises(ValueError, match=rf"cut '{cut.id}': unreadable or non-finite features/audio; fix: the file cannot be decoded"):
        validate_cuts(CutSet.from_cuts([fastcopy(cut, recording=rec)]))


@needs_espeak
def test_check_cuts_keeps_a_lazy_manifest_lazy(tiny_corpus, tmp_path):
    """A large corpus is read lazily: check_cuts streams through it, drops the bad cut and returns a lazy set."""
    from lhotse import CutSet
    from lhotse.utils import fastcopy

    from asrprec.data import check_cuts, load_cuts, write_cuts

    _, cuts = tiny_corpus
    good = list(cuts["train"])
    victim = good[3]
    bad = good[:3] + [fastcopy(victim, supervisions=[fastcopy(victim.supervisions[0], text="")])] + good[4:]
    write_cuts(CutSet.from_cuts(bad), tmp_path / "train.jsonl.gz")
    lazy = load_cuts(tmp_path / "train.jsonl.gz")
    assert lazy.is_lazy
    kept, report = check_cuts(lazy, split="train")
    assert kept.is_lazy
    assert [c.id for c in kept] == [c.id for c in good if c.id != victim.id]
    assert report.total == len(good) and report.problems == {"empty transcript": [victim.id]}


@needs_espeak
def test_feature_width_other_than_the_models_is_named_with_the_fix(tiny_fbank):
    """Stored 80-bin features against ``--data.num_mel_bins``: 80 passes; 40 names the split, the width and the
    flag; computing fbank on the fly has nothing stored to disagree."""
    from asrprec.data import check_feature_bins

    _, cuts = tiny_fbank
    assert {c.num_features for c in cuts["train"]} == {80}
    check_feature_bins(cuts, 80)
    with pytest.raises(ValueError, match=r"train split's features have 80 bins .* --data.num_mel_bins 80"):
        check_feature_bins(cuts, 40)
    check_feature_bins(cuts, 40, on_the_fly_feats=True)
