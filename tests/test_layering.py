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


def _imports(tree: ast.Module, every: bool = False):
    """Import statements run when the module is imported: not inside functions (lazy imports), not under
    ``if TYPE_CHECKING:``; with ``every``, all of them."""
    if every:
        yield from (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))
        return
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


def import_graph(root: pathlib.Path = ROOT, package: str = "asrprec",
                 every_import: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` its import runs (with ``every_import``: that any of its imports runs,
    lazy and type-checking ones too). Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``; a module's own parent
    packages are already being imported, so they count only when a name is read from them (``from . import name``)."""
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

        for node in _imports(ast.parse(path.read_text()), every_import):
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
    assert import_graph(tmp_path, "p", every_import=True)["p.b"] == {"p", "p.c"}
    assert import_cycles({"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": {"p"}}) == [{"p", "p.a", "p.b"}]


def test_no_import_cycles():
    """The imports among asrprec modules form no cycle, lazy ones (inside functions) and type-checking ones included:
    a lazy import hides a circle from the interpreter, not from a reader."""
    cycles = import_cycles(import_graph(every_import=True))
    assert not cycles, f"import cycles among asrprec modules (move the shared part into its own module): {cycles}"


#: DESIGN.md's floors as layers, from the top down. A module of asrprec imports only its own home (package or module)
#: and the layers below its own; the homes of one layer import none of each other.
LAYERS = (
    ("training", "decoding", "export"),  # 6: what a recipe calls; each stands on the experiment, none on another
    ("cli", "experiment"),  # 5: every entry point's scaffolding; the experiment folder
    ("checkpoint",),  # 4
    ("models",),  # 3
    ("losses", "data", "lm"),  # 2
    ("precision",),  # 1, above optim: the policy attaches optim's bf16 update rules to an optimizer (build_optimizer)
    ("optim",),  # drawn on floor 2 by DESIGN; it imports nothing of asrprec, so it sits under precision
    ("tokenizer", "metrics", "timestamps"),  # 1: the ground; these write their files through the atomic writer
    ("config", "devices", "atomic", "rng", "_optional"),  # 1
    ("errors",),  # 1, under the rest: the atomic writer raises a user error on a full disk
)

#: imports that go against LAYERS, each with its reason: only a genuine plug-in point belongs here
ALLOWED: dict[tuple[str, str], str] = {}


def _layer_of(home: str) -> int | None:
    """The index of ``home``'s layer in LAYERS, counted from the ground (0); None for a home LAYERS does not place."""
    for i, homes in enumerate(reversed(LAYERS)):
        if home in homes:
            return i
    return None


def _imported_homes(path: pathlib.Path, root: pathlib.Path):
    """(line, home) of each asrprec home ``path`` imports: every import statement, at the top of the module, inside
    a function (a lazy import runs later, but runs) or under ``if TYPE_CHECKING:`` (an annotation is a dependency)."""
    package = list(path.relative_to(root).parts[:-1])  # the package a relative import starts from
    for node in sorted(ast.walk(ast.parse(path.read_text())), key=lambda n: getattr(n, "lineno", 0)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{source}.{a.name}" for a in node.names] if source == "asrprec" else [source]
        else:
            continue
        for target in targets:
            names = target.split(".")
            if names[0] == "asrprec" and len(names) > 1:
                yield node.lineno, names[1]


def layer_problems(root: pathlib.Path = ROOT) -> list[str]:
    """Each import of ``root/asrprec`` that goes up a layer or sideways within one (and not in ALLOWED), and each
    home LAYERS does not place."""
    problems = []
    for path in sorted((root / "asrprec").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts == ("asrprec", "__init__.py"):
            continue
        here = rel.parts[1].removesuffix(".py")
        if _layer_of(here) is None:
            problems.append(f"{rel}: asrprec.{here} has no layer; place it in LAYERS (tests/test_layering.py) as "
                            "DESIGN.md draws it")
            continue
        for line, there in _imported_homes(path, root):
            if there == here or (here, there) in ALLOWED:
                continue
            if _layer_of(there) is None or _layer_of(there) >= _layer_of(here):
                up = "a layer it shares" if _layer_of(there) == _layer_of(here) else "a layer above"
                problems.append(f"{rel}:{line} imports asrprec.{there} ({up})")
    return problems


def test_each_module_imports_only_lower_layers():
    assert layer_problems() == []


def test_layer_check_finds_each_kind_of_violation(tmp_path):
    files = {
        "asrprec/__init__.py": "",
        "asrprec/models/__init__.py": "from .x import f\n",
        # a lazy import going up, and one for annotations only
        "asrprec/models/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from asrprec.training import T\ndef f():\n    from asrprec.cli import run_main\n",
        "asrprec/experiment.py": "import asrprec.decoding\nfrom . import models\n",  # up; down (fine)
        "asrprec/decoding/x.py": "from ..training.loop import train\nfrom ..models import f\n",  # sideways; down
        "asrprec/optim/x.py": "from asrprec import precision, errors\n",  # up (from the package); ground (fine)
        "asrprec/gadgets.py": "",  # no layer
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_problems(tmp_path) == [
        "asrprec/decoding/x.py:1 imports asrprec.training (a layer it shares)",
        "asrprec/experiment.py:1 imports asrprec.decoding (a layer above)",
        "asrprec/gadgets.py: asrprec.gadgets has no layer; place it in LAYERS (tests/test_layering.py) as DESIGN.md "
        "draws it",
        "asrprec/models/x.py:3 imports asrprec.training (a layer above)",
        "asrprec/models/x.py:5 imports asrprec.cli (a layer above)",
        "asrprec/optim/x.py:1 imports asrprec.precision (a layer above)",
    ]


def test_only_the_cli_speaks_argparse():
    """The library takes config objects: argparse (and its Namespace) lives in asrprec/cli.py alone."""
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "asrprec").rglob("*.py"))
             if path.relative_to(ROOT).as_posix() != "asrprec/cli.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if "argparse" in line]
    assert found == []
