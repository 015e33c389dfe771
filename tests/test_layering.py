"""Dependencies point one way: building blocks <- stages <- entry points.

Every module's imports of our own package are read with ``ast`` (at the top of the file and
inside functions, absolute and relative) and each must go to a lower layer or stay in its own
package. The order below is the project's architecture: a new package must be placed in it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "wsi_pipeline"

#: Lowest first. Blocks, then stages in the order of the flow, then entry points.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("",),  # wsi_pipeline/__init__.py: the version only
    ("types", "io_atomic", "progress", "devices", "interrupt", "slide_ids", "output_dirs"),  # helpers without our own imports; shared Protocols
    ("slides",),  # readers, mpp, slide finder
    ("models",),  # encoders, aggregators, heads, registries
    ("bigl",),  # Big-Layers (converts models)
    ("data",),  # tile stores, bags, augmentation, stain statistics
    ("config",),  # the pipeline schema and its builder (choices come from the registries, the store, the readers)
    ("jobs",),  # where per-slide work runs (local pool, Dask)
    ("inference",),  # shared by training and evaluation: models from a config, embedding, scoring, metrics
    ("manifests",),  # stage: cohort manifests and splits
    ("synthetic",),  # stage: generated slides and cohorts (demo, tests, benchmarks)
    ("tissue_seg",),  # stage: the whole-slide tissue U-Net (used by tiling)
    ("tiling",),  # stage: slides -> tile stores
    ("training",),  # stage: stores -> runs
    ("export",),  # stage: predictions, heatmaps, reports
    ("evaluation",),  # stage: runs -> results (writes through export)
    ("readme_table",),  # entry points
    ("demo", "bench"),
    ("cli",),
    ("__main__",),
)
BLOCKS = {"", "types", "io_atomic", "progress", "devices", "interrupt", "slide_ids", "output_dirs", "slides", "models", "bigl", "config", "data", "jobs", "inference"}
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _root(path: Path) -> Path:
    """The outermost ``wsi_pipeline`` folder above ``path``."""
    return [p for p in path.parents if p.name == "wsi_pipeline"][-1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(_root(path).parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(path: Path, name: str) -> bool:
    root = _root(path)
    return (root / name).is_dir() or (root / f"{name}.py").is_file()


def own_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of ``wsi_pipeline.*`` in ``path`` (relative ones resolved)."""
    module = _module_name(path)
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "wsi_pipeline"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "wsi_pipeline":
                continue
            if target == "wsi_pipeline":  # `from wsi_pipeline import x`: x is a module, or a name of the root
                found += [(node.lineno, f"wsi_pipeline.{a.name}" if _is_module(path, a.name) else target)
                          for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def layering_violations(root: Path = PACKAGE) -> list[str]:
    """Imports against :data:`LAYERS`, and packages missing from it."""
    problems: list[str] = []
    for path in sorted(root.rglob("*.py")):
        src = _package_of(_module_name(path))
        if src not in RANK:
            problems.append(f"{path}: package {src!r} has no place in LAYERS")
            continue
        for line, target in own_imports(path):
            dst = _package_of(target)
            if dst == src:
                continue
            if dst not in RANK:
                problems.append(f"{path}:{line}: imports {target}, whose package {dst!r} has no place in LAYERS")
            elif RANK[dst] >= RANK[src]:
                problems.append(f"{path}:{line}: {src} (layer {RANK[src]}) imports {target} (layer {RANK[dst]})")
    return problems


def package_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Cycles in the package graph (each as the packages on it), found by depth-first search."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        src = _package_of(_module_name(path))
        for _, target in own_imports(path):
            dst = _package_of(target)
            if dst and dst != src:
                edges[src].add(dst)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return cycles


def test_every_import_goes_down_the_layers() -> None:
    problems = layering_violations()
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_no_cycle_between_packages() -> None:
    assert package_cycles() == []


def test_no_import_error_guard_around_our_own_modules() -> None:
    guarded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Try):
                continue
            catches = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if not catches & {"ImportError", "ModuleNotFoundError"}:
                continue
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.ImportFrom) and (sub.level or (sub.module or "").startswith("wsi_pipeline")):
                        guarded.append(f"{path}:{sub.lineno}")
    assert not guarded, "our own modules are always installed; do not guard their imports: " + ", ".join(guarded)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("where", ["top", "function", "relative"])
def test_the_check_catches_a_back_import(tmp_path: Path, where: str) -> None:
    """A block importing a stage, in each spelling, is reported; the same import downward is not."""
    root = tmp_path / "wsi_pipeline"
    _write(root, "__init__.py", "")
    _write(root, "inference/__init__.py", "")
    _write(root, "training/__init__.py", "")
    _write(root, "training/loop.py", "from wsi_pipeline.inference import models\n")
    back = {
        "top": "from wsi_pipeline.training.loop import x\n",
        "function": "def f():\n    import wsi_pipeline.training.loop\n",
        "relative": "from ..training import loop\n",
    }[where]
    _write(root, "inference/models.py", back)
    problems = layering_violations(root)
    assert len(problems) == 1 and "inference (layer" in problems[0] and "wsi_pipeline.training" in problems[0]
    assert package_cycles(root) == [["inference", "training", "inference"]]


def test_blocks_are_below_every_stage() -> None:
    assert max(RANK[b] for b in BLOCKS) < min(RANK[s] for s in RANK if s not in BLOCKS)
