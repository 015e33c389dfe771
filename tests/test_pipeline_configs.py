"""Every pipelines/*.yaml validates with the training stage's loader; the paper's configs carry the
Big-Layers paper's hyperparameters (section 4.2, written out below) and the README maps each
row of its Tables 1 and 2 to configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wsi_pipeline.config.pipeline import Protocol, load_config

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"
ALL_YAML = sorted(PIPELINES.glob("*.yaml"))
PAPER_YAML = [p for p in ALL_YAML if re.match(r"^(panda|camelyon)_", p.stem)]
ROWS = [f"{agg}{aug} / {kind}" for aug in ("", "-Aug") for agg in ("ABMIL", "DTFD", "TransMIL") for kind in ("Baseline", "+ Ours")]

# The paper's section 4.2.5 / 4.2.4, transcribed: (cohort, schedule or approach) -> settings
PAPER = {
    ("panda", "cosine"): dict(epochs=20, schedule="cosine", accumulate_batches=16, batch_bags=2, bag_size=256, demon=False),
    ("panda", "exp"): dict(epochs=45, schedule="exponential", gamma=0.955, accumulate_batches=1, batch_bags=2, bag_size=256,
                           demon=False),
    ("camelyon", "frozen"): dict(epochs=120, lr=1e-4, schedule="cosine", accumulate_batches=2, bag_size=1024, demon=False),
    ("camelyon", "bigl"): dict(epochs=90, lr=5e-5, schedule="cosine", accumulate_batches=2, batch_bags=2, bag_size=512,
                               demon=True),
}


def test_there_are_configs():
    assert len(PAPER_YAML) == 36, [p.name for p in PAPER_YAML]


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.name)
def test_every_config_loads_and_its_parts_exist(path):
    from wsi_pipeline.models import AGGREGATORS, ENCODERS, build_aggregator
    from wsi_pipeline.models.heads import HEADS
    from wsi_pipeline.training.strategies import check_strategy

    cfg = load_config(path)
    for m in cfg.methods:
        check_strategy(m)
        assert m.encoder.name in ENCODERS.names()
        if m.strategy == "patchgd":  # the aggregator entry names a PatchGD head
            assert m.aggregator.name in HEADS.names()
        else:
            assert m.aggregator.name in AGGREGATORS.names()
            build_aggregator(m.aggregator.name, 16, cfg.data.n_classes, **m.aggregator.options)


@pytest.mark.parametrize("path", PAPER_YAML, ids=lambda p: p.name)
def test_paper_configs_follow_the_paper(path):
    cfg = load_config(path)
    cohort, agg, kind, *rest = path.stem.split("_")
    aug = "aug" in rest
    assert cfg.name == path.stem and len(cfg.methods) == 1 and len(cfg.seeds) == 3
    m = cfg.methods[0]
    assert (m.aggregator.name, m.encoder.name) == (agg, "resnet18")
    assert m.encoder.weights is not None  # ImageNet initialisation
    assert m.strategy == kind and (kind == "frozen" or m.encoder.bn == "train")
    t = m.train
    expected = PAPER[(cohort, rest[-1] if cohort == "panda" else kind)]
    for key, value in expected.items():
        got = t.demon.enabled if key == "demon" else getattr(t, key)
        assert got == pytest.approx(value), (key, got, value)
    assert t.weight_decay == pytest.approx(1e-4) and t.select_metric == "qwk" and t.augment.enabled == aug
    if cohort == "panda":
        assert t.lr in (1e-4, 5e-5, 1e-5)
        assert cfg.data.n_classes == 6 and cfg.data.tiling.min_foreground == pytest.approx(0.6)
        assert cfg.eval.protocols == (Protocol(), Protocol(256, 100)) and cfg.eval.val_protocol == Protocol()
    else:
        assert cfg.data.n_classes == 2
        assert cfg.eval.protocols == (Protocol(), Protocol(2048, 10))
        sampled = kind == "bigl" and agg in ("dtfd", "transmil")
        assert cfg.eval.val_protocol == (Protocol(2048, 3) if sampled else Protocol())
    assert cfg.data.tiling.tile_size == 256


def _table_rows(text: str, heading: str) -> dict[str, list[str]]:
    """Paper row -> config file names in the README table under ``heading``."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 1 and " / " in cells[0]:
            rows[cells[0]] = re.findall(r"`([\w.-]+\.yaml)`", line)
    return rows


def test_readme_maps_every_paper_row():
    text = (PIPELINES / "README.md").read_text()
    t1 = _table_rows(text, "## Table 1")
    t2 = _table_rows(text, "## Table 2")
    for row in ROWS:
        assert len(t1[row]) == 2 and len(t2[row]) == 1, row
    for fm in ("H-optimus-1", "Prov-GigaPath", "UNI2-h"):
        for agg in ("ABMIL", "DTFD", "TransMIL"):
            assert f"{fm} / {agg}" in t1 and f"{fm} / {agg}" in t2
    listed = [f for files in (*t1.values(), *t2.values()) for f in files]
    assert sorted(listed) == sorted(p.name for p in PAPER_YAML)  # each config once, each exists
