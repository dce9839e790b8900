"""icefall checkpoints load exactly: the imported model reproduces what icefall's own code computed for the fixture
checkpoints (``shared/fixtures/icefall_zipformer``: random, perturbed weights; ``io.pt`` holds icefall's outputs,
eval mode, fp32), in both of icefall's checkpoint layouts; bad checkpoints fail with one error naming the key."""

import json
from pathlib import Path

import pytest
import torch

from asrprec.decoding import ctc_greedy_search, greedy_search
from asrprec.models import configure_streaming
from asrprec.models.icefall import (
    IcefallImportError, from_icefall, icefall_model_config, load_icefall, read_icefall_checkpoint,
)

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "icefall_zipformer"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"icefall fixtures not found at {FIXTURES} "
                                                                 "(they sit beside the repository, not in it)")
KINDS = ("offline", "causal")
LAYOUTS = ("epoch-1.pt", "pretrained.pt")
# the fixture READMEs: icefall's parameter counts (its unused per-layer bypass_scale included)
ICEFALL_PARAMS = {"offline": 1_586_030, "causal": 1_656_430}


def _load(kind, layout):
    folder = FIXTURES / kind
    # pretrained.pt holds weights only: icefall's flags come from the JSON file, as --icefall-args gives them
    args = folder / "icefall_args.json" if layout == "pretrained.pt" else None
    return from_icefall(folder / layout, args), torch.load(folder / "io.pt", weights_only=False)


def _close(got, want):
    """Max abs difference within 1e-4 of the reference's max abs."""
    assert got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"max abs diff {err:.3g} vs max abs {want.abs().max().item():.3g}"


def _valid(x, lens):
    """Zero the frames past each length (icefall leaves whatever its padding computes there)."""
    mask = torch.arange(x.shape[1])[None, :] < lens[:, None]
    return x * mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_imported_model_computes_what_icefall_computed(kind, layout):
    model, io = _load(kind, layout)
    if kind == "causal":  # the fixture's flags have one chunk size and left context, which icefall's eval uses
        configure_streaming(model, 16, 64)
    with torch.no_grad():
        enc, enc_lens = model.encode(io["x"], io["x_lens"])
        assert enc_lens.tolist() == io["encoder_out_lens"].tolist()
        _close(_valid(enc, enc_lens), _valid(io["encoder_out"], enc_lens))
        ref_enc = io["encoder_out"]  # the heads are checked on icefall's own encoder output
        _close(model.predict(io["decoder_in"]), io["decoder_out"])
        _close(model.join(ref_enc[:, :, None], io["decoder_out"][:, None]), io["joiner_logits"])
        _close(model.simple_am_proj(ref_enc), io["simple_am"])
        _close(model.simple_lm_proj(io["decoder_out"]), io["simple_lm"])
        _close(_valid(model.ctc_log_probs(ref_enc), enc_lens), _valid(io["ctc_log_probs"], enc_lens))
        # icefall's greedy_search_batch: at most one symbol per frame
        assert greedy_search(model, enc, enc_lens, max_sym_per_frame=1) == io["greedy_hyps"]


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_count_is_icefalls_less_the_unused_bypass_scales(kind):
    state, _ = read_icefall_checkpoint(FIXTURES / kind / "epoch-1.pt")
    assert sum(v.numel() for v in state.values()) == ICEFALL_PARAMS[kind]
    unused = sum(v.numel() for k, v in state.items() if k.endswith(".bypass_scale")
                 and not k.endswith(("bypass.bypass_scale", "bypass_mid.bypass_scale", "out_combiner.bypass_scale")))
    model, _ = _load(kind, "epoch-1.pt")
    assert sum(p.numel() for p in model.parameters()) == ICEFALL_PARAMS[kind] - unused


def test_both_layouts_give_the_same_model_config():
    for kind in KINDS:
        folder = FIXTURES / kind
        a = icefall_model_config(*read_icefall_checkpoint(folder / "epoch-1.pt"))
        b = icefall_model_config(*read_icefall_checkpoint(folder / "pretrained.pt", folder / "icefall_args.json"))
        assert a == b
        assert a["encoder_overrides"]["causal"] is (kind == "causal")
        assert a["vocab_size"] == 50 and a["decoder_dim"] == 64 and a["joiner_dim"] == 64 and "ctc" in a


