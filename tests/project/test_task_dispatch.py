"""The task is a registered plugin: no code outside ``wsi_pipeline/tasks/`` branches on a task's name.

Two reads of every module of the package (the tasks package excepted): the text, for the
spellings of the issue (``task ==``, ``task !=``, ``.task in``, ``task in (``, ``task not in``), and
the syntax tree, for any comparison of a registered task's name (``"survival" == x``,
``x in ("classification", ...)``) or of a name ending in ``task`` with a string. Both must find nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from wsi_pipeline.tasks import task_names

PACKAGE = Path(__file__).resolve().parents[2] / "wsi_pipeline"
TASKS_PACKAGE = PACKAGE / "tasks"
SPELLINGS = re.compile(r"\btask\s*(==|!=)|\.task\s+(not\s+)?in\b|\btask\s+(not\s+)?in\s*[(\[{]")


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if TASKS_PACKAGE not in p.parents]


def _is_taskish(node: ast.expr) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.endswith("task")


def _strings(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _strings(e)}
    return set()


def text_dispatch(paths: list[Path], root: Path = PACKAGE) -> list[str]:
    """Lines with one of the issue's spellings (comments and docstring prose included: say it another way)."""
    return [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if SPELLINGS.search(line)]


def tree_dispatch(paths: list[Path], names: set[str], root: Path = PACKAGE) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``) of a task name, or of a ``*task`` name with a string."""
    found = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if not isinstance(node, ast.Compare) or not all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                continue
            sides = [node.left, *node.comparators]
            strings = set().union(*(_strings(s) for s in sides))
            if strings & names or (strings and any(_is_taskish(s) for s in sides)):
                found.append(f"{p.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_task_name_dispatch_outside_the_task_registry() -> None:
    paths = _modules()
    found = text_dispatch(paths) + tree_dispatch(paths, set(task_names()))
    assert found == [], "ask the registered task (get_task(name), endpoint.definition) instead of comparing its name:\n" + "\n".join(found)


def test_the_check_finds_each_spelling(tmp_path: Path) -> None:
    """Each read finds what it is for, and neither flags a call through the registry."""
    names = {"classification", "survival", "regression"}
    text_only = {"a.py": 'def f(config):\n    if config.task == "survival":\n        return 1\n',
                 "b.py": "def f(m, chosen):\n    return m.task in chosen\n"}
    tree_only = {"c.py": 'def f(m):\n    return m.kind in ("regression", "x")\n',
                 "d.py": 'def f(args):\n    return "survival" == args.what\n',
                 "e.py": 'def f(job):\n    return job.next_task != "x"\n'}
    for name, src in {**text_only, **tree_only, "good.py": "def f(config, get_task):\n    return get_task(config.task).has_classes\n"}.items():
        (tmp_path / name).write_text(src)
    for name in text_only:
        assert text_dispatch([tmp_path / name], tmp_path), name
    for name in tree_only:
        assert tree_dispatch([tmp_path / name], names, tmp_path) and not text_dispatch([tmp_path / name], tmp_path), name
    good = [tmp_path / "good.py"]
    assert text_dispatch(good, tmp_path) == [] and tree_dispatch(good, names, tmp_path) == []
