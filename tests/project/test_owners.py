"""Each concept has one owner and one import path: the ``inference`` modules that only re-exported
another package's names before the first release are gone (issue 50: no compatibility layers before a
release is tagged), and nothing in the package, the workbench or the tests names them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: removed path -> the owner that holds the code
REMOVED = {
    "wsi_pipeline.inference.checkpoint": "wsi_pipeline.checkpoints.files",
    "wsi_pipeline.inference.method_models": "wsi_pipeline.methods.models",
    "wsi_pipeline.inference.endpoints": "wsi_pipeline.methods.endpoints",
    "wsi_pipeline.inference.metrics": "wsi_pipeline.tasks.metrics",
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


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_a_removed_path_does_not_import_and_its_owner_does(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert importlib.import_module(REMOVED[old]).__all__


def test_nothing_imports_a_removed_path() -> None:
    files = [p for folder in ("wsi_pipeline", "benchmarks", "tools", "tests") for p in (REPO / folder).rglob("*.py")]
    offenders = [f"{p.relative_to(REPO)} imports {m}" for p in files for m in sorted(_imports(p) & set(REMOVED))]
    assert not offenders, "\n".join(offenders)
    # the self-test: the reader finds an import of a removed path where there is one
    assert _imports_text("from wsi_pipeline.inference.metrics import METRICS") & set(REMOVED)


def _imports_text(text: str) -> set[str]:
    tmp = ast.parse(text)
    return {n.module for n in ast.walk(tmp) if isinstance(n, ast.ImportFrom) and n.module}
