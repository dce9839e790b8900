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


# distributions whose import name differs from their name in pyproject.toml
_IMPORT_NAMES = {"pyyaml": "yaml", "espeakng-loader": "espeakng_loader", "sherpa-onnx": "sherpa_onnx",
                 "numba-cuda": "numba"}


def _declared_packages(root: pathlib.Path) -> set[str]:
    """The import names of the project's dependencies and extras (pyproject.toml)."""
    import re
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    names = {re.split(r"[<>=!\[; ]", s, maxsplit=1)[0].strip().lower() for s in specs}
    return {_IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names}


def recipe_import_problems(root: pathlib.Path) -> list[str]:
    """Imports of ``root/recipes`` that are not asrprec, the standard library or a declared dependency, and every
    relative import (a recipe is a script, not a package)."""
    allowed = set(sys.stdlib_module_names) | {"asrprec"} | _declared_packages(ROOT)
    problems = []
    for path in sorted((root / "recipes").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                problems.append(f"{path.relative_to(root)}: relative import {'.' * node.level}{node.module or ''}")
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            problems += [f"{path.relative_to(root)}: imports {n}" for n in names if n.split(".")[0] not in allowed]
    return problems


def test_recipes_import_only_asrprec_and_public_packages():
    assert recipe_import_problems(ROOT) == []


def test_recipe_import_check_finds_bad_imports(tmp_path):
    (tmp_path / "recipes" / "x").mkdir(parents=True)
    (tmp_path / "recipes" / "x" / "train.py").write_text(
        "import os\nimport torch\nfrom asrprec.training import train\nfrom . import prepare\n"
        "from ..y import helper\nimport recipes.y.train\nimport requests\n")
    assert recipe_import_problems(tmp_path) == [
        "recipes/x/train.py: relative import .", "recipes/x/train.py: relative import ..y",
        "recipes/x/train.py: imports recipes.y.train", "recipes/x/train.py: imports requests"]


def test_optional_packages_not_imported_eagerly():
    code = (
        "import sys, asrprec, asrprec.precision, asrprec.models, asrprec.losses, asrprec.training, "
        "asrprec.decoding, asrprec.data, asrprec.tokenizer, asrprec.checkpoint, asrprec.metrics, asrprec.export\n"
        "bad = [m for m in ('torchaudio', 'k2', 'numba.cuda', 'espeakng_loader', 'scipy', 'onnx', 'onnxscript', "
        "'onnxruntime', 'sherpa_onnx') if m in sys.modules]\n"
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
        if name.split(".")[0] in ("torchaudio", "espeakng_loader", "k2", "scipy"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    for mod, extra in [("torchaudio", "asrprec[torchaudio]"), ("espeakng_loader", "asrprec[synth]"), ("k2", "k2"),
                       ("scipy.signal", "asrprec[synth]")]:
        try:
            _optional.require(mod)
        except ImportError as e:
            assert extra in str(e), str(e)
        else:
            raise AssertionError(f"{mod} should be reported missing")
    assert builtins  # keep the import used


def _module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    names = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _top_level_imports(tree: ast.Module):
    """Import statements run when the module is imported: not inside functions (lazy imports are allowed), not
    under ``if TYPE_CHECKING:``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(root: pathlib.Path = ROOT, package: str = "asrprec") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` its import runs. Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``; a
    module's own parent packages are already being imported, so they count only when a name is read from them
    (``from . import name``)."""
    modules = _module_names(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        own_parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges: set[str] = set()

        def run(target: str) -> None:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                mod = ".".join(parts[:i])
                if mod in modules and mod not in own_parents and mod != name:
                    edges.add(mod)

        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    run(alias.name)
                continue
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            run(source)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    run(f"{source}.{alias.name}")
                elif source in modules and source != name:
                    edges.add(source)  # reads a name from the package, e.g. its __init__
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(scc)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_cycle_finder(tmp_path):
    """A package whose module reads a name back from the package's __init__ is a cycle; lazy imports inside
    functions, imports for type checking only, and a submodule importing its siblings are not."""
    files = {
        "p/__init__.py": "from .a import f\nfrom .b import g\n",
        "p/a.py": "from . import g\n\ndef f():\n    return g\n",  # reads g from the half-imported package
        "p/b.py": "from typing import TYPE_CHECKING\nfrom .c import h\nif TYPE_CHECKING:\n    from . import f\n\n"
                  "def g():\n    from . import f\n    return f, h\n",
        "p/c.py": "import p.d\n\ndef h():\n    pass\n",
        "p/d.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "p")
    assert graph == {"p": {"p.a", "p.b"}, "p.a": {"p"}, "p.b": {"p.c"}, "p.c": {"p.d"}, "p.d": set()}
    assert import_cycles(graph) == [{"p", "p.a"}]
    assert import_cycles({"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": {"p"}}) == [{"p", "p.a", "p.b"}]


def test_no_import_cycles():
    """Top-level imports among asrprec modules form no cycle (a lazy import inside a function is allowed)."""
    cycles = import_cycles(import_graph())
    assert not cycles, f"import cycles among asrprec modules (move the shared part into its own module): {cycles}"


# the floors of the library (a module imports only from lower floors or its own package), lazy imports included
_FLOORS = {"atomic": 1, "config": 1, "rng": 1, "tokenizer": 1, "metrics": 1, "_optional": 1, "optim": 1,
           "precision": 2, "losses": 2, "data": 2, "models": 3, "checkpoint": 4, "experiment": 5,
           "training": 6, "decoding": 6, "export": 6}


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only: nothing is imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def floor_problems(root: pathlib.Path) -> list[str]:
    problems = []
    for path in sorted((root / "asrprec").rglob("*.py")):
        rel = path.relative_to(root / "asrprec")
        here = rel.parts[0].removesuffix(".py")
        if here not in _FLOORS:
            continue
        for node in _runtime_nodes(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for n in names:
                parts = n.split(".")
                if parts[0] != "asrprec" or len(parts) < 2 or parts[1] not in _FLOORS or parts[1] == here:
                    continue
                if _FLOORS[parts[1]] > _FLOORS[here] or (_FLOORS[parts[1]] == _FLOORS[here] >= 5):
                    problems.append(f"asrprec/{rel} (floor {_FLOORS[here]}) imports {n} (floor {_FLOORS[parts[1]]})")
    return problems


def test_each_floor_imports_only_lower_floors():
    # training, decoding and export share floor 6: decoding and export may use training's command-line helpers
    # (asrprec.training.cli), in that direction only; nothing below them may import them, and the experiment
    # folder (floor 5) imports none of them
    problems = [p for p in floor_problems(ROOT)
                if not (p.endswith("imports asrprec.training.cli (floor 6)") and "asrprec/training/" not in p)]
    assert problems == []


def test_floor_check_finds_an_upward_import(tmp_path):
    (tmp_path / "asrprec" / "models").mkdir(parents=True)
    (tmp_path / "asrprec" / "models" / "x.py").write_text("def f():\n    from asrprec.training.cli import run_main\n")
    (tmp_path / "asrprec" / "experiment.py").write_text("import asrprec.decoding\n")
    assert len(floor_problems(tmp_path)) == 2
