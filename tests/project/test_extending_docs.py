"""Every ```python block of docs/extending.md runs as written.

The blocks run in one child process (each registers components under new names, which must not leak into the
registries of this test session), in page order, each in a fresh namespace; the child reports, per block, the
traceback or nothing. A block added to the page later is collected here without editing this file. Keep each
example to a second or two (toy sizes): the suite's time is the budget, not an assertion (no timed tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "extending.md"

_RUNNER = """
import json, sys, time, traceback
blocks = json.load(sys.stdin)
results = []
for source in blocks:
    t0 = time.perf_counter()
    try:
        exec(compile(source, "<docs/extending.md block>", "exec"), {"__name__": "__extending_example__"})
        error = None
    except BaseException:
        error = traceback.format_exc()
    results.append({"error": error, "seconds": time.perf_counter() - t0})
print("RESULTS " + json.dumps(results))
"""


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(heading of the section, source) of every ```python block of ``text``, in order; a line starting with # inside
    a fence is code, not a heading."""
    out: list[tuple[str, str]] = []
    heading, fence, lines = "(top)", None, []
    for line in text.splitlines(keepends=True):
        if fence is None:
            if line.startswith("```"):
                fence, lines = line[3:].strip(), []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif line.startswith("```"):
            if fence == "python":
                out.append((heading, "".join(lines)))
            fence = None
        else:
            lines.append(line)
    return out


BLOCKS = python_blocks(PAGE.read_text())


def test_the_page_has_the_worked_examples() -> None:
    headings = {h for h, _ in BLOCKS}
    assert {"Adding an encoder", "Adding an aggregator", "Adding a training strategy"} <= headings, headings


def test_the_block_extractor_finds_blocks_under_their_headings() -> None:
    text = "# A\n\n```python\nx = 1\n```\n\n## B\n```bash\n# not a heading\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [("A", "x = 1\n"), ("B", "y = 2\n")]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([src for _, src in BLOCKS]),
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and line, f"the runner failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(line[-1][len("RESULTS "):])


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"{i}-{h}" for i, (h, _) in enumerate(BLOCKS)])
def test_every_python_block_runs(results: list[dict], i: int) -> None:
    heading, _ = BLOCKS[i]
    assert results[i]["error"] is None, f"docs/extending.md, block {i} under '{heading}':\n{results[i]['error']}"
