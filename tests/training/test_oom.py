"""OOM guards: recognising allocator failures, the pre-training scan of the riskiest batches, and the error a
training-time OOM becomes."""

import random

import pytest
import torch

from asrprec.precision import get_policy
from asrprec.training import TrainConfig, train
from asrprec.training.oom import (
    BatchOutOfMemory,
    is_out_of_memory,
    sampler_max_duration,
    scan_pessimistic_batches,
)

from .test_loop import Tok, cfg, loader, make_model

pytest.importorskip("lhotse")


def test_real_cpu_allocation_failure_is_recognised():
    with pytest.raises(Exception) as info:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: the CPU allocator refuses
    assert is_out_of_memory(info.value), repr(info.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only allocator error types count


class CutsDataset:
    """A CutSet batch -> the datamodule's batch dict, with random features of each cut's length (100 Hz)."""

    def __getitem__(self, cuts):
        cuts = sorted(cuts, key=lambda c: -c.duration)
        lens = torch.tensor([round(c.duration * 100) for c in cuts])
        g = torch.Generator().manual_seed(len(cuts))
        return {"features": torch.randn(len(cuts), int(lens.max()), 80, generator=g), "feature_lens": lens,
                "texts": [c.supervisions[0].text for c in cuts], "cut_ids": [c.id for c in cuts]}


class Loader:
    """What scan_pessimistic_batches needs of a DataLoader: a lhotse sampler and a dataset."""

    def __init__(self, max_duration=3.0):
        from lhotse import CutSet
        from lhotse.testing.dummies import dummy_cut, dummy_supervision

        durations = [0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 2.5]  # the longest cut: 2.5 s
        cuts = CutSet.from_cuts(
            dummy_cut(i, duration=d, supervisions=[dummy_supervision(i, duration=d, text="abcde"[: 1 + i % 5])])
            for i, d in enumerate(durations))
        from lhotse.dataset import SimpleCutSampler

        self.sampler = SimpleCutSampler(cuts, max_duration=max_duration, shuffle=False)
        self.dataset = CutsDataset()


class FramesLimit(torch.nn.Module):
    """Wraps a transducer; raises the CUDA OOM error type when a batch has more than ``limit`` padded frames,
    as a GPU with a fixed memory budget would."""

    def __init__(self, inner, limit):
        super().__init__()
        self.inner, self.limit, self.seen = inner, limit, []

    def forward(self, features, *rest):
        self.seen.append(tuple(features.shape[:2]))
        if features.shape[0] * features.shape[1] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.inner(features, *rest)


def test_scan_runs_the_riskiest_batches_and_leaves_no_trace():
    model = make_model()
    model.batch_count = 7  # as the loop would have set it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = FramesLimit(model, limit=10**9)
    peaks = scan_pessimistic_batches(wrapped, Loader(), Tok(), get_policy("fp32", "cpu"))
    # the single longest cut (2.5 s = 250 frames) and the batch with the most cuts were both tried
    assert max(t for _, t in wrapped.seen) == 250
    assert max(b for b, _ in wrapped.seen) >= 4
    assert set(peaks) >= {"single_longest_cut", "max_num_cuts"}
    assert all(p != p for p in peaks.values())  # NaN: peak memory is measured on CUDA only
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert model.batch_count == 7


def test_scan_restores_the_rng_exactly():
    model = make_model()  # seeds torch itself
    random.seed(5)
    torch.manual_seed(5)
    want = (random.random(), torch.rand(4))
    random.seed(5)
    torch.manual_seed(5)
    scan_pessimistic_batches(model, Loader(), Tok(), get_policy("fp32", "cpu"))
    got = (random.random(), torch.rand(4))
    assert got[0] == want[0] and torch.equal(got[1], want[1])


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_scan_names_the_batch_and_the_fix(precision):
    # unshuffled batches of <= 3 s padded duration: 4 x 60, 2 x 100, 1 x 120, 1 x 250 frames; a budget of 245
    # frames fails the one with the longest cut
    wrapped = FramesLimit(make_model(), limit=245)
    with pytest.raises(BatchOutOfMemory) as info:
        scan_pessimistic_batches(wrapped, Loader(max_duration=3.0), Tok(), get_policy(precision, "cpu"))
    msg = str(info.value)
    assert "pessimistic batch for single_longest_cut (= 2.5)" in msg and "1 utterance padded to 250" in msg
    assert "decrease --max-duration (now 3 s)" in msg
    # fp32 can halve its activations with a 2-byte policy; the amp policies are already there
    assert ("--precision amp-bf16 or bf16" in msg) == (precision == "fp32")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_scan_lets_other_errors_through():
    class Broken(torch.nn.Module):
        def forward(self, *a):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        scan_pessimistic_batches(Broken(), Loader(), Tok(), get_policy("fp32", "cpu"))


def test_sampler_max_duration():
    assert sampler_max_duration(Loader(max_duration=3.0).sampler) == 3.0
    assert sampler_max_duration(object()) is None


def test_oom_during_training_saves_the_batch_and_explains(tmp_path):
    model = FramesLimit(make_model(), limit=10**9)
    batches = loader(3)
    batches[1] = {**batches[1], "features": torch.randn(2, 60, 80), "feature_lens": torch.tensor([60, 50])}
    model.limit = 100  # (2, 30) batches fit, the (2, 60) one does not
    with pytest.raises(BatchOutOfMemory) as info:
        train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches,
              valid_dl=loader(1), cfg=cfg(tmp_path, num_epochs=1))
    msg = str(info.value)
    assert "training batch 2" in msg and "2 utterances padded to 60 frames" in msg
    saved = torch.load(tmp_path / "oom-batch-2.pt", weights_only=False)
    assert torch.equal(saved["features"], batches[1]["features"]) and saved["cut_ids"] == batches[1]["cut_ids"]
    assert (tmp_path / "bad-model.pt").exists()


def test_scan_mode_on_needs_a_lhotse_loader(tmp_path):
    with pytest.raises(ValueError, match="lhotse sampler"):
        train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=loader(2),
              valid_dl=loader(1), cfg=cfg(tmp_path, num_epochs=1, scan_oom="on"))
    with pytest.raises(ValueError, match="scan_oom"):
        TrainConfig(exp_dir=str(tmp_path), scan_oom="yes")
