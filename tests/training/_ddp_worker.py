"""Scenarios run under ``torchrun --nproc_per_node 2`` (gloo, CPU) by tests/training/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 _ddp_worker.py OUT_DIR [--cuda] SCENARIO...

Each scenario runs on both ranks in the same process group, one after the other, and writes what it observed to
``OUT_DIR/<scenario>-rank<r>.json`` (and ``.pt`` files of parameters or gradients); the test process compares
them with single-process references it computes itself. Also importable: the test process uses the same model
and batch builders.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from asrprec.models import Decoder, Joiner, Transducer
from asrprec.precision import get_policy

WORLD = 2
FRAMES = 30
DEVICE = "cpu"  # this rank's device; cuda:LOCAL_RANK (NCCL) with --cuda
TEXTS = ["abc", "de", "ea", "bcd", "a", "ed", "cab", "dd"]


class PlainEncoder(nn.Module):
    """Linear + tanh at half the frame rate, without Python state between calls (what torch.compile traces)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(80, 16)
        self.output_dim = 16

    def forward(self, x, lens):
        return torch.tanh(self.proj(x[:, ::2])), (lens + 1) // 2


class LinearEncoder(PlainEncoder):
    """Deterministic (no dropout, no skipping): replicas stay bit-identical, and a single process on the union
    of the ranks' batches computes the same sums. Records the batch counts it sees and can fail on demand."""

    def __init__(self):
        super().__init__()
        self.batch_count = 0.0
        self.seen_counts: list[float] = []
        self.fail_at: int | None = None  # raise an allocator error at this training forward (1-based)
        self.calls = 0

    def forward(self, x, lens):
        if self.training:
            self.calls += 1
            self.seen_counts.append(float(self.batch_count))
            if self.fail_at is not None and self.calls == self.fail_at:
                raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return super().forward(x, lens)


class InfGrad(torch.autograd.Function):
    """Identity whose backward returns inf (a gradient overflow on one rank)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("inf"))


class OverflowingEncoder(LinearEncoder):
    def __init__(self, overflow: bool):
        super().__init__()
        self.overflow = overflow

    def forward(self, x, lens):
        y, y_lens = super().forward(x, lens)
        return (InfGrad.apply(y) if self.overflow and self.training else y), y_lens


class Tok:
    blank_id, vocab_size = 0, 6

    def encode(self, texts):
        return [[1 + "abcde".index(c) for c in t] for t in texts]


def make_model(encoder: nn.Module | None = None) -> Transducer:
    torch.manual_seed(0)
    enc = encoder or LinearEncoder()
    return Transducer(enc, Decoder(6, 16), Joiner(16, 16, 16, 6))


def make_batches(n: int, seed: int = 0, frames: int = FRAMES) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lens = torch.tensor([frames, frames - 1 - int(torch.randint(0, frames // 3, (1,), generator=g))])
        feats = torch.randn(2, frames, 80, generator=g)
        feats[1, int(lens[1]):] = 0.0
        out.append({"features": feats, "feature_lens": lens,
                    "texts": [TEXTS[(2 * i + seed) % 8], TEXTS[(2 * i + 1 + seed) % 8]],
                    "cut_ids": [f"{seed}-{i}a", f"{seed}-{i}b"]})
    return out


def shard(batches: list[dict], rank: int) -> list[dict]:
    """Rank r's batches: r, r + 2, r + 4, ..."""
    return batches[rank::WORLD]


def union(batches: list[dict]) -> list[dict]:
    """Step k of a single process: batches 2k and 2k+1 (what ranks 0 and 1 take at step k) in one batch."""
    out = []
    for a, b in zip(batches[0::2], batches[1::2]):
        out.append({"features": torch.cat([a["features"], b["features"]]),
                    "feature_lens": torch.cat([a["feature_lens"], b["feature_lens"]]),
                    "texts": a["texts"] + b["texts"], "cut_ids": a["cut_ids"] + b["cut_ids"]})
    return out


