"""decode.py writes word times beside the recogs (a NIST CTM file per split), also for --long-form, whose chunks
are read from the audio."""

from __future__ import annotations

from asrprec.metrics import read_recogs

from .test_bad_args import copy_of, recipe, trained  # noqa: F401  (trained: the module's fixture)


def _ctm(path):
    rows = {}
    for line in path.read_text().splitlines():
        utt, channel, start, dur, word = line.split()
        assert channel == "1"
        rows.setdefault(utt, []).append((float(start), float(dur), word))
    return rows


def _check_ctm_against_recogs(exp, split, tag_part, durations):
    recogs = next(exp.glob(f"recogs-{split}-*{tag_part}*.txt"))
    tag = recogs.name.removeprefix(f"recogs-{split}-").removesuffix(".txt")
    ctm = _ctm(exp / f"ctm-{split}-{tag}.txt")
    hyps = {cut: hyp for cut, (_, hyp) in read_recogs(recogs).items()}
    assert hyps and any(hyps.values()), "nothing was recognised: the check below would be empty"
    for cut, hyp in hyps.items():
        rows = ctm.get(cut, [])
        assert [w for _, _, w in rows] == hyp, cut  # the same words, in order
        starts = [s for s, _, _ in rows]
        assert starts == sorted(starts) and all(s >= 0 and d >= 0 for s, d, _ in rows)
        assert all(s + d <= durations[cut] + 0.04 for s, d, _ in rows), (cut, rows, durations[cut])
    return tag


def test_decode_writes_a_ctm_whose_words_are_the_recogs_words_inside_each_cut(trained, data_root, tmp_path):
    from asrprec.data import load_fbank_cuts

    exp = copy_of(trained, tmp_path)
    durations = {c.id: c.duration for c in load_fbank_cuts(data_root, splits=("test",))["test"]}
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", exp, "--epoch", 2, "--splits", "test")
    assert out.code is None, out.text
    _check_ctm_against_recogs(exp, "test", "greedy_search", durations)
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", exp, "--epoch", 2, "--splits", "test",
                 "--long-form", "--decode.chunk_seconds", 1.2, "--decode.overlap_seconds", 0.4)
    assert out.code is None, out.text
    assert _check_ctm_against_recogs(exp, "test", "long-1.2s-0.4s", durations).endswith("-long-1.2s-0.4s")


def test_long_form_refuses_what_it_does_not_do_in_one_line(trained, data_root, tmp_path):
    out = recipe("decode.py", "--data-dir", data_root, "--exp-dir", copy_of(trained, tmp_path), "--epoch", 2,
                 "--long-form", "--lm", "x.arpa", "--lm-scale", 0.1)
    assert out.code == 2 and "--long-form decodes whole chunks without an LM" in out.error, out.text
