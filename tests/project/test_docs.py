"""The README stays a short guide and every link of the README and docs/ leads somewhere.

Links are checked as GitHub renders them: a relative path must exist in the repository, and an anchor
(``page.md#heading``) must be the slug of a heading of that page (lower case, punctuation other than ``-`` and
``_`` dropped, spaces to ``-``). Links to the web are not followed (no network in tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _outside_code(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (fenced code excluded), duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S).splitlines():
        if line.startswith("#"):
            s = slug(line.lstrip("#"))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_slug_follows_github() -> None:
    assert slug(" The `tile` command (`make tile`)") == "the-tile-command-make-tile"
    assert slug("In short: what goes in and comes out") == "in-short-what-goes-in-and-comes-out"
    assert slug("Evaluate: `wsi-pipeline eval`") == "evaluate-wsi-pipeline-eval"


def test_the_readme_is_a_short_guide() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (at most {README_MAX_LINES})"


def test_the_readme_pipeline_yaml_is_a_valid_config() -> None:
    from wsi_pipeline.config.pipeline import config_from_dict

    block = re.search(r"```yaml\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no ```yaml block (the minimal pipeline)"
    config = config_from_dict(yaml.safe_load(block.group(1)))
    assert config.methods and config.data.manifest


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_outside_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_architecture_lists_the_layers_the_layering_test_enforces() -> None:
    """docs/architecture.md's layer table names every package of ``LAYERS``, lowest first, and nothing else."""
    from test_layering import LAYERS

    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layers"):text.index("## Artefacts")]
    rows = [ln.split("|") for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| layer")]
    documented = [name for row in rows for name in re.findall(r"`([\w]+)`", row[2])]
    enforced = [name for layer in LAYERS for name in layer if name]
    assert documented == enforced, f"docs/architecture.md lists {documented}; LAYERS holds {enforced}"
