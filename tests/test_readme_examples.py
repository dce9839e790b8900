"""The Python examples of README.md and the guides in docs/: each block parses, every name it imports from asrprec
exists, and every call of an asrprec function passes keywords that function takes (a renamed or removed library
function or argument fails here, not in a user's first recipe)."""

import ast
import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def _blocks(pages=(ROOT / "README.md",)) -> list[str]:
    return [b for p in pages for b in re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S)]


def _imported(tree: ast.AST) -> dict[str, object]:
    """name -> object for every ``from asrprec... import name`` of a block."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asrprec"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"a guide imports {alias.name} from {node.module}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _callee(func: ast.expr, names: dict[str, object]):
    """The asrprec object a call names (``f(...)`` or ``Class.method(...)``), or None."""
    if isinstance(func, ast.Name):
        return names.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names:
        return getattr(names[func.value.id], func.attr)
    return None


def test_readme_python_blocks_parse_and_import_only_existing_names():
    assert len(_blocks()) >= 5, "README.md lost its tour's examples"
    imported = sum(len(_imported(ast.parse(code))) for code in _blocks(GUIDES))
    assert imported >= 15


def test_guide_examples_call_asrprec_functions_with_their_keywords():
    checked = 0
    for code in _blocks(GUIDES):
        tree = ast.parse(code)
        names = _imported(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or (target := _callee(node.func, names)) is None:
                continue
            params = inspect.signature(target).parameters
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                assert kw.arg is None or kw.arg in params, f"a guide passes {kw.arg}= to {ast.unparse(node.func)}"
                checked += 1
    assert checked >= 15


def test_training_guide_shows_a_recipe_that_calls_the_library_loop():
    import asrprec.training

    blocks = _blocks((ROOT / "docs" / "training.md",))
    calls = {getattr(n.func, "id", None) for code in blocks for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)}
    assert calls & set(asrprec.training.__all__), "docs/training.md's train.py example calls no asrprec.training entry"
