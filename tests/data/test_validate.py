"""validate_cuts names the bad cut and the fix."""

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
    with pytest.raises(ValueError, match=rf"cut '{victim.id}' has an empty transcript; fix: drop"):
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
    with pytest.raises(ValueError, match=rf"cut '{cut.id}': its audio .* cannot be read .*fix: regenerate"):
        validate_cuts(CutSet.from_cuts([fastcopy(cut, recording=rec)]))
