"""Each concept has one owner: the old ``inference`` paths are import shims that hold no code and that
the package itself never imports (issue 42: checkpoints, method models and metrics have their own packages)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "wsi_pipeline"

#: old path -> the owner that holds the code now
SHIMS = {
    "wsi_pipeline.inference.checkpoint": "wsi_pipeline.checkpoints.files",
    "wsi_pipeline.inference.method_models": "wsi_pipeline.methods.models",
    "wsi_pipeline.inference.endpoints": "wsi_pipeline.methods.endpoints",
    "wsi_pipeline.inference.metrics": "wsi_pipeline.tasks",
    "wsi_pipeline.inference.endpoint_metrics": "wsi_pipeline.tasks.endpoint_metrics",
    "wsi_pipeline.inference.survival_metrics": "wsi_pipeline.tasks.survival_metrics",
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_path_holds_no_code_and_still_imports(old: str) -> None:
    path = PACKAGE.parent / (old.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    def is_all(n: ast.stmt) -> bool:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)

    assert all(isinstance(n, (ast.ImportFrom, ast.Import)) or is_all(n) for n in body), f"{path} holds more than imports"
    new = importlib.import_module(SHIMS[old])
    mod = importlib.import_module(old)
    kept = [name for name in getattr(new, "__all__", []) if hasattr(mod, name)]
    assert kept, f"{old} re-exports none of {SHIMS[old]}'s names"
    assert all(getattr(mod, name) is getattr(new, name) for name in kept)


def test_the_package_never_imports_an_old_path() -> None:
    offenders = [f"{p.relative_to(PACKAGE.parent)} imports {m}"
                 for p in PACKAGE.rglob("*.py") if "inference" not in p.relative_to(PACKAGE).parts[:1] or p.stem not in {s.rsplit(".", 1)[1] for s in SHIMS}
                 for m in sorted(_imports(p) & set(SHIMS))]
    assert not offenders, "\n".join(offenders)
