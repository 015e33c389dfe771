"""Run checkpoints as one typed artefact: files written by the release before ``RunCheckpoint``
(``tests/fixtures/checkpoints``, made by its ``make_checkpoints.py``) load through the migrations
with every weight and field as written; each migration step against the documented defaults; the
state round-trips through the file with ``weights_only=True``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from wsi_pipeline.config.pipeline import config_from_dict
from wsi_pipeline.checkpoints.files import load_checkpoint, load_run_checkpoint, save_run_checkpoint
from wsi_pipeline.checkpoints.migrations import MIGRATIONS, SCHEMA_VERSION, migrate
from wsi_pipeline.methods.endpoints import Endpoint
from wsi_pipeline.checkpoints.run import ResumeState, RunCheckpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def _equal(a, b) -> bool:
    """Nested equality with tensors compared exactly (dtype, shape and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_previous_release_checkpoints_load_through_the_migrations(name, tmp_path) -> None:
    path = tmp_path / name
    shutil.copyfile(FIXTURES / name, path)
    shutil.copyfile(FIXTURES / f"{name}.sha256", tmp_path / f"{name}.sha256")
    raw = torch.load(path, weights_only=True)  # the file as written, read directly
    assert "schema_version" not in raw and raw["format"] == "wsi-pipeline/checkpoint-v1"  # the old layout
    want = EXPECTED[name]
    assert sorted(k for k in raw if k != "integrity") == want["keys"]
    ckpt = load_run_checkpoint(path)
    assert ckpt.schema_version == SCHEMA_VERSION == 2
    # fields as written
    assert (ckpt.method["name"], ckpt.seed, ckpt.epoch) == (want["method"], want["seed"], want["epoch"])
    assert _equal(ckpt.best, want["best"]) and _equal(ckpt.best, raw["best"])
    assert ckpt.endpoint == want["endpoint"] == raw["endpoint"]
    assert ckpt.encoder_info == want["encoder_info"] and ckpt.stain_normalise == want["stain_normalise"]
    assert ckpt.tiling is None and want["tiling"] is None and ckpt.stain is None
    assert _equal(ckpt.stain_reference, raw["stain_reference"]) and _equal(ckpt.config, raw["config"])
    # weights equal the file's, and what the writing release summed
    assert _equal(ckpt.models, raw["models"])
    assert {k: float(v.double().sum()) for k, v in ckpt.models["aggregator"].items()} == pytest.approx(want["aggregator_sum"], rel=1e-12)
    if "optimizer" in raw:
        assert ckpt.resume is not None and len(ckpt.resume.history) == want["history_len"]
        assert _equal(ckpt.resume.to_state(), {k: raw[k] for k in ("optimizer", "scheduler", "rng", "history")})
    else:
        assert ckpt.resume is None
    # the saved config builds, its method is the run's, the endpoint restores
    config = ckpt.pipeline_config()
    assert ckpt.method_config(config).name == want["method"]
    assert ckpt.endpoint_spec().task == want["endpoint"]["task"] == config.methods[0].task
    # written again by today's code: the same entries, now versioned, read back with weights_only=True
    again = save_run_checkpoint(tmp_path / "again.pt", ckpt)
    back = torch.load(again, weights_only=True)
    assert back["schema_version"] == 2
    assert _equal({k: v for k, v in back.items() if k not in ("format", "integrity", "schema_version")},
                  {k: v for k, v in raw.items() if k not in ("format", "integrity")})
    assert _equal(load_run_checkpoint(again).to_state(), ckpt.to_state())


def _v1_state(**drop_or_set) -> dict:
    """A minimal version-1 state as the earliest releases wrote it (no endpoint, seed, encoder_info, stain keys)."""
    state = {"format": "wsi-pipeline/checkpoint-v1",
             "config": {"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 3},
                        "methods": [{"name": "m", "strategy": "frozen"}]},
             "method": {"name": "m", "strategy": "frozen"}, "epoch": 4,
             "models": {"encoder": None, "aggregator": {"w": torch.arange(6.0).reshape(2, 3)}}}
    state.update(drop_or_set)
    return state


def test_v1_to_v2_fills_what_the_readers_of_that_time_assumed() -> None:
    new = MIGRATIONS[1](_v1_state())
    assert new["schema_version"] == 2 and new["seed"] == 0 and new["encoder_info"] is None
    assert new["endpoint"] == {"task": "classification", "loss": "cross_entropy", "n_outputs": 3}  # data.n_classes
    assert new["stain_normalise"] == "none"
    assert new["tiling"] is None and new["stain_reference"] is None and new["stain"] is None
    # what a version-1 file had is kept as it is
    kept = MIGRATIONS[1](_v1_state(seed=7, endpoint={"task": "survival", "loss": "cox", "n_outputs": 1},
                                   tiling={"tile_size": 64}))
    assert (kept["seed"], kept["endpoint"]["loss"], kept["tiling"]) == (7, "cox", {"tile_size": 64})
    stained = _v1_state()
    stained["config"]["data"]["stain"] = {"normalise": "macenko"}
    assert MIGRATIONS[1](stained)["stain_normalise"] == "macenko"
    ckpt = RunCheckpoint.from_state(_v1_state())
    assert Endpoint.from_state(ckpt.endpoint).n_outputs == 3 and ckpt.models["encoder"] is None


def test_migrate_refuses_what_it_cannot_read() -> None:
    no_classes = _v1_state()
    del no_classes["config"]["data"]["n_classes"]
    with pytest.raises(ValueError, match=r"x.pt \(checkpoint schema version 1\) has no endpoint and its config no data.n_classes"):
        migrate(no_classes, "x.pt")
    with pytest.raises(ValueError, match=r"x.pt has checkpoint schema version 3, newer than this version"):
        migrate({**_v1_state(), "schema_version": 3}, "x.pt")
    with pytest.raises(ValueError, match=r"x.pt: schema_version='2'; expected an integer >= 1"):
        migrate({**_v1_state(), "schema_version": "2"}, "x.pt")
    with pytest.raises(ValueError, match=r"x.pt is not a run checkpoint: it has no 'config', 'method'"):
        RunCheckpoint.from_state({"kind": "tissue", "epoch": 1, "models": {}}, "x.pt")
    with pytest.raises(TypeError, match=r"x.pt.seed: expected an integer, got str"):
        RunCheckpoint.from_state({**_v1_state(), "seed": "0"}, "x.pt")
    assert _equal(migrate(migrate(_v1_state())), migrate(_v1_state()))  # today's layout passes unchanged


def test_build_is_the_one_constructor_and_the_file_round_trips(tmp_path) -> None:
    cfg = config_from_dict({"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
                            "methods": [{"name": "m", "strategy": "frozen", "encoder": {"name": "ilse_cnn"},
                                         "aggregator": {"name": "mean", "options": {"hidden": 4}}}]})
    torch.manual_seed(0)
    agg = {"w": torch.randn(4, 3), "b": torch.zeros(2, dtype=torch.float64)}
    ckpt = RunCheckpoint.build(cfg, cfg.methods[0], seed=1, epoch=2, models={"encoder": None, "aggregator": agg},
                               best={"metric": "auc", "value": 0.5, "epoch": 2, "loss": None})
    # default endpoint: the method's task and loss over data.n_classes outputs
    assert ckpt.endpoint == Endpoint(task="classification", loss="cross_entropy", n_outputs=2).to_state()
    resume = ResumeState(optimizer={"state": {}, "param_groups": []}, scheduler={"epoch": 2},
                         rng={"torch": torch.get_rng_state()}, history=[{"epoch": 1}, {"epoch": 2}])
    last = save_run_checkpoint(tmp_path / "last.pt", RunCheckpoint.build(
        cfg, cfg.methods[0], seed=1, epoch=2, models={"encoder": None, "aggregator": agg}, resume=resume))
    state = load_checkpoint(last)  # plain containers: weights_only=True read it
    assert {"optimizer", "scheduler", "rng", "history", "schema_version"} <= set(state) and "resume" not in state
    back = load_run_checkpoint(last)
    assert back.resume is not None and _equal(back.resume.to_state(), resume.to_state())
    assert _equal(back.models["aggregator"], agg) and back.pipeline_config() == cfg
    with pytest.raises(ValueError, match=r"RunCheckpoint.epoch=-1; expected a value >= 0"):
        RunCheckpoint(config={}, method={}, seed=0, epoch=-1, models={}, endpoint={})


def test_tissue_checkpoints_of_the_previous_layout_load(tmp_path) -> None:
    """The shipped U-Net (a version-1 ``best.pt``) and a version-1 ``last.pt`` (channels and mpp only in its
    settings JSON), as the previous release wrote them, load through the tissue migration."""
    from wsi_pipeline.checkpoints.files import save_checkpoint
    from wsi_pipeline.tissue_seg.checkpoint import MODEL_KIND, TissueCheckpoint, load_tissue_checkpoint, save_tissue_checkpoint
    from wsi_pipeline.tissue_seg.model import TissueUNet
    from wsi_pipeline.tissue_seg.tiling_mask import resolve_tissue_model

    shipped = resolve_tissue_model(None)
    raw = torch.load(shipped, weights_only=True)
    assert "schema_version" not in raw
    ckpt = load_tissue_checkpoint(shipped)
    assert (ckpt.channels, ckpt.mpp, ckpt.schema_version) == (raw["channels"], raw["mpp"], 2)
    assert _equal(ckpt.model, raw["model"]) and ckpt.resume is None
    torch.manual_seed(0)
    model = TissueUNet(4)
    settings = {"mpp": 4.0, "channels": 4, "lr": 1e-3}
    old = save_checkpoint(tmp_path / "last.pt", {  # the layout the previous release wrote for last.pt
        "kind": MODEL_KIND, "settings": json.dumps(settings), "model": model.state_dict(),
        "optimizer": {"state": {}, "param_groups": []}, "epoch": 3, "history": [{"epoch": 1}], "best": {"epoch": 2}})
    back = load_tissue_checkpoint(old)
    assert (back.channels, back.mpp) == (4, 4.0) and _equal(back.model, model.state_dict())
    assert back.resume is not None and (back.resume.epoch, json.loads(back.resume.settings)) == (3, settings)
    again = load_tissue_checkpoint(save_tissue_checkpoint(tmp_path / "again.pt", back))
    assert _equal(again.to_state(), back.to_state()) and again.to_state()["schema_version"] == 2
    assert _equal(TissueCheckpoint.build(model, mpp=4.0).model, model.state_dict())


def test_a_patchgd_checkpoint_keeps_the_options_it_was_trained_with(tmp_path) -> None:
    """The resolved PatchGD options are stored (versioned) and rebuild the head even when the saved config
    would resolve to others today; a checkpoint without them resolves from its config, as before."""
    import dataclasses

    from wsi_pipeline.config.patchgd import PatchGDConfig
    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.methods.models import build_models

    cfg = config_from_dict({"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
                            "methods": [{"name": "pg", "strategy": "patchgd", "encoder": {"name": "ilse_cnn"},
                                         "aggregator": {"name": "transformer", "options": {"dim": 8}},
                                         "patchgd": {"max_grid": 64}}]})
    m = cfg.methods[0]
    torch.manual_seed(0)
    enc, head = build_models(m, 2, for_training=False)
    ckpt = RunCheckpoint.build(cfg, m, seed=0, epoch=1, models={"encoder": enc.state_dict(), "aggregator": head.state_dict()})
    assert ckpt.patchgd == m.patchgd_config.to_state() and ckpt.patchgd["schema_version"] == 1
    path = save_run_checkpoint(tmp_path / "best.pt", ckpt)
    assert PatchGDConfig.from_state(torch.load(path, weights_only=True)["patchgd"]) == m.patchgd_config
    assert load_trained_model(path).aggregator.max_grid == 64
    # the saved config now says another cap (as a changed default would): the stored options win
    changed = dict(ckpt.config)
    changed["methods"] = [{**changed["methods"][0], "patchgd": {"max_grid": 32}}]
    tm = load_trained_model(save_run_checkpoint(tmp_path / "changed.pt", dataclasses.replace(ckpt, config=changed)))
    assert tm.aggregator.max_grid == 64 and tm.method.patchgd == {"max_grid": 32}
    # written before the options were stored: resolved from the saved config
    old = save_run_checkpoint(tmp_path / "old.pt", dataclasses.replace(ckpt, config=changed, patchgd=None))
    assert load_trained_model(old).aggregator.max_grid == 32
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in tm.aggregator.state_dict().items())
