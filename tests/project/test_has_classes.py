"""The task is the only path: outside ``wsi_pipeline/tasks/`` at most two lines read ``has_classes`` (issue 50).

Classification goes through its Task like every task (scores, rows, records, reports, validation); what
differs is asked of the task, not branched on a class flag. The few lines left each say why in a comment.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "wsi_pipeline"
MAX_USES = 2
WORD = re.compile(r"\bhas_classes\b")


def uses_outside_tasks(root: Path = PACKAGE) -> list[str]:
    """``path:line: text`` of every line of the package outside ``tasks/`` that names ``has_classes``."""
    tasks = root / "tasks"
    return [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py"))
            if tasks not in p.parents
            for i, line in enumerate(p.read_text().splitlines(), 1) if WORD.search(line)]


def test_has_classes_is_read_at_most_twice_outside_the_tasks() -> None:
    found = uses_outside_tasks()
    assert len(found) <= MAX_USES, (
        f"{len(found)} lines outside wsi_pipeline/tasks/ read has_classes (at most {MAX_USES}); ask the task instead "
        "(a Task method each task answers):\n" + "\n".join(found))


def test_each_remaining_use_says_why() -> None:
    missing = [f for f in uses_outside_tasks() if "#" not in f.split(": ", 1)[1]]
    assert not missing, "a line that still reads has_classes needs a comment saying why:\n" + "\n".join(missing)


def test_the_count_sees_a_new_use(tmp_path: Path) -> None:
    pkg = tmp_path / "wsi_pipeline"
    (pkg / "tasks").mkdir(parents=True)
    (pkg / "tasks" / "base.py").write_text("has_classes = False\n")
    (pkg / "stage.py").write_text("if task.has_classes:\n    pass\nx = 'has_classes_only'\n")
    assert uses_outside_tasks(pkg) == ["stage.py:1: if task.has_classes:"]
