"""asrprec.cli.run_main: an error a user can fix ends the program with one line and exit code 2, whichever package
raised it; a preempted run exits with its own code; anything else keeps its traceback."""

import subprocess
import sys

import pytest

from asrprec.checkpoint import CheckpointError
from asrprec.cli import run_main
from asrprec.data.corpora import CorpusError
from asrprec.data.download import ArchiveError, DownloadError
from asrprec.data.validate import DataCheckError
from asrprec.errors import AsrprecError
from asrprec.experiment import ExperimentError, ModelMismatchError
from asrprec.precision import GradScaleCollapse, UnsupportedPrecisionError
from asrprec.training import ResumeMismatchError, TooManySkippedBatches, TrainingPreempted
from asrprec.training.oom import BatchOutOfMemory


def _raising(exc):
    def main():
        raise exc
    return main


@pytest.mark.parametrize("cls, builtin", [
    (CheckpointError, ValueError), (CorpusError, ValueError), (DataCheckError, ValueError),
    (ExperimentError, ValueError), (ModelMismatchError, ValueError), (ArchiveError, ValueError),
    (DownloadError, OSError), (UnsupportedPrecisionError, RuntimeError), (ResumeMismatchError, RuntimeError),
    (TooManySkippedBatches, RuntimeError), (BatchOutOfMemory, RuntimeError), (GradScaleCollapse, RuntimeError),
])
def test_each_user_error_ends_the_program_in_one_line_with_code_2(cls, builtin, capsys):
    assert issubclass(cls, builtin)  # callers that catch the built-in base still do
    with pytest.raises(SystemExit) as e:
        run_main(_raising(cls("the folder x is empty. Fix: pass --data-dir")), "train.py")
    assert e.value.code == 2
    assert capsys.readouterr().err == "train.py: error: the folder x is empty. Fix: pass --data-dir\n"


def test_a_new_user_error_needs_no_registration(capsys):
    class LexiconError(AsrprecError, KeyError):
        pass

    with pytest.raises(SystemExit) as e:
        run_main(_raising(LexiconError("no such word")), "prepare.py")
    assert e.value.code == 2 and capsys.readouterr().err.startswith("prepare.py: error: ")


def test_also_and_missing_files_are_user_errors_other_errors_keep_their_traceback(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        run_main(_raising(ImportError("pip install 'asrprec[export]'")), "export.py", also=(ImportError,))
    assert e.value.code == 2 and capsys.readouterr().err == "export.py: error: pip install 'asrprec[export]'\n"
    with pytest.raises(SystemExit) as e:
        run_main(lambda: open(tmp_path / "nowhere.txt"), "decode.py")
    assert e.value.code == 2 and "nowhere.txt" in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):
        run_main(lambda: 1 / 0, "train.py")


def test_a_preempted_run_exits_with_the_preemption_code(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        run_main(_raising(TrainingPreempted("stopped at batch 6", tmp_path / "checkpoint-6.pt")), "train.py")
    assert e.value.code == 75 and capsys.readouterr().err == "train.py: stopped at batch 6\n"


def test_the_cli_imports_no_package_above_it():
    """Every entry point imports asrprec.cli first: it brings none of training, decoding, export, data or models."""
    code = ("import sys, asrprec.cli\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in ([\"asrprec\", p] for p in "
            "('training', 'decoding', 'export', 'data', 'models', 'checkpoint', 'experiment', 'losses'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