class Loader(list):
    """A list of batches with a sampler that reports a nominal max_duration (like lhotse's samplers)."""

    class _Sampler:
        def __init__(self, max_duration):
            self.max_duration = max_duration

    def __init__(self, batches, max_duration):
        super().__init__(batches)
        self.sampler = self._Sampler(max_duration)


def train_cfg(exp_dir, **kw):
    from asrprec.training import TrainConfig

    base = dict(exp_dir=str(exp_dir), optimizer="adamw", base_lr=3e-3, lr_batches=100, lr_epochs=2,
                warmup_batches=2, log_interval=1, progress_bar=False, tensorboard=False, average_period=0)
    return TrainConfig(**{**base, **kw})


def memory_cuts(n: int, seed: int = 0):
    """n cuts with 80-dim features held in memory and texts over "abcde" (0.6-2.0 s)."""
    import numpy as np
    from lhotse import CutSet, Features, MonoCut, SupervisionSegment
    from lhotse.features.io import MemoryRawWriter

    rng = np.random.default_rng(seed)
    cuts = []
    for i in range(n):
        frames = int(rng.integers(60, 200))
        dur = frames / 100
        key = MemoryRawWriter().write(f"c{i}", rng.standard_normal((frames, 80)).astype(np.float32))
        feats = Features(recording_id=f"r{i}", channels=0, start=0.0, duration=dur, type="fbank", num_frames=frames,
                         num_features=80, frame_shift=0.01, sampling_rate=16000, storage_type=MemoryRawWriter.name,
                         storage_path="", storage_key=key)
        text = "".join("abcde"[int(j)] for j in rng.integers(0, 5, int(rng.integers(1, 5))))
        sup = SupervisionSegment(id=f"c{i}", recording_id=f"r{i}", start=0.0, duration=dur, text=text)
        cuts.append(MonoCut(id=f"c{i}", start=0.0, duration=dur, channel=0, features=feats, supervisions=[sup]))
    return CutSet.from_cuts(cuts)


class Recording:
    """A loader that records the cut ids it hands out (and passes sampler/dataset through for the loop)."""

    def __init__(self, dl):
        self.dl, self.sampler, self.dataset, self.seen = dl, dl.sampler, dl.dataset, []

    def __iter__(self):
        for b in self.dl:
            self.seen += b["cut_ids"]
            yield b


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    from asrprec.models import unwrap_model

    return {k: v.detach().float().cpu().clone() for k, v in unwrap_model(model).state_dict().items()}


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e)}


# -- scenarios ------------------------------------------------------------------------------------------------


def sc_steps(out: Path, rank: int) -> dict:
    """One and two optimizer steps per rank, for each optimizer; the test trains one process on the unions
    (batches of twice the audio: with ref_duration = a rank's max-duration both count 2 batches per step)."""
    from asrprec.training import train

    res = {}
    for opt in ("adamw", "scaled_adam"):
        for steps in (1, 2):
            model = make_model()
            st = train(model=model, policy=get_policy("fp32", DEVICE), tokenizer=Tok(),
                       train_dl=Loader(shard(make_batches(2 * steps), rank), 1.0),
                       valid_dl=shard(make_batches(2, 1), rank),
                       cfg=train_cfg(out / f"steps-{opt}-{steps}", num_epochs=1, optimizer=opt, ref_duration=1.0))
            torch.save(params(model), out / f"steps-{opt}-{steps}-rank{rank}.pt")
            res[f"{opt}-{steps}"] = st.history[-1]
    return res


