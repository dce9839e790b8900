"""A sentencepiece tokenizer whose id 0 is the transducer blank.

Id layout (as icefall's ``local/train_bpe_model.py``, minus its ``<sos/eos>``): the user-defined
symbol ``<blk>`` takes id 0, ``<unk>`` is id 1, and there is no bos/eos/pad. The blank is thus a real
sentencepiece piece (not a shift of the ids), so model files stay compatible with plain
sentencepiece tools; :meth:`Tokenizer.encode` refuses text that would produce it and
:meth:`Tokenizer.decode` drops it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable, Sequence

from asrprec.atomic import atomic_write_text

log = logging.getLogger(__name__)

BLANK = "<blk>"
BLANK_ID = 0
UNK_ID = 1


class Tokenizer:
    """Wraps a trained sentencepiece model. ``vocab_size`` counts every id, the blank included."""

    def __init__(self, model_path: Path | str) -> None:
        import sentencepiece as spm

        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(f"no sentencepiece model at {model_path}; fix: train one with Tokenizer.train(texts, prefix, vocab_size)")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))
        if self.sp.id_to_piece(BLANK_ID) != BLANK:
            raise ValueError(
                f"{model_path} does not map {BLANK!r} to id {BLANK_ID} (id 0 is {self.sp.id_to_piece(BLANK_ID)!r}); "
                f"fix: retrain it with Tokenizer.train, which reserves id 0 for the blank"
            )

    # ------------------------------------------------------------------ training
    @classmethod
    def train(
        cls,
        texts: Iterable[str] | Path | str,
        model_prefix: Path | str,
        vocab_size: int,
        *,
        model_type: str = "bpe",
        overwrite: bool = False,
    ) -> "Tokenizer":
        """Train on ``texts`` (an iterable of transcripts, or the path of a text file with one per line).

        Writes ``<model_prefix>.model``, ``.vocab`` and ``.json`` (the training settings and a hash of the
        texts). Unless ``overwrite``, an existing model trained with the same settings on the same texts is
        reused. ``vocab_size`` counts the blank and ``<unk>``.
        """
        import sentencepiece as spm

        if model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4 (blank, unk and some pieces), got {vocab_size}")
        if isinstance(texts, (str, Path)):
            path = Path(texts)
            if not path.is_file():
                raise FileNotFoundError(f"text file {path} does not exist (pass a list of strings to train on texts directly)")
            lines = path.read_text(encoding="utf-8").splitlines()
        else:
            lines = list(texts)
        lines = [t.strip() for t in lines if t and t.strip()]
        if not lines:
            raise ValueError("no non-empty texts to train the tokenizer on")
        if any(BLANK in t for t in lines):
            raise ValueError(f"training texts contain the reserved blank symbol {BLANK!r}; remove it from the transcripts")

        model_prefix = Path(model_prefix)
        model_path = model_prefix.with_name(model_prefix.name + ".model")
        meta_path = model_prefix.with_name(model_prefix.name + ".json")
        digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()
        meta = {"vocab_size": vocab_size, "model_type": model_type, "texts_sha256": digest, "num_texts": len(lines)}
        if not overwrite and model_path.is_file() and meta_path.is_file():
            try:
                if json.loads(meta_path.read_text()) == meta:
                    log.info("tokenizer %s is up to date; not retraining", model_path)
                    return cls(model_path)
            except json.JSONDecodeError:
                pass
        model_prefix.parent.mkdir(parents=True, exist_ok=True)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_prefix=str(model_prefix),
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=1.0,
                user_defined_symbols=[BLANK],  # takes the first free id, 0, because unk is moved to 1
                unk_id=UNK_ID,
                bos_id=-1,
                eos_id=-1,
                pad_id=-1,
                num_threads=1,
                minloglevel=2,
            )
        except RuntimeError as e:
            if "vocab" in str(e).lower():
                raise ValueError(
                    f"vocab_size={vocab_size} is too large for these texts ({e}); fix: choose a smaller vocab_size"
                ) from e
            raise
        atomic_write_text(meta_path, json.dumps(meta, indent=1))
        return cls(model_path)

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    @property
    def blank_id(self) -> int:
        return BLANK_ID

    @property
    def unk_id(self) -> int:
        return int(self.sp.unk_id())

    def encode(self, texts: Sequence[str] | str) -> list[list[int]]:
        """Token ids of each text (a single string is treated as a list of one). Never contains the blank id."""
        if isinstance(texts, str):
            texts = [texts]
        ids = self.sp.encode(list(texts), out_type=int)
        for text, row in zip(texts, ids):
            if BLANK_ID in row:
                raise ValueError(f"text {text!r} contains the reserved blank symbol {BLANK!r}; remove it from the transcript")
        return ids

    def count_tokens(self, text: str) -> int:
        """The number of tokens ``text`` encodes to."""
        return len(self.encode([text])[0])

    def unknown_words(self, words: Iterable[str]) -> list[str]:
        """The words among ``words`` that this tokenizer can only spell with ``<unk>`` (a piece it lacks), or that
        contain the reserved blank symbol (which :meth:`encode` refuses).

        A word's pieces are the same inside a sentence as alone (sentencepiece splits on whitespace first), so
        a transcript trains on ``<unk>`` exactly when it contains one of these words.
        """
        words = list(dict.fromkeys(w for w in words if w))
        if not words:
            return []
        unk = self.unk_id
        return [w for w, ids in zip(words, self.sp.encode(words, out_type=int)) if unk in ids or BLANK_ID in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of one id sequence; blank ids are dropped (a list of ints or a 1-D tensor)."""
        return self.sp.decode([int(i) for i in ids if int(i) != BLANK_ID])

    def decode_batch(self, batch: Iterable[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.model_path)!r}, vocab_size={self.vocab_size})"
