"""Test cuts whose features hold NaN or Inf are named, counted and left out of decoding under the default (fast)
data checks, not decoded into empty hypotheses; the other cuts decode as before."""

import json

import numpy as np

from .test_bad_args import copy_of, recipe, trained  # noqa: F401  (trained: a module fixture)


def test_nonfinite_test_features_are_named_counted_and_left_out(trained, corpus_copy, tmp_path):  # noqa: F811
    from lhotse import CutSet

    test = list(CutSet.from_file(corpus_copy / "espeak_cuts_test_fbank.jsonl.gz"))
    for cut, value in ((test[0], np.nan), (test[2], np.inf)):
        path = f"{cut.features.storage_path}/{cut.features.storage_key}"
        data = np.load(path)
        data[3, :5] = value  # 5 values of one frame
        np.save(path, data)
    exp = copy_of(trained, tmp_path)
    out = recipe("decode.py", "--data-dir", corpus_copy, "--exp-dir", exp, "--epoch", 2, "--splits", "test")
    assert out.code is None, out.text
    assert "test: WER" in out.text and f"2 of {len(test)} cuts left out, see the log" in out.text
    for cut in (test[0], test[2]):
        assert f"cut {cut.id} not decoded: non-finite features (5 NaN/Inf values)" in out.text
    (summary,) = [json.loads(p.read_text()) for p in exp.glob("wer-summary-*.json")]
    assert summary["test"]["decoded"] == len(test) - 2 and summary["test"]["left_out"] == 2
    (recogs,) = exp.glob("recogs-test-*.txt")
    decoded = recogs.read_text()
    assert test[0].id not in decoded and test[2].id not in decoded and test[1].id in decoded


def test_a_batch_leaves_out_only_its_nonfinite_rows(tmp_path):
    from lhotse import CutSet

    from asrprec.data.datamodule import AsrDataset

    from .corpus import make_cut

    rng = np.random.default_rng(0)
    cuts = [make_cut(f"c{i}", frames, "ONE TWO", tmp_path, rng) for i, frames in enumerate((120, 90, 60))]
    path = f"{cuts[0].features.storage_path}/{cuts[0].features.storage_key}"  # the longest: the padded length
    data = np.load(path)
    data[7, 0], data[8, 1] = -np.inf, np.nan
    np.save(path, data)
    batch = AsrDataset(on_the_fly_feats=False)[CutSet.from_cuts(cuts)]
    assert batch["dropped_cuts"] == [{"cut_id": "c0", "reason": "non-finite features (2 NaN/Inf values)"}]
    assert batch["cut_ids"] == ["c1", "c2"] and batch["feature_lens"].tolist() == [90, 60]
    assert tuple(batch["features"].shape) == (2, 90, 80) and bool(batch["features"].isfinite().all())
    expected = np.load(f"{cuts[1].features.storage_path}/{cuts[1].features.storage_key}")
    assert np.array_equal(batch["features"][0].numpy(), expected)  # the rows kept are untouched
