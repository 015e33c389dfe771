"""No code branches on a training strategy's name outside the strategy registry and its traits table.

Code below training (config, method models, checkpoints) and the loop's helpers ask
``strategy_traits(method.strategy)`` (``wsi_pipeline/config/strategy_traits.py``) what a strategy
does; only that table and ``wsi_pipeline/training/strategies.py`` (the registry) may name a
strategy in a comparison. Two reads of every other module: the text, for the spellings
``strategy ==``, ``strategy !=``, ``.strategy in``, ``strategy in (...)``; and the syntax tree, for any
comparison (``==``, ``!=``, ``in``, ``not in``) or ``match`` of a strategy value with a string, where a
strategy value is a name or attribute ending in ``strategy``, ``getattr(x, "strategy", ...)``,
``x.get("strategy")`` or ``x["strategy"]``. Both must find nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "wsi_pipeline"
ALLOWED = {PACKAGE / "config" / "strategy_traits.py", PACKAGE / "training" / "strategies.py"}
SPELLINGS = re.compile(r"\bstrategy\s*(==|!=)|\.strategy\s+(not\s+)?in\b|\bstrategy\s+(not\s+)?in\s*[(\[{]")


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p not in ALLOWED]


def _is_key(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "strategy"


def _is_strategy(node: ast.expr) -> bool:
    """A strategy value: ``strategy``, ``x.strategy``, ``getattr(x, "strategy"...)``, ``x.get("strategy"...)``, ``x["strategy"]``."""
    if isinstance(node, ast.Name):
        return node.id.lower().endswith("strategy")
    if isinstance(node, ast.Attribute):
        return node.attr.lower().endswith("strategy")
    if isinstance(node, ast.Subscript):
        return _is_key(node.slice)
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id == "getattr":
            return len(node.args) >= 2 and _is_key(node.args[1])
        if isinstance(f, ast.Attribute) and f.attr == "get":
            return bool(node.args) and _is_key(node.args[0])
    return False


def _has_string(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_has_string(e) for e in node.elts)
    return False


def text_dispatch(paths: list[Path], root: Path = PACKAGE) -> list[str]:
    """Lines with one of the spellings (comments and docstring prose included: say it another way)."""
    return [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if SPELLINGS.search(line)]


def tree_dispatch(paths: list[Path], root: Path = PACKAGE) -> list[str]:
    """Comparisons and ``match`` statements of a strategy value with a string literal."""
    found = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(_is_strategy(s) for s in sides) and any(_has_string(s) for s in sides):
                    found.append(f"{p.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Match) and _is_strategy(node.subject):
                found.append(f"{p.relative_to(root)}:{node.lineno}: match {ast.unparse(node.subject)}")
    return found


def test_no_strategy_name_dispatch_outside_the_registry_and_its_traits() -> None:
    paths = _modules()
    assert PACKAGE / "methods" / "models.py" in paths and PACKAGE / "training" / "memory.py" in paths
    found = text_dispatch(paths) + tree_dispatch(paths)
    assert found == [], "ask strategy_traits(method.strategy) instead of comparing the strategy's name:\n" + "\n".join(found)


def test_the_check_finds_each_spelling(tmp_path: Path) -> None:
    """Each read finds what it is for, and neither flags a lookup in the traits table."""
    text_only = {"a.py": 'def f(method):\n    if method.strategy == "bigl":\n        return 1\n',
                 "b.py": "def f(m, chosen):\n    return m.strategy in chosen\n"}
    tree_only = {"c.py": 'def f(m):\n    return m.train_strategy in ("full", "patchgd")\n',
                 "d.py": 'def f(m):\n    return "frozen" != getattr(m, "strategy", None)\n',
                 "e.py": 'def f(raw):\n    return raw.get("strategy") != "patchgd"\n',
                 "f.py": 'def f(raw):\n    return raw["strategy"] == "accumulate"\n',
                 "g.py": 'def f(m):\n    match m.strategy:\n        case "bigl":\n            return 1\n'}
    good = {"good.py": "def f(method, strategy_traits):\n    return strategy_traits(method.strategy).trains_encoder\n",
            "other.py": 'def f(m):\n    return m.encoder.bn == "frozen" and m.name != "full"\n'}
    for name, src in {**text_only, **tree_only, **good}.items():
        (tmp_path / name).write_text(src)
    for name in text_only:
        assert text_dispatch([tmp_path / name], tmp_path), name
    for name in tree_only:
        assert tree_dispatch([tmp_path / name], tmp_path) and not text_dispatch([tmp_path / name], tmp_path), name
    for name in good:
        assert text_dispatch([tmp_path / name], tmp_path) == [] and tree_dispatch([tmp_path / name], tmp_path) == [], name
