"""decode.py's route for an icefall checkpoint (``DecodeConfig(init_from="icefall:FILE")``): every transducer and CTC
method runs on the imported model, and greedy search gives the hypotheses icefall's own greedy_search_batch gave
(``shared/fixtures/icefall_zipformer/*/io.pt``)."""

from pathlib import Path

import pytest
import torch

from asrprec.decoding import ctc_greedy_search, decode_dataset
from asrprec.decoding.experiment import DecodeConfig, load_for_decoding
from asrprec.precision import PrecisionOptions

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "icefall_zipformer"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"icefall fixtures not found at {FIXTURES}")


class Tok:
    """Each id as its own word, so word lists give back the token ids."""

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def _batches(io):
    return [{"features": io["x"], "feature_lens": io["x_lens"], "texts": ["1 2"] * len(io["x_lens"]),
             "cut_ids": [f"u{i}" for i in range(len(io["x_lens"]))]}]


def _decode(tmp_path, kind, method, **kw):
    folder = FIXTURES / kind
    cfg = DecodeConfig(init_from=f"icefall:{folder / 'pretrained.pt'}", icefall_args=str(folder / "icefall_args.json"),
                       decoding_method=method, beam_size=2, **kw)
    setup = load_for_decoding(tmp_path / "exp", cfg, PrecisionOptions(device="cpu"))
    assert setup.tag.startswith(f"{method}-icefall-pretrained-fp32")
    io = torch.load(folder / "io.pt", weights_only=False)
    results, _ = decode_dataset(setup.model, _batches(io), Tok(), cfg.search(), "cpu")
    return [[int(w) for w in hyp] for _, _, hyp in results], io


@pytest.mark.parametrize("kind,chunking", [("offline", {}),
                                           ("causal", {"chunk_size": 16, "left_context_frames": 64})])
def test_greedy_search_of_an_icefall_checkpoint_gives_icefalls_hypotheses(tmp_path, kind, chunking):
    hyps, io = _decode(tmp_path, kind, "greedy_search", **chunking)
    assert hyps == io["greedy_hyps"]


@pytest.mark.parametrize("method", ["modified_beam_search", "ctc_greedy_search", "ctc_prefix_beam_search"])
def test_every_method_decodes_an_icefall_checkpoint(tmp_path, method):
    hyps, io = _decode(tmp_path, "offline", method)
    assert len(hyps) == len(io["x_lens"])
    if method == "ctc_greedy_search":  # icefall's CTC log-probs, searched by asrprec's CTC greedy search
        assert hyps == ctc_greedy_search(io["ctc_log_probs"], io["encoder_out_lens"])


def test_decode_config_requires_epoch_or_icefall():
    with pytest.raises(ValueError, match="--epoch is required"):
        DecodeConfig().require_weights()
    DecodeConfig(init_from="icefall:x.pt").require_weights()
