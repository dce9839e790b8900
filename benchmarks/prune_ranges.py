"""Which pruning-window criterion loses less: the pruned RNN-T loss's excess over the full loss.

The pruned loss keeps only the alignments inside the windows, so it is never below the exact (full) loss of the
same joiner logits; the excess ``pruned - full`` (nats per utterance, and relative to the full loss) measures the
probability mass the windows cut off. Compared: ``asrprec.losses.get_rnnt_prune_ranges(criterion=...)`` with
"k2" (k2's current criterion, k2-fsa/k2 PR #1009) and "occupancy" (k2's earlier one).

    PYTHONPATH=. python benchmarks/prune_ranges.py                                   # random lattices
    PYTHONPATH=. python benchmarks/prune_ranges.py --exp-dir EXP --data-dir DATA --epochs 1 5 10   # a trained model

Random lattices: am (B,T,V) and lm (B,U+1,V) ~ N(0, scale^2); the "simple" posteriors come from
``rnnt_loss_smoothed`` (lm_only_scale 0.25, as in training), the joiner logits are ``am + lm`` ("matched": the
simple model is the joiner) or ``am + lm + noise`` ("mismatched": a joiner the simple model only approximates).
Trained model: the recipe's model on dev batches: its simple projections give the windows, its joiner the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from asrprec.losses import do_rnnt_pruning, get_rnnt_prune_ranges, rnnt_loss_pruned, rnnt_loss_smoothed
from asrprec.losses.lattice import extend_targets, rnnt_lattice_nll

CRITERIA = ("k2", "occupancy")
LM_ONLY_SCALE = 0.25  # icefall's --lm-scale: the simple loss that chooses the windows in training


def full_loss(logits, targets, logit_lens, target_lens, blank=0):
    """Exact RNN-T loss per utterance (B,) of (B, T, U+1, V) logits, float64."""
    lp = logits.double().log_softmax(-1)
    B, T, U1, V = lp.shape
    tgt = extend_targets(targets, target_lens, blank)  # (B, U+1), blank past the end
    label = lp.gather(3, tgt.view(B, 1, U1, 1).expand(B, T, U1, 1)).squeeze(3)
    return rnnt_lattice_nll(lp[..., blank], label, logit_lens, target_lens)


def excess(px, py, logits_fn, targets, logit_lens, target_lens, s_range, full):
    """{criterion: (per-utterance excess (B,), starts (B,T))} for one batch."""
    out = {}
    for c in CRITERIA:
        ranges = get_rnnt_prune_ranges(px, py, logit_lens, target_lens, s_range, criterion=c)
        pruned = rnnt_loss_pruned(logits_fn(ranges).double(), targets, ranges, logit_lens, target_lens,
                                  reduction="none")
        out[c] = (pruned - full, ranges[:, :, 0])
    return out


def random_case(B, T, U, V, scale, noise, s_range, seed):
    g = torch.Generator().manual_seed(seed)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64) * scale
    logit_lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    logit_lens[0] = T
    target_lens = torch.randint(U // 2, U + 1, (B,), generator=g)
    target_lens[0] = U
    targets = torch.randint(1, V, (B, U), generator=g)
    logits = am[:, :, None] + lm[:, None] + noise * torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    _, (px, py) = rnnt_loss_smoothed(lm, am, targets, logit_lens, target_lens, lm_only_scale=LM_ONLY_SCALE,
                                     reduction="none", return_grad=True)
    full = full_loss(logits, targets, logit_lens, target_lens)
    res = excess(px, py, lambda r: logits.gather(2, r.unsqueeze(3).expand(*r.shape, V)), targets, logit_lens,
                 target_lens, s_range, full)
    valid = torch.arange(T).view(1, T) < logit_lens.view(B, 1)
    return res, full, valid


def summarise(rows, name, results, full, valid):
    d = {c: results[c][0] for c in CRITERIA}
    same = (results["k2"][1] == results["occupancy"][1])[valid].double().mean().item()
    rows.append({
        "case": name, "utterances": int(full.numel()), "full_loss_mean": full.mean().item(),
        **{f"excess_{c}": d[c].mean().item() for c in CRITERIA},
        **{f"rel_excess_{c}_pct": 100 * (d[c] / full).mean().item() for c in CRITERIA},
        "k2_better_share": (d["k2"] < d["occupancy"] - 1e-9).double().mean().item(),
        "occupancy_better_share": (d["occupancy"] < d["k2"] - 1e-9).double().mean().item(),
        "frames_with_different_start_pct": 100 * (1 - same),
    })


def trained_model_rows(exp_dir, data_dir, epochs, s_range, max_batches, max_duration):
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.data import AsrDataModule, DataConfig, load_fbank_cuts
    from asrprec.models import build_transducer
    from asrprec.tokenizer import Tokenizer
    from asrprec.training import pad_targets, read_model_config

    config = read_model_config(exp_dir)
    tok = Tokenizer(Path(data_dir) / "bpe.model")
    dev = load_fbank_cuts(data_dir, splits=("dev",))["dev"]
    loader = AsrDataModule(DataConfig(max_duration=max_duration, num_buckets=1)).test_dataloader(dev)
    batches = [b for _, b in zip(range(max_batches), loader)]
    rows = []
    for epoch in epochs:
        model = build_transducer(**config)
        load_decoding_weights(model, exp_dir, epoch, 1)
        model.eval()
        lm_only = model.loss_config.lm_only_scale
        res_all, full_all, valid_all = {c: ([], []) for c in CRITERIA}, [], []
        with torch.no_grad():
            for batch in batches:
                enc, enc_lens = model.encode(batch["features"], batch["feature_lens"])
                targets, target_lens = pad_targets(tok.encode(batch["texts"]), torch.device("cpu"))
                dec = model.decoder(model.decoder_input(targets, target_lens))
                _, (px, py) = rnnt_loss_smoothed(model.simple_lm_proj(dec), model.simple_am_proj(enc), targets,
                                                 enc_lens, target_lens, lm_only_scale=lm_only, reduction="none",
                                                 return_grad=True)
                e_proj, d_proj = model.joiner.encoder_proj(enc), model.joiner.decoder_proj(dec)
                logits = model.joiner(e_proj.unsqueeze(2), d_proj.unsqueeze(1), project_input=False)
                full = full_loss(logits, targets, enc_lens, target_lens)

                def pruned_logits(r):
                    a, b = do_rnnt_pruning(e_proj, d_proj, r)
                    return model.joiner(a, b, project_input=False)

                res = excess(px, py, pruned_logits, targets, enc_lens, target_lens, s_range, full)
                for c in CRITERIA:
                    res_all[c][0].append(res[c][0])
                    res_all[c][1].append(res[c][1].flatten()[
                        (torch.arange(enc.shape[1]).view(1, -1) < enc_lens.view(-1, 1)).flatten()])
                full_all.append(full)
        full = torch.cat(full_all)
        results = {c: (torch.cat(res_all[c][0]), torch.cat(res_all[c][1])) for c in CRITERIA}
        summarise(rows, f"trained epoch {epoch}", results, full, torch.ones_like(results["k2"][1], dtype=torch.bool))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--s-range", type=int, default=5)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--exp-dir", type=Path, default=None)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--epochs", type=int, nargs="+", default=[1])
    p.add_argument("--max-batches", type=int, default=4)
    p.add_argument("--max-duration", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rows = []
    for (B, T, U, V) in ((8, 50, 12, 32), (4, 100, 25, 128)):
        for scale in (1.0, 4.0):
            for noise in (0.0, 1.0):
                res = [random_case(B, T, U, V, scale, noise, args.s_range, seed) for seed in range(args.seeds)]
                results = {c: (torch.cat([r[0][c][0] for r in res]), torch.cat([r[0][c][1].flatten() for r in res]))
                           for c in CRITERIA}
                full = torch.cat([r[1] for r in res])
                valid = torch.cat([r[2].flatten() for r in res])
                name = f"random B{B} T{T} U{U} V{V} scale {scale:g} {'mismatched' if noise else 'matched'}"
                summarise(rows, name, results, full, valid)
    if args.exp_dir is not None:
        rows += trained_model_rows(args.exp_dir, args.data_dir, args.epochs, args.s_range, args.max_batches,
                                   args.max_duration)
    if args.json:
        print(json.dumps(rows, indent=1))
    cols = ("case", "utterances", "full_loss_mean", "excess_k2", "excess_occupancy", "rel_excess_k2_pct",
            "rel_excess_occupancy_pct", "k2_better_share", "occupancy_better_share", "frames_with_different_start_pct")
    print(f"s_range {args.s_range}; excess = pruned - full loss (nats/utterance); {time.time() - t0:.0f} s")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    mean = {c: statistics.mean(r[f"rel_excess_{c}_pct"] for r in rows) for c in CRITERIA}
    print(f"mean relative excess over all cases: k2 {mean['k2']:.4f} %, occupancy {mean['occupancy']:.4f} %",
          file=sys.stderr)


if __name__ == "__main__":
    main()
