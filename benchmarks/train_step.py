"""One full transducer training step (forward, pruned loss, backward, ScaledAdam) per model variant.

The variants run interleaved in one process on the same batches (variant A step, variant B step, ...), so a
shared or throttled CPU slows them alike; the table gives each variant's median step time and the median of its
per-batch time ratio against the first variant. Batches are synthetic but shaped like the embedded recipe's
(``--max-duration 30``: ~18 utterances of 1-2 s, 80 fbank bins, ~12 BPE tokens each, vocabulary 128).

    python benchmarks/train_step.py \\
        'conformer:{"frontend_channels": [8, 32, 128]}' 'conformer:{}' 'zipformer:{}'

A variant is ``encoder:JSON`` (JSON = encoder preset overrides; ``encoder`` alone means no overrides). Add
``--swish-reference`` to also time each variant with the previous DoubleSwish (derivative recomputed in
backward) for comparison with the current one (derivative saved in forward).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from asrprec.models import LossConfig, build_transducer, count_parameters, set_batch_count
from asrprec.optim import ScaledAdam


def parse_variant(text: str) -> tuple[str, dict]:
    encoder, _, overrides = text.partition(":")
    return encoder, (json.loads(overrides) if overrides else {})


def make_batches(n: int, seed: int, vocab: int = 128) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        B = int(torch.randint(14, 23, (), generator=g))
        lens = torch.randint(100, 200, (B,), generator=g)
        T = int(lens.max())
        feats = torch.randn(B, T, 80, generator=g)
        U = torch.randint(6, 16, (B,), generator=g)
        targets = torch.randint(1, vocab, (B, int(U.max())), generator=g)
        out.append((feats, lens, targets, U))
    return out


class _ReferenceDoubleSwish(torch.autograd.Function):
    """The former DoubleSwish: saves x, recomputes sigmoid(x - 1) and the derivative in backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x - 1.0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x - 1.0)
        return grad * (s * (1.0 + x * (1.0 - s)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help="encoder[:JSON overrides], e.g. 'conformer:{\"num_encoder_layers\": 2}'")
    p.add_argument("--size", default="tiny")
    p.add_argument("--batches", type=int, default=30, help="timed batches per variant (after 3 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--swish-reference", action="store_true")
    p.add_argument("--encoder-batch-count", type=float, default=0.0,
                   help="batch count the encoder's schedules see (dropout, layer skipping, balancer probabilities); "
                        "the espeak recipe reaches ~13,000 (10 epochs of ~135 batches x --encoder-schedule-scale 10)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import asrprec.models.scaling as scaling

    setups = []
    for text in args.variants:
        encoder, overrides = parse_variant(text)
        swishes = ["saved-derivative", "reference"] if args.swish_reference else ["saved-derivative"]
        for swish in swishes:
            model = build_transducer(encoder=encoder, size=args.size, vocab_size=128, encoder_overrides=overrides,
                                     loss=LossConfig(loss="pruned", loss_warmup_batches=4000),
                                     model_warmup_batches=0)
            model.train()
            set_batch_count(model.encoder, args.encoder_batch_count)
            name = text + (f" [{swish} DoubleSwish]" if args.swish_reference else "")
            setups.append((name, swish, model, ScaledAdam(model.parameters(), lr=0.045)))
    batches = make_batches(args.batches + 3, seed=0)
    original = scaling._DoubleSwishFunction
    wall = [[] for _ in setups]
    cpu = [[] for _ in setups]
    for i, (feats, lens, targets, U) in enumerate(batches):
        for k, (_, swish, model, opt) in enumerate(setups):
            scaling._DoubleSwishFunction = _ReferenceDoubleSwish if swish == "reference" else original
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(feats, lens, targets, U)
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 3:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    scaling._DoubleSwishFunction = original
    print(f"# {datetime.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, {args.batches} batches per variant (interleaved), "
          f"encoder batch count {args.encoder_batch_count:g}")
    print("| variant | parameters | median step (wall) | median step (CPU) | time ratio vs first |")
    print("|---|---|---|---|---|")
    for k, (name, _, model, _) in enumerate(setups):
        ratio = statistics.median(a / b for a, b in zip(wall[k], wall[0]))
        print(f"| {name} | {count_parameters(model):,} | {statistics.median(wall[k]) * 1e3:.0f} ms | "
              f"{statistics.median(cpu[k]) * 1e3:.0f} ms | {ratio:.3f} |")


if __name__ == "__main__":
    main()