def sc_compiled(out: Path, rank: int) -> dict:
    """Two steps with --compile (aot_eager: the same tracing as inductor, no code generation) under DDP: the loop
    compiles the encoder before it wraps the model; the test compares with one eager process on the unions."""
    from asrprec.training import train

    torch.manual_seed(0)  # the same initial weights as the test's reference
    model = make_model(PlainEncoder())
    st = train(model=model, policy=get_policy("fp32", DEVICE), tokenizer=Tok(),
               train_dl=Loader(shard(make_batches(4), rank), 1.0), valid_dl=shard(make_batches(2, 1), rank),
               cfg=train_cfg(out / "compiled", num_epochs=1, ref_duration=1.0, compile=True,
                             compile_backend="aot_eager"))
    torch.save(params(model), out / f"compiled-rank{rank}.pt")
    return {"history": st.history[-1], "keys": sorted(params(model))}


def sc_grads(out: Path, rank: int) -> dict:
    """Gradients after one DDP backward (fp32 and bf16), for the reduction semantics."""
    from asrprec.training import compute_loss
    from asrprec.training.distributed import wrap_model

    for name in ("fp32", "bf16"):
        policy = get_policy(name, DEVICE)
        ddp = wrap_model(policy.prepare_model(make_model()), policy.device)
        loss, _ = compute_loss(ddp, shard(make_batches(2), rank)[0], Tok(), policy)
        loss.backward()
        torch.save({k: p.grad.double().cpu() for k, p in ddp.module.named_parameters() if p.grad is not None},
                   out / f"grads-{name}-rank{rank}.pt")
    return {}


def sc_shards(out: Path, rank: int) -> dict:
    """The datamodule's loaders under the process group; the loop (with the OOM scan) over them."""
    from asrprec.data import AsrDataModule, DataConfig
    from asrprec.training import train

    cuts = memory_cuts(22)
    dm = AsrDataModule(DataConfig(max_duration=4.0, num_buckets=2, spec_augment=False, seed=3))
    train_dl, valid_dl = dm.train_dataloader(cuts), dm.valid_dataloader(cuts.subset(first=9))
    train_dl.sampler.set_epoch(1)
    epoch_ids = [c for b in train_dl for c in b["cut_ids"]]
    valid_ids = [c for b in valid_dl for c in b["cut_ids"]]
    rec = Recording(train_dl)
    train(model=make_model(), policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=rec, valid_dl=valid_dl,
          cfg=train_cfg(out / "shards", num_epochs=1, scan_oom="on"))
    # a loader built for one process would feed every rank the whole data set: refused
    single = AsrDataModule(DataConfig(max_duration=4.0, num_buckets=2, spec_augment=False), rank=0, world_size=1)
    try:
        train(model=make_model(), policy=get_policy("fp32", DEVICE), tokenizer=Tok(),
              train_dl=single.train_dataloader(cuts), valid_dl=valid_dl, cfg=train_cfg(out / "unsharded"))
        unsharded = None
    except ValueError as e:
        unsharded = str(e)
    return {"rank": dm.rank, "world_size": dm.world_size, "sampler_rank": train_dl.sampler.rank,
            "epoch_ids": epoch_ids, "valid_ids": valid_ids, "trained_ids": rec.seen, "unsharded_error": unsharded}


def sc_files(out: Path, rank: int) -> dict:
    """Every writer on (tensorboard, running average, mid-epoch checkpoints) with one exp dir per rank."""
    from asrprec.training import train

    exp = out / f"files-rank{rank}"
    train(model=make_model(), policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=shard(make_batches(4), rank),
          valid_dl=shard(make_batches(2, 1), rank),
          cfg=train_cfg(exp, num_epochs=2, tensorboard=True, average_period=1, save_every_n=1, keep_last_k=2,
                        valid_interval=1))
    return {"files": sorted(str(p.relative_to(exp)) for p in exp.rglob("*") if p.is_file())}


