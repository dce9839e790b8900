"""Import icefall's Zipformer2 checkpoints: :func:`from_icefall` returns an asrprec model that computes what
icefall's ``AsrModel`` computes (transducer, CTC or both; offline or causal).

icefall (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/``) saves two layouts:

* ``epoch-N.pt`` / ``checkpoint-N.pt`` from ``train.py``: ``{"model": state_dict, "optimizer": ..., ...}`` with
  train.py's params (its flags) beside the weights (``icefall/checkpoint.py`` ``save_checkpoint``);
* ``pretrained.pt`` from ``export.py``: ``{"model": state_dict}`` only. Its flags come from ``args`` (a dict, or a
  JSON file of train.py's flag names: ``{"num_encoder_layers": "2,2,3,4,3,2", ...}``); those not given take
  train.py's defaults (the "medium" model), and the head sizes are read off the weights.

The parameter names are asrprec's with the encoder one level down (icefall's ``encoder_embed.*`` and ``encoder.*``
are asrprec's ``encoder.encoder_embed.*`` and ``encoder.encoder.*``). icefall's ``Zipformer2EncoderLayer`` also holds
a ``bypass_scale`` its forward never reads (the one it uses is ``bypass.bypass_scale``); it is dropped by name.
Any other key asrprec does not know (an attention-decoder head, for one) is refused, naming it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from asrprec.errors import AsrprecError

if TYPE_CHECKING:
    from .options import ModelOptions

__all__ = ["ICEFALL_PREFIX", "IcefallImportError", "from_icefall", "icefall_args_option", "icefall_model_config",
           "icefall_training_model", "load_icefall", "load_icefall_weights", "parse_icefall_source",
           "read_icefall_checkpoint"]

#: ``--init-from icefall:PATH`` (train.py, decode.py, export.py) names an icefall checkpoint
ICEFALL_PREFIX = "icefall:"

# k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py, add_model_arguments() and get_params(): the defaults of
# every flag that shapes the model (the "medium" Zipformer of RESULTS.md)
ICEFALL_DEFAULTS: dict[str, Any] = {
    "num_encoder_layers": "2,2,3,4,3,2", "downsampling_factor": "1,2,4,8,4,2",
    "feedforward_dim": "512,768,1024,1536,1024,768", "num_heads": "4,4,4,8,4,4",
    "encoder_dim": "192,256,384,512,384,256", "query_head_dim": "32", "value_head_dim": "12", "pos_head_dim": "4",
    "pos_dim": 48, "encoder_unmasked_dim": "192,192,256,256,256,192", "cnn_module_kernel": "31,31,15,15,15,31",
    "decoder_dim": 512, "joiner_dim": 512, "causal": False, "chunk_size": "16,32,64,-1",
    "left_context_frames": "64,128,256,-1", "use_transducer": True, "use_ctc": False,
    "use_attention_decoder": False, "context_size": 2, "blank_id": 0, "feature_dim": 80, "subsampling_factor": 4,
    "vocab_size": 500,
}

# icefall flags that need another head or input than asrprec builds
_UNSUPPORTED = {
    "use_attention_decoder": "the attention-decoder head (icefall's --use-attention-decoder), which asrprec has not",
}
# the unused per-layer parameter (stack N's layer M; a downsampled stack's layers sit under ``.encoder``)
_UNUSED = re.compile(r"^encoder\.encoders\.\d+\.(?:encoder\.)?layers\.\d+\.bypass_scale$")
_MAPPED_PREFIXES = ("encoder_embed.", "encoder.")
_KEPT_PREFIXES = ("decoder.", "joiner.", "simple_am_proj.", "simple_lm_proj.", "ctc_output.")


class IcefallImportError(AsrprecError, ValueError):
    """An icefall checkpoint asrprec cannot import as asked (the message names the key or flag and the fix)."""


def icefall_args_option() -> Any:
    """The ``--icefall-args`` field of the train, decode and export configs (one declaration, one help text)."""
    from asrprec.config import option

    return option("", metavar="JSON", help="with icefall:FILE: icefall's train.py flags (JSON file or object)")


def parse_icefall_source(text: str) -> str | None:
    """The checkpoint path of ``icefall:PATH``, or None for any other ``--init-from`` value."""
    if not text.startswith(ICEFALL_PREFIX):
        return None
    path = text[len(ICEFALL_PREFIX):]
    if not path:
        raise IcefallImportError("--init-from icefall: names no file. Fix: --init-from icefall:PATH/TO/pretrained.pt")
    return path


def _read_args(args: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return dict(args)
    text = str(args)
    path = Path(text)
    try:
        value = json.loads(path.read_text() if path.is_file() else text)
    except json.JSONDecodeError as e:
        raise IcefallImportError(f"icefall args {text!r} are not valid JSON ({e}). Fix: a JSON file or object of "
                                 "icefall's train.py flags, e.g. '{\"causal\": true, \"chunk_size\": \"16\"}'") from None
    if not isinstance(value, dict):
        raise IcefallImportError(f"icefall args {text!r} are not a JSON object of train.py flags")
    return value


def read_icefall_checkpoint(path: str | os.PathLike,
                            args: Mapping[str, Any] | str | os.PathLike | None = None) -> tuple[dict, dict]:
    """``(state_dict, flags)`` of an icefall checkpoint: the flags saved beside the weights (train.py's layouts),
    updated by ``args`` (a dict or a JSON file / string of train.py flag names).

    Raises:
        FileNotFoundError: no such file. IcefallImportError: not an icefall checkpoint (no ``"model"`` state dict).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"icefall checkpoint {path} does not exist. Fix: pass icefall's epoch-N.pt, "
                                "checkpoint-N.pt or pretrained.pt (icefall:PATH)")
    # icefall's train.py params hold paths (exp_dir, bpe_model, ...): allowed, and nothing else beyond tensors
    with torch.serialization.safe_globals([pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
                                           pathlib.PureWindowsPath]):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle / zip errors come in many types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise IcefallImportError(f"icefall checkpoint {path} cannot be read safely ({type(e).__name__}: {first}). "
                                     "Fix: check that the download is complete; a file holding other Python objects "
                                     "than tensors and paths is refused") from None
    state = ckpt.get("model") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not state:
        raise IcefallImportError(f"{path} is not an icefall checkpoint: it has no 'model' state dict (keys: "
                                 f"{sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__}). Fix: pass "
                                 "icefall's epoch-N.pt, checkpoint-N.pt or pretrained.pt")
    flags = {k: v for k, v in ckpt.items() if k in ICEFALL_DEFAULTS or k in _UNSUPPORTED}
    flags.update(_read_args(args))
    return {k: v for k, v in state.items() if torch.is_tensor(v)}, flags


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        items = value
    else:
        items = str(value).split(",")
    try:
        return tuple(int(v) for v in items)
    except ValueError:
        raise IcefallImportError(f"icefall flag {name}={value!r} is not a comma-separated list of integers") from None


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise IcefallImportError(f"icefall flag {name}={value!r} is not a boolean")


