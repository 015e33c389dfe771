"""Dependencies point one way: building blocks <- stages <- entry points.

Every module's imports of our own package are read with ``ast`` (at the top of the file and
inside functions, absolute and relative) and each must go to a lower layer or stay in its own
package. The order below is the project's architecture: a new package must be placed in it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "wsi_pipeline"
#: The workbench: run from the repository (``python -m benchmarks.tile``), never installed; it may import the
#: package, the package never imports it.
WORKBENCH = ("benchmarks", "tools")

#: Lowest first. Blocks, then stages in the order of the flow, then entry points.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("",),  # wsi_pipeline/__init__.py: the version only
    ("types", "io_atomic", "progress", "devices", "interrupt", "slide_ids", "output_dirs", "model_files", "plugins"),  # helpers without our own imports; shared Protocols
    ("failures",),  # the bad-slide policy: which errors fail one slide, which stop the run
    ("slides",),  # readers, mpp, slide finder
    ("models",),  # encoders, aggregators, heads, registries
    ("bigl",),  # Big-Layers (converts models)
    ("tasks",),  # what a method predicts: the Task registry, its losses, scores and metrics
    ("data",),  # tile stores, bags, augmentation, stain statistics
    ("config",),  # the pipeline schema and its builder (choices come from the registries, the store, the readers)
    ("jobs",),  # where per-slide work runs (local pool, Dask)
    ("methods",),  # models from a method's config: encoder, aggregator or PatchGD head, endpoint
    ("checkpoints",),  # the typed run checkpoint, its migrations, the checkpoint file layer
    ("inference",),  # shared by training and evaluation: a trained model, scoring protocols, frozen features
    ("manifests",),  # stage: cohort manifests and splits
    ("synthetic",),  # stage: generated slides and cohorts (demo, tests, benchmarks)
    ("tissue_seg",),  # stage: the whole-slide tissue U-Net (used by tiling)
    ("tiling",),  # stage: slides -> tile stores
    ("training",),  # stage: stores -> runs
    ("export",),  # stage: predictions, heatmaps, reports
    ("evaluation",),  # stage: runs -> results (writes through export)
    ("viewer",),  # stage: the browser viewer of slides, stores and results (reads what export wrote)
    ("demo",),  # entry points: the demo (a newcomer's first run), then the command line
    ("cli",),
    ("__main__",),
)
BLOCKS = {"", "types", "io_atomic", "progress", "devices", "interrupt", "slide_ids", "output_dirs", "model_files", "plugins", "failures", "slides", "models", "bigl", "tasks", "config", "data", "jobs", "methods", "checkpoints", "inference"}
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


def _cycles(edges: Mapping[T, set[T]]) -> list[list[T]]:
    """Cycles of a directed graph found by depth-first search, each as its nodes with the first
    repeated at the end; nodes and successors are visited in sorted order, so the result is stable."""
    cycles: list[list[T]] = []
    state: dict[T, int] = {}
    stack: list[T] = []

    def visit(node: T) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
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


def package_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Cycles in the package graph (each as the packages on it), found by depth-first search."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        src = _package_of(_module_name(path))
        for _, target in own_imports(path):
            dst = _package_of(target)
            if dst and dst != src:
                edges[src].add(dst)
    return _cycles(edges)


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


def _module_file(root: Path, module: str) -> Path | None:
    """The file of ``module`` (``wsi_pipeline.a.b``) under ``root``, or None when it is not ours."""
    parts = module.split(".")[1:]
    base = root.joinpath(*parts) if parts else root
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def file_imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, Path, list[str]]]:
    """``(line, file, names)`` of every import of one of our files in ``path``: at the top, inside
    functions and under ``if TYPE_CHECKING:`` alike. ``from package import module`` goes to the
    module's file; ``names`` are the names taken from the file (empty for ``import a.b``)."""
    module = _module_name(path)
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[int, Path, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "wsi_pipeline" and (f := _module_file(root, a.name)) is not None:
                    found.append((node.lineno, f, []))
        elif isinstance(node, ast.ImportFrom):
            target = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) if node.level else (node.module or "")
            if target.split(".")[0] != "wsi_pipeline":
                continue
            names = []
            for a in node.names:
                sub = _module_file(root, f"{target}.{a.name}")
                if sub is not None:  # a module of a package
                    found.append((node.lineno, sub, []))
                else:
                    names.append(a.name)
            if names and (f := _module_file(root, target)) is not None:
                found.append((node.lineno, f, names))
    return found


def file_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Circles of imports between the files of one package (``slides/a.py`` -> ``slides/b.py`` ->
    ``slides/a.py``), each as the files on it; a package's ``__init__.py`` counts as a file."""
    edges: dict[Path, set[Path]] = defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        src = _package_of(_module_name(path))
        for _, f, _ in file_imports(path, root):
            if f != path and _package_of(_module_name(f)) == src:
                edges[path].add(f)
    return [[str(p.relative_to(root)) for p in cycle] for cycle in _cycles(edges)]


