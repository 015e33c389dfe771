"""Every pipelines/*.yaml validates with the training stage's loader and its methods build; the
paper's three pipelines (panda_cosine, panda_exp, camelyon) hold every row of the Big-Layers
paper's Tables 1-3 as a method with the paper's hyperparameters (section 4.2, written out below),
and the README maps each row to its pipeline and method."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from wsi_pipeline.config.pipeline import EvalProtocol, load_config

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
ALL_YAML = sorted(PIPELINES.glob("*.yaml"))
PAPER_FILES = ("panda_cosine", "panda_exp", "camelyon")
AGGS = {"ABMIL": "abmil", "DTFD": "dtfd", "TransMIL": "transmil"}
# the paper's row order: plain rows then -Aug rows; per aggregator Baseline, then + Ours
ROWS = [(f"{agg}{aug} / {kind}", f"{AGGS[agg]}_{'frozen' if kind == 'Baseline' else 'bigl'}{'_aug' if aug else ''}")
        for aug in ("", "-Aug") for agg in AGGS for kind in ("Baseline", "+ Ours")]
FOUNDATION = [f"{fm} / {agg}" for fm in ("H-optimus-1", "Prov-GigaPath", "UNI2-h") for agg in AGGS]

# The paper's section 4.2.5 / 4.2.4, transcribed: (pipeline, frozen | bigl) -> settings
PANDA_COSINE = dict(epochs=20, schedule="cosine", accumulate_batches=16, batch_bags=2, bag_size=256, demon=False)
PANDA_EXP = dict(epochs=45, schedule="exponential", gamma=0.955, accumulate_batches=1, batch_bags=2, bag_size=256, demon=False)
PAPER = {
    ("panda_cosine", "frozen"): PANDA_COSINE, ("panda_cosine", "bigl"): PANDA_COSINE,
    ("panda_exp", "frozen"): PANDA_EXP, ("panda_exp", "bigl"): PANDA_EXP,
    ("camelyon", "frozen"): dict(epochs=120, lr=1e-4, schedule="cosine", accumulate_batches=2, bag_size=1024, demon=False),
    ("camelyon", "bigl"): dict(epochs=90, lr=5e-5, schedule="cosine", accumulate_batches=2, batch_bags=2, bag_size=512,
                               demon=True),
}


def test_the_paper_pipelines_replace_the_per_row_files():
    assert sorted(p.stem for p in ALL_YAML) == sorted([*PAPER_FILES, "demo", "demo_survival", "foundation", "ilse_colon", "ilse_colon_grid",
                                                       "lung_mosaic", "own_cohort", "patchgd_paper",
                                                       "train_example"])


def _weightless(method):
    """``method`` with an ImageNet weights file (not on this machine) replaced by random initialisation."""
    return dataclasses.replace(method, encoder=dataclasses.replace(method.encoder, weights=None))


_BUILT: set[str] = set()  # models already built and run by an earlier method (the -Aug rows share their row's models)


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.name)
def test_every_config_loads_and_its_methods_build(path):
    """Each method passes its strategy's checks, and its models build and map a 3-tile bag to C logits."""
    from wsi_pipeline.config.pipeline import config_to_dict
    from wsi_pipeline.methods.models import build_models
    from wsi_pipeline.inference.protocols import run_aggregator
    from wsi_pipeline.models import ENCODERS
    from wsi_pipeline.training.strategies import check_strategy

    from wsi_pipeline.methods.endpoints import endpoint_outputs

    cfg = load_config(path)
    tiles = torch.rand(3, 3, 32, 32)
    for m in cfg.methods:
        check_strategy(m)
        assert m.encoder.name in ENCODERS.names()
        C = endpoint_outputs(m, cfg.data.n_classes)  # classes, or 1 for a Cox risk
        m = _weightless(m)
        key = repr((C, config_to_dict(dataclasses.replace(m, name="m", train=type(m.train)(), val_protocol=EvalProtocol()))))
        if key in _BUILT:
            continue
        _BUILT.add(key)
        if m.encoder.foundation:  # full-size ViTs: built and run on the meta device (shapes only, no compute)
            with torch.device("meta"):
                encoder, aggregator = build_models(m, C, device="meta", for_training=True)
                z = encoder(tiles.to("meta"))
            assert z.shape == (3, encoder.num_features) and aggregator is not None, m.name
            continue
        if m.strategy == "patchgd":  # the grid head needs a tile grid: built, not run here
            build_models(m, C, for_training=True)
            continue
        torch.manual_seed(0)
        encoder, aggregator = build_models(m, C, for_training=False)
        encoder.eval(), aggregator.eval()
        with torch.no_grad():
            z = encoder(tiles)
            out = run_aggregator(aggregator, z)
        assert z.shape == (3, encoder.num_features) and out.logits.shape[-1] == C, (m.name, z.shape, out.logits.shape)