def test_ctc_greedy_of_imported_model_runs_on_icefalls_log_probs():
    model, io = _load("offline", "epoch-1.pt")
    hyps = ctc_greedy_search(io["ctc_log_probs"], io["encoder_out_lens"])
    with torch.no_grad():
        ours = ctc_greedy_search(model.ctc_log_probs(io["encoder_out"]), io["encoder_out_lens"])
    assert ours == hyps


def _save_variant(tmp_path, change):
    ckpt = torch.load(FIXTURES / "offline" / "epoch-1.pt", weights_only=False)
    change(ckpt["model"])
    path = tmp_path / "epoch-1.pt"
    torch.save(ckpt, path)
    return path


def test_unknown_key_is_named(tmp_path):
    path = _save_variant(tmp_path, lambda sd: sd.__setitem__("attention_decoder.embed.weight", torch.zeros(3, 4)))
    with pytest.raises(IcefallImportError, match=r"unknown key 'attention_decoder\.embed\.weight' \(an "
                                                 r"attention-decoder head"):
        from_icefall(path)


def test_shape_mismatch_is_named(tmp_path):
    def widen(sd):
        sd["encoder.encoders.0.layers.0.feed_forward1.in_proj.weight"] = torch.zeros(80, 64)
    with pytest.raises(IcefallImportError, match=r"'encoder\.encoders\.0\.layers\.0\.feed_forward1\.in_proj\.weight' "
                                                 r"has shape \(80, 64\) but the model built from the icefall flags "
                                                 r"has \(72, 64\)"):
        from_icefall(_save_variant(tmp_path, widen))


def test_pretrained_without_flags_takes_icefalls_defaults_and_names_the_mismatch():
    # the fixture is smaller than icefall's default (medium) model: the first differing tensor is named
    with pytest.raises(IcefallImportError, match=r"has shape .* Fix: give the flags the model was trained with"):
        from_icefall(FIXTURES / "offline" / "pretrained.pt")


def test_flags_that_contradict_the_weights_are_refused():
    with pytest.raises(IcefallImportError, match=r"say vocab_size=500 but the weights have vocab_size=50"):
        load_icefall(FIXTURES / "offline" / "pretrained.pt", {**json.loads(
            (FIXTURES / "offline" / "icefall_args.json").read_text()), "vocab_size": 500})


def test_attention_decoder_flag_is_refused():
    with pytest.raises(IcefallImportError, match=r"attention-decoder head .* without --use-attention-decoder"):
        load_icefall(FIXTURES / "offline" / "epoch-1.pt", {"use_attention_decoder": True})


def test_not_an_icefall_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(IcefallImportError, match=r"has no 'model' state dict"):
        from_icefall(tmp_path / "x.pt")
    data = (FIXTURES / "offline" / "pretrained.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(IcefallImportError, match=r"cannot be read safely .* the download is complete"):
        from_icefall(tmp_path / "cut.pt")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        from_icefall(tmp_path / "missing.pt")


def test_benchmark_writer_gives_back_icefalls_layout():
    # benchmarks/icefall_layout.py writes an asrprec run as icefall's pretrained.pt: imported and written back, the
    # fixture's keys and tensors return (the unused bypass scales at icefall's initial 0.5)
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "icefall_layout.py"
    spec = importlib.util.spec_from_file_location("icefall_layout", path)
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    original, _ = read_icefall_checkpoint(FIXTURES / "causal" / "epoch-1.pt")
    model, config = load_icefall(FIXTURES / "causal" / "epoch-1.pt")
    back = layout.icefall_state_dict(model.state_dict())
    assert sorted(back) == sorted(original)
    for k, v in original.items():
        unused = k.endswith(".bypass_scale") and not k.endswith(("bypass.bypass_scale", "bypass_mid.bypass_scale",
                                                                  "out_combiner.bypass_scale"))
        assert torch.equal(back[k], torch.full_like(v, 0.5) if unused else v), k
    flags = layout.icefall_flags(config)
    fixture_flags = json.loads((FIXTURES / "causal" / "icefall_args.json").read_text())
    assert {k: str(v) for k, v in flags.items()} == {k: str(fixture_flags[k]) for k in flags}
