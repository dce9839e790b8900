"""The Python examples of README.md and the guides in docs/: each block parses, and every name it imports from asrprec
exists (a renamed or removed library function fails here, not in a user's first recipe)."""

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks(pages: tuple[Path, ...] = (ROOT / "README.md",)) -> list[str]:
    return [b for p in pages for b in re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S)]


GUIDES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def test_readme_python_blocks_parse_and_import_only_existing_names():
    assert len(_blocks()) >= 5, "README.md lost its tour's examples"
    blocks = _blocks(GUIDES)
    checked = 0
    for code in blocks:
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asrprec"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"a guide imports {alias.name} from {node.module}"
                    checked += 1
    assert checked >= 5


def test_readme_train_example_calls_train_from_args_with_its_keywords():
    import inspect

    from asrprec.training import train_from_args

    params = inspect.signature(train_from_args).parameters
    for code in _blocks(GUIDES):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "train_from_args":
                for kw in node.keywords:
                    assert kw.arg in params, f"docs/training.md passes {kw.arg}= to train_from_args"
                return
    raise AssertionError("docs/training.md's train.py example does not call train_from_args")
