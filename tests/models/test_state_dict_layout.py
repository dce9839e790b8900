"""Checkpoints written by earlier versions still load: every preset's state dict keeps its parameter and
buffer names and shapes.

``data/state_dict_layout.json`` is the checkpoint format of asrprec 0.1.0 (the layout existing ``epoch-N.pt``
files have): full ``name shape`` lists of the tiny presets and the transducer heads, and a sha256 of the list of
every larger preset. A refactor that renames a module or a parameter changes it and fails here; a deliberate
format change needs a checkpoint converter, not a new fixture.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from asrprec.models import build_encoder, build_transducer

LAYOUT = json.loads((Path(__file__).parent / "data" / "state_dict_layout.json").read_text())


def _lines(sd):
    return sorted(f"{k} {'x'.join(map(str, v.shape)) or '()'}" for k, v in sd.items())


def _build(name):
    enc, size, *opts = name.split("/")
    overrides = {}
    for opt in opts:
        key, value = opt.split("=")
        overrides[key] = json.loads(value.lower())
    with torch.device("meta"):  # names and shapes only: no memory, no initialisation cost
        return build_encoder(enc, size, **overrides)


@pytest.mark.parametrize("name", sorted(LAYOUT["digest"]))
def test_encoder_state_dict_layout_is_unchanged(name):
    lines = _lines(_build(name).state_dict())
    if name in LAYOUT["full"]:
        want = LAYOUT["full"][name]
        assert lines == want, (f"missing: {sorted(set(want) - set(lines))[:10]}, "
                               f"new: {sorted(set(lines) - set(want))[:10]}")
    got = {"keys": len(lines), "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}
    assert got == LAYOUT["digest"][name]


@pytest.mark.parametrize("encoder", ["conformer", "zipformer"])
def test_transducer_head_layout_is_unchanged(encoder):
    with torch.device("meta"):
        model = build_transducer(encoder=encoder, size="tiny", vocab_size=500)
    lines = [line for line in _lines(model.state_dict()) if not line.startswith("encoder.")]
    assert lines == LAYOUT["full"][f"transducer/{encoder}/tiny/heads"]