def _head_sizes(state: Mapping[str, torch.Tensor], flags: dict[str, Any]) -> dict[str, Any]:
    """Head sizes read off the weights where they are (a ``pretrained.pt`` carries no flags)."""
    found: dict[str, Any] = {}
    if "decoder.embedding.weight" in state:
        found["vocab_size"], found["decoder_dim"] = state["decoder.embedding.weight"].shape
        found["context_size"] = state["decoder.conv.weight"].shape[-1] if "decoder.conv.weight" in state else 1
    elif "ctc_output.1.weight" in state:
        found["vocab_size"] = state["ctc_output.1.weight"].shape[0]
    if "joiner.encoder_proj.weight" in state:
        found["joiner_dim"] = state["joiner.encoder_proj.weight"].shape[0]
    found["use_transducer"] = "decoder.embedding.weight" in state
    found["use_ctc"] = "ctc_output.1.weight" in state
    for k, v in found.items():
        if k not in flags:
            continue
        given = _bool(k, flags[k]) if isinstance(v, bool) else _ints(k, flags[k])
        if given != (v if isinstance(v, bool) else (int(v),)):
            raise IcefallImportError(f"the icefall flags say {k}={flags[k]!r} but the weights have {k}={v}. Fix: "
                                     f"correct {k} in the icefall args (or leave it out: it is read off the weights)")
    return {k: int(v) if not isinstance(v, bool) else v for k, v in found.items()}