def sc_resume(out: Path, rank: int) -> dict:
    """3 epochs straight vs 2 epochs then --start-epoch 3, in shared exp dirs (rank 0 writes, all ranks read)."""
    from asrprec.training import train

    a, b = out / "resume-a", out / "resume-b"
    data, valid = shard(make_batches(6), rank), shard(make_batches(2, 1), rank)
    full = make_model()
    sa = train(model=full, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=data, valid_dl=valid,
               cfg=train_cfg(a, num_epochs=3, encoder_schedule_scale=10.0))
    train(model=make_model(), policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=data, valid_dl=valid,
          cfg=train_cfg(b, num_epochs=2, encoder_schedule_scale=10.0))
    resumed = make_model()
    sb = train(model=resumed, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=data, valid_dl=valid,
               cfg=train_cfg(b, num_epochs=3, start_epoch=3, encoder_schedule_scale=10.0))
    torch.save(params(full), out / f"resume-full-rank{rank}.pt")
    torch.save(params(resumed), out / f"resume-resumed-rank{rank}.pt")
    return {"full_counts": full.encoder.seen_counts, "resumed_counts": resumed.encoder.seen_counts,
            "transducer_count": full.batch_count, "batch_idx_train": [sa.batch_idx_train, sb.batch_idx_train],
            "valid_loss": [sa.history[-1]["valid_loss"], sb.history[-1]["valid_loss"]],
            "train_loss": [sa.history[-1]["train_loss"], sb.history[-1]["train_loss"]]}


class DropoutEncoder(LinearEncoder):
    """Draws from each rank's own random generator every training step (dropout)."""

    def forward(self, x, lens):
        y, y_lens = super().forward(x, lens)
        return nn.functional.dropout(y, 0.3, self.training), y_lens


def sc_resume_mid(out: Path, rank: int) -> dict:
    """2 epochs of 3 steps with a checkpoint after every step, straight; then the same folder cut back to its
    checkpoint after step 4 (mid epoch 2, as a kill would leave it) and continued with --resume latest. Dropout
    makes every rank's random draws part of the result."""
    import shutil

    from asrprec.training import train
    from asrprec.training.distributed import barrier

    a, b = out / "resume-mid-a", out / "resume-mid-b"
    data, valid = shard(make_batches(6), rank), shard(make_batches(2, 1), rank)
    cfg = dict(num_epochs=2, save_every_n=1, keep_last_k=10, seed=5)
    full = make_model(DropoutEncoder())
    train(model=full, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=data, valid_dl=valid,
          cfg=train_cfg(a, **cfg))
    if rank == 0:
        shutil.copytree(a, b)
        for name in ("epoch-2.pt", "checkpoint-5.pt", "checkpoint-6.pt"):
            (b / name).unlink()
    barrier()
    resumed = make_model(DropoutEncoder())
    st = train(model=resumed, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=data, valid_dl=valid,
               cfg=train_cfg(b, resume="latest", **cfg))
    torch.save(params(full), out / f"resume-mid-full-rank{rank}.pt")
    torch.save(params(resumed), out / f"resume-mid-resumed-rank{rank}.pt")
    return {"batch_idx_train": st.batch_idx_train}


def sc_precisions(out: Path, rank: int) -> dict:
    from asrprec.precision import UnsupportedPrecisionError
    from asrprec.training import train

    res = {}
    for name in ("amp-bf16", "bf16", "amp-fp16"):
        try:
            policy = get_policy(name, DEVICE)
        except UnsupportedPrecisionError as e:
            res[name] = {"unsupported": str(e)}
            continue
        model = make_model()
        st = train(model=model, policy=policy, tokenizer=Tok(), train_dl=shard(make_batches(4), rank),
                   valid_dl=shard(make_batches(2, 1), rank), cfg=train_cfg(out / f"prec-{name}", num_epochs=1))
        p = params(model)
        torch.save(p, out / f"prec-{name}-rank{rank}.pt")
        res[name] = {"finite": all(bool(torch.isfinite(v).all()) for v in p.values()),
                     "dtype": str(next(model.encoder.parameters()).dtype),
                     "train_loss": st.history[-1]["train_loss"], "valid_loss": st.history[-1]["valid_loss"]}
    return res