@pytest.mark.parametrize("name", PAPER_FILES)
def test_paper_pipelines_hold_every_row_with_the_papers_settings(name):
    cfg = load_config(PIPELINES / f"{name}.yaml")
    assert cfg.name == name and cfg.seeds == (0, 1, 2)  # three models per method
    assert [m.name for m in cfg.methods] == [method for _, method in ROWS]  # the paper's rows, in its order
    cohort = name.split("_")[0]
    for m in cfg.methods:
        agg, kind, *aug = m.name.split("_")
        assert (m.aggregator.name, m.encoder.name, m.strategy) == (agg, "resnet18", kind), m.name
        assert m.encoder.weights is not None  # ImageNet initialisation
        assert kind == "frozen" or m.encoder.bn == "train", m.name  # + Ours: BatchNorm over the whole bag
        if agg == "transmil":
            assert m.aggregator.options.get("nystrom") == "reference"
        if agg == "dtfd":
            assert m.aggregator.options == {"n_groups": 4, "distill": "afs"}
        t = m.train
        for key, value in PAPER[(name, kind)].items():
            got = t.demon.enabled if key == "demon" else getattr(t, key)
            assert got == pytest.approx(value), (m.name, key, got, value)
        assert t.weight_decay == pytest.approx(1e-4) and t.select_metric == "qwk", m.name
        assert t.augment.enabled == (aug == ["aug"]), m.name
        if cohort == "panda":
            assert t.lr in (1e-4, 5e-5, 1e-5)
            assert m.val_protocol == EvalProtocol()
        else:  # section 4.2.4: our DTFD and TransMIL models on 3 x 2048 tiles, the rest on all tiles
            sampled = kind == "bigl" and agg in ("dtfd", "transmil")
            assert m.val_protocol == (EvalProtocol(2048, 3) if sampled else EvalProtocol()), m.name
    if cohort == "panda":
        assert cfg.data.n_classes == 6 and cfg.data.tiling.min_foreground == pytest.approx(0.6)
        assert cfg.eval.protocols == (EvalProtocol(), EvalProtocol(256, 100))  # all tiles; TCGA-PRAD-256
    else:
        assert cfg.data.n_classes == 2 and cfg.data.tiling.method == "otsu"
        assert cfg.eval.protocols == (EvalProtocol(), EvalProtocol(2048, 10))  # CAM-All, CAM-2048
    assert cfg.data.tiling.tile_size == 256 and cfg.data.tiling.mpp_target == pytest.approx(0.5)


def test_a_method_overrides_the_pipelines_validation_protocol(tmp_path):
    """``eval.val_protocol`` is the default of every method's ``val_protocol``; a method's own wins,
    ``--set`` reaches both, and the resolved value survives a save/load round trip."""
    from wsi_pipeline.config.pipeline import config_from_dict, config_to_dict

    cfg = load_config(PIPELINES / "camelyon.yaml", ["eval.val_protocol=sub64x2",
                                                    "methods.abmil_bigl.val_protocol=ens8x4"])
    by = {m.name: m.val_protocol for m in cfg.methods}
    assert by["abmil_frozen"] == EvalProtocol(64, 2)  # inherits the (overridden) pipeline default
    assert by["abmil_bigl"] == EvalProtocol(8, 4, ensemble=True)
    assert by["dtfd_bigl"] == EvalProtocol(2048, 3)  # its own, from the YAML
    assert config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match=r"methods\.abmil_bigl\.val_protocol"):
        load_config(PIPELINES / "camelyon.yaml", ["methods.abmil_bigl.val_protocol=some"])


def _map_rows(text: str) -> list[list[str]]:
    """Rows of the README's row -> method table (cells stripped of backticks)."""
    section = text.split("## Paper rows and methods", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] == "Big-Layers":
            rows.append(cells)
    return rows


def test_readme_maps_every_paper_row_to_a_pipeline_method():
    rows = _map_rows((PIPELINES / "README.md").read_text())
    configs = {name: {m.name for m in load_config(PIPELINES / f"{name}.yaml").methods} for name in PAPER_FILES}
    listed: dict[str, list[str]] = {name: [] for name in PAPER_FILES}
    for table, cohort_files in (("1", ["panda_cosine.yaml", "panda_exp.yaml"]), ("2, 3", ["camelyon.yaml"])):
        mine = {row: (files, method) for _, t, row, files, method in rows if t == table}
        for row, method in ROWS:
            files, got = mine[row]
            assert got == method and [f.strip() for f in files.split(",")] == cohort_files, (table, row, files, got)
            for f in cohort_files:
                listed[f.removesuffix(".yaml")].append(got)
        for row in FOUNDATION:
            assert mine[row][1] == "-", row  # no config: foundation encoders are not in the registry
    for name in PAPER_FILES:  # every method of every paper pipeline is mapped to a row, once
        assert sorted(listed[name]) == sorted(configs[name]), name
