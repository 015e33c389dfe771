"""docs/interop.md: every ```python block runs as written (each a worked example of one format, asserting what
is read back), and its pipeline YAML is a valid config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_extending_docs import python_blocks

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "interop.md"
BLOCKS = python_blocks(PAGE.read_text())


def test_the_page_has_a_worked_example_per_format() -> None:
    headings = [h for h, _ in BLOCKS]
    for fmt in ("TRIDENT", "CLAM", "STAMP"):
        assert any(h.startswith(fmt) for h in headings), f"docs/interop.md has no python example under a {fmt} heading"
    assert any("--layout" in h for h in headings)


@pytest.mark.parametrize("source", [s for _, s in BLOCKS], ids=[h for h, _ in BLOCKS])
def test_every_python_block_runs(source: str) -> None:
    exec(compile(source, "<docs/interop.md block>", "exec"), {"__name__": "__interop_example__"})


def test_the_pipeline_yaml_is_a_valid_config() -> None:
    from wsi_pipeline.config.pipeline import config_from_dict

    block = re.search(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    assert block
    config = config_from_dict(yaml.safe_load(block.group(1)))
    assert config.data.features is not None and config.data.tiles_dir is None
    assert config.methods[0].encoder.name == "precomputed"