def _zipformer(pos_emb_skip_rate: float | None):
    """The Zipformer ``tiny`` transducer with the pruned loss (every head parameter used); the positional
    projections skipped with this probability (None: the preset's schedule, 0.5 at the start)."""
    from asrprec.models import LossConfig, build_transducer

    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=6, blank_id=0, context_size=2,
                             decoder_dim=16, joiner_dim=16, loss=LossConfig(loss="pruned"))
    forced = 0
    for m in model.modules():
        if hasattr(m, "pos_emb_skip_rate") and pos_emb_skip_rate is not None:
            del m.pos_emb_skip_rate  # a ScheduledFloat submodule: replaced by a constant
            m.pos_emb_skip_rate = pos_emb_skip_rate
            forced += 1
    return model, forced


def _plain_ddp_steps(model: nn.Module, batches: list[dict]) -> str | None:
    """Two steps through torch's DDP without find_unused_parameters; the error text, or None."""
    from asrprec.training import compute_loss

    from asrprec.training.distributed import _match_bucket_layout

    device = torch.device(DEVICE)
    _match_bucket_layout(model)  # as wrap_model does: the controls are about unused parameters only
    ddp = nn.parallel.DistributedDataParallel(model.to(device),
                                              device_ids=[device.index] if device.type == "cuda" else None)
    try:
        for b in batches[:2]:
            loss, _ = compute_loss(ddp, b, Tok(), get_policy("fp32", DEVICE))
            loss.backward()
    except RuntimeError as e:
        return str(e)
    return None


def sc_zipformer(out: Path, rank: int) -> dict:
    """Layer skipping under DDP: rank 1 never uses the positional projections, rank 0 skips them and other
    layers at random (the early schedules), after an OOM scan that used them all. Controls through torch's DDP
    without find_unused_parameters: fine with nothing skipped, the "unused parameters" error with the
    projections skipped."""
    from asrprec.data import AsrDataModule, DataConfig
    from asrprec.training import train

    model, forced = _zipformer(1.0 if rank == 1 else None)
    dm = AsrDataModule(DataConfig(max_duration=2.5, num_buckets=2, spec_augment=False, seed=1))
    loader = dm.train_dataloader(memory_cuts(10, seed=1))
    st = train(model=model, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=loader,
               valid_dl=dm.valid_dataloader(memory_cuts(2, seed=2)),
               cfg=train_cfg(out / "zipformer", num_epochs=1, optimizer="scaled_adam", scan_oom="on",
                             max_batches_per_epoch=2))
    batches = shard(make_batches(4, frames=40), rank)
    torch.save(params(model), out / f"zipformer-rank{rank}.pt")
    return {"forced": forced, "steps": st.batch_idx_train, "train_loss": st.history[-1]["train_loss"],
            "plain_ddp_nothing_skipped": _plain_ddp_steps(_zipformer(0.0)[0], batches),
            "plain_ddp_skipped": _plain_ddp_steps(_zipformer(1.0)[0], batches)}


def _capture() -> list[str]:
    messages: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("asrprec.training").addHandler(H(level=logging.WARNING))
    return messages


def sc_nonfinite(out: Path, rank: int) -> dict:
    """Rank 1's second batch has a NaN feature: both ranks skip that step."""
    from asrprec.training import train

    messages = _capture()
    data = shard(make_batches(6), rank)
    if rank == 1:
        data[1]["features"][0, 0, 0] = float("nan")
    model = make_model()
    st = train(model=model, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=Loader(data, 1.0),
               valid_dl=shard(make_batches(2, 1), rank), cfg=train_cfg(out / "nonfinite", num_epochs=1,
                                                                        ref_duration=1.0, max_skipped_fraction=0.5))
    torch.save(params(model), out / f"nonfinite-rank{rank}.pt")
    return {"warnings": [m for m in messages if "non-finite" in m], "batch_idx_train": st.batch_idx_train,
            "valid_loss": st.history[-1]["valid_loss"]}


