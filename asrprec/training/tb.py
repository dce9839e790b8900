"""A tensorboard writer that is a no-op on non-zero ranks or when disabled."""

from __future__ import annotations

from pathlib import Path


class SummaryWriterOrNull:
    def __init__(self, log_dir: str | Path, enabled: bool = True):
        self._w = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._w = SummaryWriter(log_dir=str(log_dir))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self._w is not None:
            self._w.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self._w is not None:
            self._w.add_text(tag, text, step)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()

    def __enter__(self) -> "SummaryWriterOrNull":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
