"""No function in the package (nor in the workbench, benchmarks/ and tools/) is over 100 lines (docstring included): a longer one does several things, each
of which deserves a name (issue 42). Measured with ``ast`` from ``def`` to the function's last line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "wsi_pipeline"
#: The package and the workbench (benchmarks/, tools/: run from the repository, held to the same rule).
ROOTS = (PACKAGE, REPO / "benchmarks", REPO / "tools")
MAX_LINES = 100


def _lengths(node: ast.AST, prefix: str, where: str, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            found[f"{where}:{name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
            _lengths(child, f"{name}.", where, found)
        elif isinstance(child, ast.ClassDef):
            _lengths(child, f"{prefix}{child.name}.", where, found)
        else:
            _lengths(child, prefix, where, found)


def function_lengths(root: Path = PACKAGE) -> dict[str, int]:
    """``"<file>:<qualified name>"`` -> lines, for every function and method under ``root``."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        _lengths(ast.parse(path.read_text(), filename=str(path)), "", str(path.relative_to(root.parent)), found)
    return found


def too_long(roots: tuple[Path, ...] = ROOTS, limit: int = MAX_LINES) -> dict[str, int]:
    return {name: n for root in roots for name, n in function_lengths(root).items() if n > limit}


def test_the_measure_counts_def_to_last_line_and_finds_methods_and_nested_functions(tmp_path: Path) -> None:
    pkg = tmp_path / "wsi_pipeline"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(99))
    method_body = "\n".join(f"        x{i} = {i}" for i in range(99))
    (pkg / "m.py").write_text(f"def short():\n{body}\n\nclass C:\n    def long(self):\n{method_body}\n        y = 1\n"
                              "        def inner():\n            return 1\n        return inner\n")
    assert function_lengths(pkg) == {"wsi_pipeline/m.py:short": 100, "wsi_pipeline/m.py:C.long": 104,
                                     "wsi_pipeline/m.py:C.long.inner": 2}
    assert too_long((pkg,)) == {"wsi_pipeline/m.py:C.long": 104}


#: Functions over the limit that other engineers of issue 42 split in their branches (bigl/budget.py:plan_step:
#: `mypy`; cli/tile.py and cli/manifest.py: `tiling`). Empty this set and remove the xfail mark when they land.
STILL_OVER = {
    "wsi_pipeline/bigl/budget.py:plan_step",
    "wsi_pipeline/cli/manifest.py:register",
    "wsi_pipeline/cli/tile.py:register",
}


def test_no_new_function_over_100_lines() -> None:
    """Nothing beyond the known list grows over the limit (this one must pass now)."""
    new = {name: n for name, n in too_long().items() if name not in STILL_OVER}
    assert not new, "\n".join(f"{name}: {n} lines; split it" for name, n in sorted(new.items()))


@pytest.mark.xfail(strict=False, reason=f"still over {MAX_LINES} lines until the other merges land: {', '.join(sorted(STILL_OVER))}")
def test_no_function_over_100_lines() -> None:
    over = too_long()
    assert not over, "\n".join(f"{name}: {n} lines" for name, n in sorted(over.items()))
