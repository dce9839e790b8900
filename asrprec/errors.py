"""The errors a user can fix, and the stop a run can continue from.

Each package's error for a bad folder, file, flag or data subclasses :class:`AsrprecError` next to the built-in
base its callers already catch (``class CorpusError(AsrprecError, ValueError)``); its message is one line that
names the problem and the fix. :func:`asrprec.cli.run_main` ends a program on any of them with that line and exit
code 2 (the code of a bad command line) instead of a traceback, without knowing the packages that raise
them.
"""

from __future__ import annotations

__all__ = ["USER_ERROR_EXIT_CODE", "AsrprecError", "ResumableStop"]

#: the exit code of a program ended by an :class:`AsrprecError` (as on a bad flag)
USER_ERROR_EXIT_CODE = 2


class AsrprecError(Exception):
    """An error the user can fix; the message is one line naming the problem and the fix."""

    exit_code = USER_ERROR_EXIT_CODE


class ResumableStop(Exception):
    """A run stopped on request where the same command continues it (e.g. preemption); not a failure. The program
    exits with ``exit_code``."""

    exit_code = 1
