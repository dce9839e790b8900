"""Every entry point's scaffolding: :func:`run_main`, :func:`setup_logging`, and the flags every program shares
(the precision policy and the device).

Training's own flags are in :mod:`asrprec.training.cli`; a flag is a config dataclass field
(:func:`asrprec.config.add_dataclass_args`), so these helpers only name which dataclass a program offers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable

from asrprec.config import add_dataclass_args, dataclass_from_args
from asrprec.devices import get_rank, get_world_size, resolve_device
from asrprec.errors import AsrprecError, ResumableStop

__all__ = ["add_precision_args", "policy_from_args", "precision_options_from_args", "run_main", "setup_logging"]


def run_main(main: Callable[[], Any], prog: str, also: tuple[type[BaseException], ...] = ()) -> None:
    """Run a program's ``main``; an error a user can fix (:class:`~asrprec.errors.AsrprecError`, a missing file,
    and the exception types in ``also``) ends the program with ``prog: error: <message>`` on stderr (and in the log)
    and exit code 2 instead of a traceback. A run stopped where it can continue
    (:class:`~asrprec.errors.ResumableStop`, e.g. a preempted training run) exits with its ``exit_code``."""
    log = logging.getLogger("asrprec")
    try:
        main()
    except ResumableStop as e:
        log.warning("%s", e)
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except (AsrprecError, FileNotFoundError, *also) as e:
        log.error("%s", e)
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", AsrprecError.exit_code)) from None


def setup_logging(log_file: str | None = None, rank: int | None = None) -> None:
    """Rank 0 (default: this process's rank) logs to stderr and ``log_file``; other ranks log warnings to
    stderr only, tagged with their rank (only rank 0 writes files)."""
    import os

    if rank is None:  # torchrun's RANK also before the process group exists
        rank = get_rank() if get_world_size() > 1 else int(os.environ.get("RANK", "0"))
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file and rank == 0:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s [%(name)s] " + (f"[rank {rank}] " if rank else "") + "%(message)s",
        handlers=handlers,
        force=True,
    )


def add_precision_args(p: argparse.ArgumentParser, default: str = "fp32") -> None:
    """One flag per :class:`asrprec.precision.PrecisionOptions` field; ``default`` is the program's
    ``--precision``."""
    from asrprec.precision import PrecisionOptions

    add_dataclass_args(p, PrecisionOptions, defaults={"precision": default})


def precision_options_from_args(args: argparse.Namespace):
    """The :class:`asrprec.precision.PrecisionOptions` of the :func:`add_precision_args` flags."""
    from asrprec.precision import PrecisionOptions

    return dataclass_from_args(PrecisionOptions, args)


def policy_from_args(args: argparse.Namespace):
    """The precision policy the flags of :func:`add_precision_args` name, on this process's device."""
    return precision_options_from_args(args).policy(resolve_device(args.device))