def private_imports(root: Path = PACKAGE) -> list[str]:
    """``from module import _name`` across files: a leading underscore means "this file only"."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, f, names in file_imports(path, root):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and f != path:
                found.append(f"{path.relative_to(root)}:{line}: imports {', '.join(private)} from {f.relative_to(root)}")
    return found


def test_no_cycle_between_files_of_a_package() -> None:
    cycles = file_cycles()
    assert not cycles, "files that import each other (put the shared name in a file both import):\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def test_no_private_name_imported_across_files() -> None:
    found = private_imports()
    assert not found, "private names used outside their file (make them public, or move the user):\n" + "\n".join(found)


@pytest.mark.parametrize("where", ["top", "function", "type_checking"])
def test_the_check_catches_a_circle_between_files(tmp_path: Path, where: str) -> None:
    """Two files of one package importing each other, in each spelling, make one circle; one way does not."""
    root = tmp_path / "wsi_pipeline"
    _write(root, "__init__.py", "")
    _write(root, "slides/__init__.py", "")
    _write(root, "slides/base.py", "class Slide: ...\n")
    _write(root, "slides/dicom.py", "from wsi_pipeline.slides.base import Slide\n")
    assert file_cycles(root) == []
    back = {
        "top": "from wsi_pipeline.slides.dicom import x\n",
        "function": "def f():\n    from . import dicom\n",
        "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from wsi_pipeline.slides.dicom import x\n",
    }[where]
    _write(root, "slides/base.py", "class Slide: ...\n" + back)
    assert file_cycles(root) == [["slides/base.py", "slides/dicom.py", "slides/base.py"]]


def test_the_check_catches_a_private_import(tmp_path: Path) -> None:
    root = tmp_path / "wsi_pipeline"
    _write(root, "__init__.py", "")
    _write(root, "slides/__init__.py", "")
    _write(root, "slides/mpp.py", "def _parse(): ...\ndef parse(): ...\n")
    _write(root, "slides/dicom.py", "from wsi_pipeline.slides.mpp import parse, __doc__\n")
    assert private_imports(root) == []
    _write(root, "slides/dicom.py", "from .mpp import parse, _parse\n")
    assert private_imports(root) == ["slides/dicom.py:1: imports _parse from slides/mpp.py"]


#: Modules whose ``__all__`` gathers names made elsewhere on purpose: a package's ``__init__`` (its
#: public face), the pipeline config (every section a YAML file has), the CLI choices' registry.
FACADES = {"config/pipeline.py", "config/choices.py"}


def reexports(root: Path = PACKAGE) -> list[str]:
    """Names a module lists in ``__all__`` without defining them: a second home for a name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if path.name == "__init__.py" or rel in FACADES:
            continue
        tree = ast.parse(path.read_text())
        defined: set[str] = set()
        listed: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                defined |= names
                if "__all__" in names and isinstance(node.value, (ast.List, ast.Tuple)):
                    listed = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        if extra := [n for n in listed if n not in defined]:
            found.append(f"{rel}: __all__ lists {', '.join(extra)}, made elsewhere")
    return found


def test_a_module_exports_only_its_own_names() -> None:
    found = reexports()
    assert not found, "import these names from their home instead:\n" + "\n".join(found)


def workbench_imports(root: Path = PACKAGE, workbench: tuple[str, ...] = WORKBENCH) -> list[str]:
    """Imports of the workbench folders (``benchmarks``, ``tools``) from the package, in any spelling that reaches them."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            names += [a.value for a in ast.walk(node) if isinstance(node, ast.Call) and isinstance(a, ast.Constant)
                      and isinstance(a.value, str) and a.value.split(".")[0] in workbench and "." in a.value]
            found += [f"{path.relative_to(root.parent)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in workbench]
    return found


def test_the_package_never_imports_the_workbench() -> None:
    found = workbench_imports()
    assert not found, "the installed package cannot import benchmarks/ or tools/ (they are not installed):\n" + "\n".join(found)


def test_the_workbench_is_outside_the_package_and_not_installed() -> None:
    import tomllib

    for folder in WORKBENCH:
        assert (REPO / folder / "__init__.py").is_file() and not (PACKAGE / folder).exists(), folder
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["wsi_pipeline*"]
    assert set(WORKBENCH) <= set(project["tool"]["mypy"]["files"])  # still type-checked
    assert all(f" {folder} " in (REPO / "Makefile").read_text() for folder in WORKBENCH)  # and linted


def test_the_workbench_check_catches_an_import(tmp_path: Path) -> None:
    root = tmp_path / "wsi_pipeline"
    _write(root, "__init__.py", "")
    _write(root, "demo.py", "import json\nfrom wsi_pipeline import io_atomic\n")
    assert workbench_imports(root) == []
    _write(root, "demo.py", "def f():\n    from benchmarks.memory import SavedTensorMeter\n")
    _write(root, "cli/run.py", "import importlib\nimportlib.import_module('tools.readme_table')\n")
    assert workbench_imports(root) == ["wsi_pipeline/cli/run.py:2: tools.readme_table",
                                       "wsi_pipeline/demo.py:2: benchmarks.memory"]


def test_the_workbench_imports_only_the_public_package() -> None:
    """The benchmarks may import the package, only its public names (no ``from x import _private``)."""
    found = []
    for folder in WORKBENCH:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wsi_pipeline"):
                    found += [f"{path.relative_to(REPO)}:{node.lineno}: {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "private names of the package used by the workbench:\n" + "\n".join(found)