def sc_forward_oom(out: Path, rank: int) -> dict:
    """Rank 1 runs out of memory in its second forward pass: both ranks stop, nobody waits."""
    from asrprec.training import train

    enc = LinearEncoder()
    if rank == 1:
        enc.fail_at = 2
    exp = out / "forward_oom"
    try:
        train(model=make_model(enc), policy=get_policy("fp32", DEVICE), tokenizer=Tok(),
              train_dl=shard(make_batches(6), rank), valid_dl=shard(make_batches(2, 1), rank),
              cfg=train_cfg(exp, num_epochs=1))
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the test checks which
        return {"error": _error(e), "files": sorted(p.name for p in exp.glob("*") if p.is_file())}


def sc_collapse(out: Path, rank: int) -> dict:
    """Rank 1's gradients overflow on every step: the summed gradients are non-finite on both ranks, both skip,
    and both stop together (amp-fp16's grad-scale floor; the no-op scaler's consecutive-skip limit)."""
    from asrprec.precision import UnsupportedPrecisionError
    from asrprec.training import train

    res = {}
    for name, kw in (("amp-fp16", {"init_scale": 1.0, "abort_floor": 0.3}), ("fp32", {"max_consecutive_skips": 2})):
        try:
            policy = get_policy(name, DEVICE, **kw)
        except UnsupportedPrecisionError as e:
            res[name] = {"unsupported": str(e)}
            continue
        model = make_model(OverflowingEncoder(overflow=rank == 1))
        try:
            train(model=model, policy=policy, tokenizer=Tok(), train_dl=shard(make_batches(8), rank),
                  valid_dl=shard(make_batches(2, 1), rank), cfg=train_cfg(out / f"collapse-{name}", num_epochs=1))
            res[name] = {"error": None}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": _error(e), "calls": model.encoder.calls}
    return res


def sc_backward_oom(out: Path, rank: int) -> dict:
    """Rank 1 fails inside the backward pass, after the gradient all-reduce has begun: this process exits with
    its error, and torchrun must end rank 0 (which waits in the all-reduce)."""
    from asrprec.training import train

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("CUDA out of memory. Tried to allocate 40.00 GiB (simulated, in backward)")

    class Enc(LinearEncoder):
        def forward(self, x, lens):
            y, y_lens = super().forward(x, lens)
            return (FailingBackward.apply(y) if rank == 1 and self.calls == 2 else y), y_lens

    model = make_model(Enc())
    (out / f"backward_oom-started-rank{rank}").write_text(str(time.time()))
    train(model=model, policy=get_policy("fp32", DEVICE), tokenizer=Tok(), train_dl=shard(make_batches(6), rank),
          valid_dl=shard(make_batches(2, 1), rank), cfg=train_cfg(out / "backward_oom", num_epochs=1))
    return {"finished": True}


SCENARIOS = {k[3:]: v for k, v in dict(globals()).items() if k.startswith("sc_")}


def main() -> None:
    from asrprec.training import get_rank, setup_distributed

    global DEVICE
    out, names = Path(sys.argv[1]), sys.argv[2:]
    cuda = "--cuda" in names
    names = [n for n in names if n != "--cuda"]
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    # a bounded wait: a rank left alone in a collective fails the test instead of hanging it
    env = setup_distributed("cuda" if cuda else "cpu", timeout=timedelta(seconds=90))
    assert env.world_size == WORLD and env.backend == ("nccl" if cuda else "gloo"), env
    DEVICE = str(env.device)
    rank = get_rank()
    for name in names:
        t0 = time.process_time()
        try:
            res = {"ok": True, **SCENARIOS[name](out, rank)}
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            if name == "backward_oom":
                raise
            res = {"ok": False, "error": _error(e), "traceback": traceback.format_exc()}
        res["cpu_seconds"] = time.process_time() - t0
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
