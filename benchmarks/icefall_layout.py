#!/usr/bin/env python3
"""Write an asrprec Zipformer checkpoint in icefall's export.py layout (``pretrained.pt``: ``{"model": state_dict}``)
with icefall's train.py flags beside it (``icefall_args.json``), for the fine-tuning rows of benchmarks/RESULTS.md:
icefall's published checkpoints cannot be downloaded where those rows are measured, so a model trained here in
icefall's architecture (its (8, 32, 128) front-end, six stacks, padding as icefall pads) stands in for one, and
``--init-from icefall:PATH`` then imports it as it would import icefall's own.

    python benchmarks/icefall_layout.py --exp-dir EXP --epoch 4 --out /tmp/icefall/pretrained.pt

The inverse of :func:`asrprec.models.icefall.load_icefall_weights`: ``encoder.encoder_embed.*`` and
``encoder.encoder.*`` lose their first ``encoder.``, and every layer gets icefall's unused ``bypass_scale`` (0.5, its
initial value; icefall's forward never reads it).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from asrprec.atomic import atomic_write_text
from asrprec.checkpoint import atomic_torch_save, read_checkpoint
from asrprec.experiment import read_model_config

_LAYER = re.compile(r"^(encoder\.encoders\.\d+\.(?:encoder\.)?layers\.\d+)\.bypass\.bypass_scale$")


def icefall_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = key[len("encoder."):] if key.startswith(("encoder.encoder_embed.", "encoder.encoder.")) else key
        out[name] = value
        layer = _LAYER.match(name)
        if layer:
            out[f"{layer.group(1)}.bypass_scale"] = torch.full_like(value, 0.5)
    return out


def icefall_flags(model_config: dict) -> dict:
    o = model_config["encoder_overrides"]
    joined = {k: ",".join(str(v) for v in o[k]) for k in (
        "num_encoder_layers", "downsampling_factor", "feedforward_dim", "num_heads", "encoder_dim",
        "encoder_unmasked_dim", "cnn_module_kernel", "query_head_dim", "value_head_dim", "pos_head_dim")}
    flags = {**joined, "pos_dim": o["pos_dim"], "causal": bool(o.get("causal", False)),
             "use_transducer": model_config.get("use_transducer", True), "use_ctc": "ctc" in model_config,
             "vocab_size": model_config["vocab_size"], "context_size": model_config.get("context_size", 2)}
    if flags["causal"]:
        flags.update(chunk_size=",".join(map(str, o["chunk_size"])),
                     left_context_frames=",".join(map(str, o["left_context_frames"])))
    return flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp-dir", type=Path, required=True)
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="pretrained.pt to write (icefall_args.json beside it)")
    args = p.parse_args()
    config = read_model_config(args.exp_dir)
    o = config["encoder_overrides"]
    if config["encoder"] != "zipformer" or tuple(o["frontend_channels"]) != (8, 32, 128) or o.get(
            "padding_invariant", True) or o.get("convnext_hidden_ratio", 3) != 3:
        raise SystemExit("error: the run is not in icefall's architecture (a Zipformer with frontend_channels "
                         "8,32,128, the ConvNeXt, padding_invariant false)")
    state = read_checkpoint(args.exp_dir / f"epoch-{args.epoch}.pt")["model"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"model": icefall_state_dict(state)}, args.out)
    atomic_write_text(args.out.parent / "icefall_args.json", json.dumps(icefall_flags(config), indent=1))
    print(f"wrote {args.out} and {args.out.parent / 'icefall_args.json'}")


if __name__ == "__main__":
    main()
