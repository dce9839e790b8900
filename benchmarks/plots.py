#!/usr/bin/env python3
"""Render the benchmark results as PNG figures for README.md (matplotlib; pip extra ``plots``).

    python benchmarks/plots.py                       # benchmarks/data/results.json -> docs/*.png
    python benchmarks/plots.py --out /tmp/figures

The numbers come from ``benchmarks/data/results.json``, which records what the benchmark scripts printed
(each section names its command, hardware and date; ``benchmarks/RESULTS.md`` has the tables). Figures:

* ``loss_backends.png``: RNN-T loss forward+backward time and extra memory on CPU, asrprec's numba backend
  against torchaudio, per logits dtype;
* ``memory_per_policy.png``: activation memory saved for backward (measured), and the projected peak of a whole
  Zipformer-medium training step (fake tensors: a lower bound) for asrprec and icefall at the same batch by the same
  tool, part by part, with icefall's published measurements beside them;
* ``recipe_training.png``: the embedded recipe's validation loss per epoch and its test WER per precision policy;
* ``bf16_updates.png``: validation loss per epoch of the embedded recipe under the bf16 policy's weight updates
  (``--bf16-update``) against fp32 and amp-bf16, at reduced learning rates where bf16 rounding loses updates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = ("fp32", "amp-fp16", "amp-bf16", "bf16")
COLORS = dict(zip(POLICIES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("benchmarks/plots.py needs matplotlib: pip install 'asrprec[plots]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, source: str, bottom: float) -> Path:
    """Write ``fig`` to ``path`` with ``source`` (command, hardware, date) along its bottom edge."""
    fig.text(0.01, 0.01, source, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_backends(data: dict, out: Path) -> Path:
    plt = _pyplot()
    rows = data["rnnt_loss_cpu"]["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = {shape: chr(ord("A") + i) for i, shape in enumerate(shapes)}
    labels = [f"{r['dtype']}, {names[r['shape']]}" for r in rows]
    legend = "; ".join(f"{names[s]} = (B,T,U,V) {s}" for s in shapes)
    x = range(len(rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.bar([i - 0.2 for i in x], [r["numba_ms"] for r in rows], 0.4, label="asrprec numba")
    peers = [(i, r["torchaudio_ms"]) for i, r in zip(x, rows) if r["torchaudio_ms"]]
    ax_t.bar([i + 0.2 for i, _ in peers], [v for _, v in peers], 0.4, label="torchaudio")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("forward + backward (ms, log scale)")
    ax_t.set_title("RNN-T loss on CPU")
    ax_t.set_xticks(list(x), labels, fontsize=8)
    ax_t.legend()
    ax_m.bar(list(x), [r["extra_mb"] for r in rows], 0.5, color="tab:green")
    ax_m.set_ylabel("extra peak memory in forward+backward (MB)")
    ax_m.set_title("asrprec numba: extra memory = 1.0-1.05x the logits")
    ax_m.set_xticks(list(x), labels, fontsize=8)
    return _save(plt, fig, out / "loss_backends.png", f"{legend}. {data['rnnt_loss_cpu']['source']}", bottom=0.04)


def _bars_by_preset(ax, rows: list[dict], key: str = "mb") -> None:
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        xs, ys = [], []
        for i, preset in enumerate(presets):
            match = [r[key] for r in rows if r["preset"] == preset and r["policy"] == policy]
            if match:
                xs.append(i + (j - (len(policies) - 1) / 2) * width)
                ys.append(match[0])
        ax.bar(xs, ys, width, label=policy, color=COLORS[policy])
    ax.set_xticks(range(len(presets)), presets)
    ax.legend(fontsize=8)


def plot_memory(data: dict, out: Path) -> Path:
    plt = _pyplot()
    fig, (ax_a, ax_p) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1, 1.5]})
    _bars_by_preset(ax_a, data["activation_memory"]["rows"])
    ax_a.set_ylabel("saved for backward (MB)")
    ax_a.set_title("Zipformer activations, B=4 x 10 s (measured, CPU)")
    _step_memory_bars(ax_p, data["step_memory"])
    return _save(plt, fig, out / "memory_per_policy.png", "right: " + data["step_memory"]["source"], bottom=0.06)


STEP_PARTS = (("model + optimizer", ("parameters", "buffers", "master_weights", "master_gradients", "optimizer_state",
                                     "ddp_buckets", "inputs"), "tab:gray"),
              ("activations, gradients at the peak", ("activations_at_peak",), "tab:blue"),
              ("CUDA autocast extra", ("cuda_autocast_extra",), "tab:purple"))


def _step_memory_bars(ax, sm: dict) -> None:
    """Whole-step projected peak (stacked parts) for icefall and asrprec at the same batch, by the same tool,
    with icefall's published measurement beside each policy."""
    bars = []  # (label, parts dict or None, measured MB or None)
    for policy in POLICIES:
        if policy in sm["icefall"]:
            bars.append((f"icefall\n{policy}", sm["icefall"][policy], None))
        if policy in sm["icefall_measured_mb"]:
            bars.append((f"icefall\n{policy}\nmeasured", None, sm["icefall_measured_mb"][policy]))
        if policy in sm["asrprec"]:
            bars.append((f"asrprec\n{policy}", sm["asrprec"][policy], None))
    x = range(len(bars))
    labelled = set()
    for i, (_, parts, measured) in enumerate(bars):
        if parts is None:
            ax.bar(i, measured, 0.7, color="white", edgecolor="black", hatch="//",
                   label=None if "measured" in labelled else "icefall measured (PR #1700)")
            labelled.add("measured")
            continue
        bottom = 0.0
        for name, keys, color in STEP_PARTS:
            v = sum(parts[k] for k in keys) / 1e6
            ax.bar(i, v, 0.7, bottom=bottom, color=color, label=None if name in labelled else name)
            labelled.add(name)
            bottom += v
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("MB (10^6 bytes)")
    ax.set_title(f"Zipformer medium, whole training step: PROJECTED (lower bound)\n{sm['batch_label']}", fontsize=9)
    ax.legend(fontsize=7)


