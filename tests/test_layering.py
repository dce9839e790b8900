"""asrprec never imports recipes; importing asrprec pulls in no optional package."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_library_never_imports_recipes():
    offenders = []
    for path in (ROOT / "asrprec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0] == "recipes"]
    assert not offenders, offenders


def test_recipes_import_only_asrprec_and_public_packages():
    for path in (ROOT / "recipes").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level:
                raise AssertionError(f"{path}: relative import {node.module}")


def test_optional_packages_not_imported_eagerly():
    code = (
        "import sys, asrprec, asrprec.precision, asrprec.models, asrprec.losses, asrprec.training, "
        "asrprec.decoding, asrprec.data, asrprec.tokenizer, asrprec.checkpoint, asrprec.metrics, asrprec.export\n"
        "bad = [m for m in ('torchaudio', 'k2', 'numba.cuda', 'espeakng_loader', 'onnx', 'onnxscript', 'onnxruntime', "
        "'sherpa_onnx') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"imported eagerly: {out.stdout}"


def test_missing_optional_package_names_the_extra(monkeypatch):
    import builtins
    import importlib

    from asrprec import _optional

    real = importlib.import_module

    def fake(name, *a, **k):
        if name.split(".")[0] in ("torchaudio", "espeakng_loader", "k2"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    for mod, extra in [("torchaudio", "asrprec[torchaudio]"), ("espeakng_loader", "asrprec[synth]"), ("k2", "k2")]:
        try:
            _optional.require(mod)
        except ImportError as e:
            assert extra in str(e), str(e)
        else:
            raise AssertionError(f"{mod} should be reported missing")
    assert builtins  # keep the import used