def icefall_model_config(state: Mapping[str, torch.Tensor], flags: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`~asrprec.models.build_transducer` arguments (asrprec's ``model.json``) of an icefall model.

    ``flags`` are icefall's train.py flags (missing ones take its defaults; head sizes come from ``state``).

    Raises:
        IcefallImportError: a flag asrprec cannot build (an attention decoder, features other than 80-dim fbank,
            another subsampling), naming it.
    """
    for name, what in _UNSUPPORTED.items():
        if name in flags and _bool(name, flags[name]):
            raise IcefallImportError(f"the icefall model has {what}. Fix: export or train it without "
                                     f"--{name.replace('_', '-')}")
    f = {**ICEFALL_DEFAULTS, **dict(flags), **_head_sizes(state, flags)}
    if int(f["feature_dim"]) != 80 or int(f["subsampling_factor"]) != 4:
        raise IcefallImportError(f"the icefall model takes feature_dim={f['feature_dim']} with subsampling_factor="
                                 f"{f['subsampling_factor']}; asrprec's Zipformer takes 80-dim fbank subsampled 4x "
                                 "(icefall's LibriSpeech setup)")
    causal = _bool("causal", f["causal"])
    overrides: dict[str, Any] = {
        name: list(_ints(name, f[name])) for name in (
            "num_encoder_layers", "downsampling_factor", "feedforward_dim", "num_heads", "encoder_dim",
            "encoder_unmasked_dim", "cnn_module_kernel", "query_head_dim", "value_head_dim", "pos_head_dim")}
    overrides["pos_dim"] = int(f["pos_dim"])
    # icefall's front-end (8, 32, 128 channels, a ConvNeXt) and dropout schedule: the medium preset's own values
    overrides["causal"] = causal
    # icefall's front-end and downsampling let padded frames reach an utterance's last frames; computing what
    # icefall computes means doing the same (asrprec's own models are padding-invariant)
    overrides["padding_invariant"] = False
    if causal:
        overrides["chunk_size"] = list(_ints("chunk_size", f["chunk_size"]))
        overrides["left_context_frames"] = list(_ints("left_context_frames", f["left_context_frames"]))
    use_transducer, use_ctc = _bool("use_transducer", f["use_transducer"]), _bool("use_ctc", f["use_ctc"])
    if not use_transducer and not use_ctc:
        raise IcefallImportError("the icefall checkpoint has neither a transducer (decoder.*, joiner.*) nor a CTC "
                                 "head (ctc_output.*)")
    config: dict[str, Any] = {"encoder": "zipformer", "size": "medium", "vocab_size": int(f["vocab_size"]),
                              "blank_id": int(f["blank_id"]), "context_size": int(f["context_size"]),
                              "decoder_dim": int(f["decoder_dim"]), "joiner_dim": int(f["joiner_dim"]),
                              "encoder_overrides": overrides}
    if not use_transducer:
        config["use_transducer"] = False
    if use_ctc:
        config["ctc"] = {}
    return config


def _map_key(key: str) -> str | None:
    """asrprec's name of icefall's parameter ``key``; None for the unused bypass scale; the key itself when it is
    not a known prefix (then refused by :func:`load_icefall_weights`)."""
    if _UNUSED.match(key):
        return None
    if key.startswith(_MAPPED_PREFIXES):
        return "encoder." + key
    return key


def load_icefall_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load icefall's ``state`` into an asrprec ``model`` built from :func:`icefall_model_config`.

    Raises:
        IcefallImportError: a key asrprec does not know (named, with its icefall name), a parameter the checkpoint
            lacks, or a shape that differs (named, both shapes, and the flag to check).
    """
    target = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = _map_key(key)
        if name is None:
            continue
        if name not in target:
            hint = (" (an attention-decoder head, which asrprec has not)" if key.startswith("attention_decoder.")
                    else "")
            raise IcefallImportError(f"icefall checkpoint {source}: unknown key {key!r}{hint}. asrprec imports "
                                     "icefall's Zipformer2 transducer and CTC heads only; export the model without "
                                     "that part")
        if tuple(value.shape) != tuple(target[name].shape):
            raise IcefallImportError(
                f"icefall checkpoint {source}: {key!r} has shape {tuple(value.shape)} but the model built from the "
                f"icefall flags has {tuple(target[name].shape)}. Fix: give the flags the model was trained with "
                "(--icefall-args JSON: num_encoder_layers, encoder_dim, feedforward_dim, num_heads, ...)")
        mapped[name] = value
    missing = sorted(set(target) - set(mapped))
    if missing:
        raise IcefallImportError(f"icefall checkpoint {source} lacks {len(missing)} parameter(s) the model built from "
                                 f"its flags has, e.g. {missing[:3]}. Fix: give the flags the model was trained with "
                                 "(--icefall-args JSON)")
    with torch.no_grad():
        for name, value in mapped.items():
            target[name].copy_(value)


def load_icefall(path: str | os.PathLike, args: Mapping[str, Any] | str | os.PathLike | None = None,
                 ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, model_config)``: the asrprec model of an icefall checkpoint in fp32 and eval mode, with its
    weights, and its ``model.json`` record. See :func:`from_icefall`."""
    from .builders import build_transducer

    state, flags = read_icefall_checkpoint(path, args)
    config = icefall_model_config(state, flags)
    model = build_transducer(**config)
    load_icefall_weights(model, state, source=str(path))
    return model.float().eval(), config


def from_icefall(path: str | os.PathLike, args: Mapping[str, Any] | str | os.PathLike | None = None,
                 ) -> torch.nn.Module:
    """The asrprec model (fp32, eval mode) that computes what the icefall Zipformer2 checkpoint ``path`` computes.

    Args:
        path: icefall's ``epoch-N.pt`` / ``checkpoint-N.pt`` (train.py: flags beside the weights) or
            ``pretrained.pt`` (export.py: weights only).
        args: icefall's train.py flags (a dict, or a JSON file or string), overriding the saved ones; flags found
            nowhere take train.py's defaults. A causal model's ``chunk_size`` / ``left_context_frames`` lists are
            what it trains on; decoding fixes one of each (:func:`asrprec.models.configure_streaming`).

    Raises:
        FileNotFoundError, CheckpointReadError: the file is missing or unreadable.
        IcefallImportError: an unknown key, a shape mismatch, or a flag asrprec cannot build, each named.
    """
    return load_icefall(path, args)[0]


def icefall_training_model(path: str | os.PathLike, args: Mapping[str, Any] | str | os.PathLike | None,
                           options: "ModelOptions", vocab_size: int, *, time_warp_factor: int | None = None,
                           features_mask_size: int | None = None,
                           **kwargs: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, model_config)`` to fine-tune an icefall checkpoint: its architecture and heads, with the
    objective's settings of ``options`` (loss, prune range, warm-up, CTC / CR-CTC scales). The weights are fresh:
    the training loop loads them (:func:`load_icefall_weights`) unless it resumes.

    Raises:
        IcefallImportError: as :func:`icefall_model_config`; a tokenizer of another vocabulary size; ``--loss tdt``
            (icefall's joiner has no duration head).
    """
    import dataclasses

    from .builders import build_transducer, resolved_encoder_overrides
    from .transducer import LossConfig

    state, flags = read_icefall_checkpoint(path, args)
    config = icefall_model_config(state, flags)
    if config["vocab_size"] != vocab_size:
        raise IcefallImportError(f"the tokenizer has {vocab_size} pieces but the icefall model {path} has "
                                 f"vocab_size={config['vocab_size']}. Fix: train with icefall's bpe.model "
                                 "(--bpe-model PATH/TO/bpe.model)")
    if options.loss == "tdt":
        raise IcefallImportError("--loss tdt needs a joiner with a duration head, which an icefall model has not. "
                                 "Fix: --loss pruned (icefall's) or full")
    has_ctc = config.pop("ctc", None) is not None
    if options.use_cr_ctc and not has_ctc:
        raise IcefallImportError(f"--use-cr-ctc needs a CTC head, which the icefall model {path} has not. Fix: "
                                 "drop --use-cr-ctc")
    ctc = dataclasses.replace(options, use_ctc=True).ctc_config(time_warp_factor, features_mask_size) \
        if has_ctc else None
    loss = {"loss": options.loss, "joint_mode": options.joint_mode, "backend": options.loss_backend,
            "prune_range": options.prune_range}
    model = build_transducer(**config, ctc=ctc, **kwargs,
                             loss=LossConfig(**loss, loss_warmup_batches=options.loss_warmup_batches))
    config = {**config, "encoder_overrides": resolved_encoder_overrides(model), "loss": loss}
    if ctc is not None:
        config["ctc"] = ctc.record()
    return model, config