def plot_recipe(data: dict, out: Path) -> Path:
    plt = _pyplot()
    fig, (ax_l, ax_w) = plt.subplots(1, 2, figsize=(11, 4))
    for name, losses in data["recipe_valid_loss"]["runs"].items():
        ax_l.plot(range(1, len(losses) + 1), losses, marker="o", label=name)
    ax_l.set_xlabel("epoch")
    ax_l.set_ylabel("validation loss per frame")
    ax_l.set_title("Embedded recipe: validation loss")
    ax_l.legend(fontsize=8)
    rows = data["recipe_wer_by_policy"]["rows"]
    labels = [r["policy"] for r in rows]
    x = range(len(rows))
    ax_w.bar([i - 0.2 for i in x], [r["greedy"] for r in rows], 0.4, label="greedy")
    ax_w.bar([i + 0.2 for i in x], [r["beam4"] for r in rows], 0.4, label="modified beam search, beam 4")
    ax_w.set_xticks(list(x), labels)
    ax_w.set_ylabel("test WER (%)")
    ax_w.set_title("Embedded recipe: WER per precision policy")
    ax_w.legend(fontsize=8)
    return _save(plt, fig, out / "recipe_training.png", data["recipe_wer_by_policy"]["source"], bottom=0.04)


UPDATE_STYLES = {"fp32": ("tab:blue", "-"), "amp-bf16": ("tab:green", "-"), "bf16 master": ("tab:red", "-"),
                 "bf16 kahan": ("tab:purple", "--"), "bf16 stochastic": ("tab:orange", "-."),
                 "bf16 none": ("black", ":")}


def plot_bf16_updates(data: dict, out: Path) -> Path:
    plt = _pyplot()
    settings = data["bf16_updates"]["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for name, seeds in setting["runs"].items():
            color, style = UPDATE_STYLES.get(name, (None, "-"))
            first = setting.get("first_epoch", 1)  # 0: the starting model's loss comes first
            for i, (seed, losses) in enumerate(sorted(seeds.items())):
                ax.plot(range(first, first + len(losses)), losses, color=color, linestyle=style, marker="o", markersize=3,
                        label=name if i == 0 else None)
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("validation loss per frame")
        ax.set_title(setting["title"], fontsize=9)
        ax.legend(fontsize=8)
    return _save(plt, fig, out / "bf16_updates.png", data["bf16_updates"]["source"], bottom=0.05)


def plot_word_times(data: dict, out: Path) -> Path:
    plt = _pyplot()
    seeds = data["word_times"]["seeds"]
    methods = list(dict.fromkeys(r["method"] for rows in seeds.values() for r in rows))
    fig, axes = plt.subplots(1, len(seeds), figsize=(5.5 * len(seeds), 4), squeeze=False)
    measures = (("start_mean_ms", "|start| mean"), ("start_p90_ms", "|start| p90"), ("end_mean_ms", "|end| mean"),
                ("end_p90_ms", "|end| p90"))
    for ax, (seed, rows) in zip(axes[0], sorted(seeds.items())):
        by = {r["method"]: r for r in rows}
        for j, (key, label) in enumerate(measures):
            ax.bar([i + 0.2 * (j - 1.5) for i in range(len(methods))], [by[m][key] for m in methods], 0.2, label=label)
        ax.set_xticks(range(len(methods)), methods, fontsize=7, rotation=25, ha="right")
        ax.set_ylabel("error against the true boundary (ms)", fontsize=8)
        ax.set_title(f"corpus seed {seed}", fontsize=9)
        ax.legend(fontsize=8)
    return _save(plt, fig, out / "word_times.png", data["word_times"]["source"], bottom=0.2)


def plot_long_form(data: dict, out: Path) -> Path:
    plt = _pyplot()
    rows = data["long_form"]["rows"]
    fig, (ax_m, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for chunk in dict.fromkeys(r["chunk"] for r in rows):
        mine = sorted((r for r in rows if r["chunk"] == chunk), key=lambda r: r["minutes"])
        minutes = [r["minutes"] for r in mine]
        ax_m.plot(minutes, [r["rss_peak_mb"] - r["rss_base_mb"] for r in mine], marker="o", label=chunk)
        ax_r.plot(minutes, [r["duration_s"] / r.get("cpu_s", r["wall_s"]) for r in mine], marker="o", label=chunk)
    for ax, label in ((ax_m, "peak RSS above the loaded model (MB)"), (ax_r, "RTFx (CPU time)")):
        ax.set_xscale("log")
        ax.set_xlabel("recording length (minutes)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    return _save(plt, fig, out / "long_form.png", data["long_form"]["source"], bottom=0.06)


def render_all(results: Path, out: Path) -> list[Path]:
    data = json.loads(Path(results).read_text())
    out.mkdir(parents=True, exist_ok=True)
    return [plot_loss_backends(data, out), plot_memory(data, out), plot_recipe(data, out),
            plot_bf16_updates(data, out), plot_word_times(data, out), plot_long_form(data, out)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=HERE / "data" / "results.json")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs")
    args = p.parse_args()
    for path in render_all(args.results, args.out):
        print(path)


if __name__ == "__main__":
    main()
