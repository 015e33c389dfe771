"""No function in the package (nor in the workbench, benchmarks/ and tools/) is over 100 lines (docstring included): a longer one does several things, each
of which deserves a name (issue 42). Measured with ``ast`` from ``def`` to the function's last line."""

from __future__ import annotations

import ast
from pathlib import Path


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


def test_no_function_over_100_lines() -> None:
    """No function of the package or the workbench is over the limit (issue 42)."""
    over = too_long()
    assert not over, "\n".join(f"{name}: {n} lines; split it" for name, n in sorted(over.items()))
