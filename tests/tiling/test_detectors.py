"""The tissue-detector registry: contract tests over every registered detector (mask shape and dtype on a
generated slide, parameters round-trip through what the store records, recorded settings and bounds), no
method-name string dispatch outside the registry, and the worked example of docs/extending.md (a saturation
detector registered in a few lines and tiled with)."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pytest

from wsi_pipeline.config.schema import spec
from wsi_pipeline.config.store_settings import StoreSettings
from wsi_pipeline.config.tiling import TilingConfig, tiler_config
from wsi_pipeline.config.tiling_params import DETECTOR_PARAMS, DetectorParams
from wsi_pipeline.data.store import open_store
from wsi_pipeline.slides import open_slide
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling import detectors
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.tiling.detectors import DETECTORS, DetectorMask, MaskView, TissueDetector, register_detector
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.tiling.params import output_params, store_settings
from wsi_pipeline.tiling.plan import plan_tiles

PACKAGE = Path(__file__).resolve().parents[2] / "wsi_pipeline"
NAMES = DETECTORS.names()
T = 32


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """512 x 512 px at 1 um/px: stained tissue on a third of the glass (16 x 16 tiles of 32 px)."""
    return make_slide(tmp_path_factory.mktemp("detectors") / "s.svs", size=512, tile_size=128, mpp=1.0, seed=7,
                      tissue_fraction=0.35).path


def _changed(params: DetectorParams) -> DetectorParams:
    """``params`` with one number moved inside its bounds (a value the round trip must carry)."""
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if isinstance(v, float) and not isinstance(v, bool):
            return dataclasses.replace(params, **{f.name: v * 0.5 if v > 0 else 0.25})
        if isinstance(v, int) and not isinstance(v, bool):
            return dataclasses.replace(params, **{f.name: v + 1})
    return params


def test_registries_agree() -> None:
    """Every detector's parameters are registered in the config layer under its name (what config files and
    the command line are checked against), and the built-ins are there."""
    assert {"tissue", "greyscale", "otsu", "unet"} <= set(NAMES)
    assert set(NAMES) == set(DETECTOR_PARAMS.names())
    for name in NAMES:
        det = DETECTORS.get(name)
        assert det.name == name and det.Params is DETECTOR_PARAMS.get(name) and det.Params.name == name
        assert issubclass(det.Params, DetectorParams) and 0 <= det.Params.min_foreground <= 1
        assert TilingConfig(method=name).threshold == det.Params.min_foreground
    with pytest.raises(ValueError, match="already registered"):
        register_detector("otsu", DETECTOR_PARAMS.get("otsu"))(DETECTORS.get("otsu"))


@pytest.mark.parametrize("name", NAMES)
def test_mask_on_a_generated_slide(slide: Path, name: str) -> None:
    """The detector's mask is a 2-D bool image; the plan's per-tile fractions are its footprint means, computed
    here from the mask directly; some tiles hold tissue and some glass."""
    config = TilingConfig(method=name, tile_size=T, qc=False, qc_mode="off")
    with open_slide(slide) as s:
        plan = plan_tiles(s, SlideJob("s", str(slide)), config)
    found = plan.found
    assert found is not None and found.mask.dtype == bool and found.mask.ndim == 2 and found.downsample >= 1
    assert plan.candidates is not None and plan.candidates.shape == (plan.grid.rows, plan.grid.cols) == (16, 16)
    assert 0 < plan.candidates.sum() < plan.candidates.size
    if found.per_tile:
        assert found.grey_band is not None and plan.otsu_fg is None
        return
    d = found.downsample
    for r, c in [(0, 0), (8, 8), (5, 11), (15, 15)]:
        ys = ((np.arange(found.mask.shape[0]) + 0.5) * d) // T == r
        xs = ((np.arange(found.mask.shape[1]) + 0.5) * d) // T == c
        ref = found.mask[np.ix_(ys, xs)].mean() if ys.any() and xs.any() else 0.0
        exact = float(T / d).is_integer()  # whole mask px per tile: the box mean is the mean of its px
        assert plan.otsu_fg[r, c] == pytest.approx(ref, abs=1e-6 if exact else 0.15)
    assert (plan.candidates == (plan.otsu_fg >= config.threshold - 1e-9)).all()


@pytest.mark.parametrize("name", NAMES)
def test_params_round_trip_through_the_recorded_settings(name: str) -> None:
    """What the store records gives back the detector's parameters (through StoreSettings and the YAML-like
    JSON a checkpoint keeps); a detector identified by a file records its fingerprint instead."""
    params = _changed(DETECTOR_PARAMS.get(name)())
    config = TilingConfig(method=name, detector=params)
    state = output_params(config)
    settings = StoreSettings.from_state(state)
    assert settings == store_settings(config) and settings.to_state() == state
    again = tiler_config(state)
    if name == "unet":  # a model file: recorded as its fingerprint, the shipped model is used again
        assert set(DETECTORS.get(name)(params).settings()) == {"tissue_model_fingerprint"} <= set(state)
        return
    assert again.detector == params and again.method == name
    assert DETECTOR_PARAMS.get(name).from_recorded(params.recorded()) == params


@pytest.mark.parametrize("name", NAMES)
def test_params_bounds_are_checked_on_construction(name: str) -> None:
    cls = DETECTOR_PARAMS.get(name)
    bounded = [f for f in dataclasses.fields(cls) if {"gt", "ge", "le"} & set(f.metadata)]
    for f in bounded:
        bad = f.metadata["gt"] if "gt" in f.metadata else f.metadata["ge"] - 1 if "ge" in f.metadata else f.metadata["le"] + 1
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{f.name}="):
            cls(**{f.name: bad})
    with pytest.raises(TypeError, match=f"expected {cls.__name__}"):
        TilingConfig(method=name, detector=_Other())


@dataclass(frozen=True)
class _Other(DetectorParams):
    pass


@pytest.mark.parametrize("name", NAMES)
def test_store_records_the_detector_settings(slide: Path, tmp_path: Path, name: str) -> None:
    """The store's recorded identity holds the detector's settings (and resume takes it as current)."""
    config = TilingConfig(method=name, tile_size=T, qc=False, qc_mode="off")
    rep = tile_cohort([SlideJob("s", str(slide))], tmp_path, config, workers=0, progress=False)
    assert rep.ok and rep.results[0].n_tiles > 0
    attrs = open_store(tmp_path / "s.zarr").attrs
    det = DETECTORS.get(name)(config.detector)
    for key, value in det.settings().items():
        assert attrs["tiling_identity"][key] == value
    assert attrs["method"] == name and attrs["min_foreground"] == config.threshold
    again = tile_cohort([SlideJob("s", str(slide))], tmp_path, config, workers=0, progress=False)
    assert again.results[0].status == "skipped" and "same slide and settings" in again.results[0].note


#: Files of the tiler and its settings, where a detector is chosen only through the registry.
_DISPATCH_FILES = [*sorted((PACKAGE / "tiling").glob("*.py")), PACKAGE / "config" / "tiling.py",
                   PACKAGE / "config" / "tiling_params.py", PACKAGE / "config" / "store_settings.py",
                   PACKAGE / "cli" / "tile.py"]


def _dispatch(path: Path, names: set[str]) -> list[str]:
    """``file:line`` of each comparison with a detector's name (``method == "otsu"``, ``x in ("tissue", "unet")``)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_no_method_name_dispatch_outside_the_registry(tmp_path: Path) -> None:
    names = set(NAMES)
    hits = [h for p in _DISPATCH_FILES for h in _dispatch(p, names)]
    assert hits == [], f"detector chosen by its name outside the registry: {hits}"
    # the check finds what it looks for
    probe = tmp_path / "probe.py"
    probe.write_text('if config.method == "otsu" or m in ("tissue", "unet"):\n    pass\n')
    assert _dispatch(probe, names) == ["probe.py:1", "probe.py:1"]


# --- the worked example of docs/extending.md ("Adding a tissue detector"), as written there -----------------------

@dataclass(frozen=True)
class SaturationParams(DetectorParams):
    """A pixel is tissue when its HSV saturation (0..255) reaches ``min_saturation``."""

    min_saturation: int = field(default=25, metadata=spec(ge=0, le=255))


class SaturationDetector(TissueDetector[SaturationParams]):
    def detect(self, view: MaskView) -> DetectorMask:
        saturation = cv2.cvtColor(view.overview, cv2.COLOR_RGB2HSV)[..., 1]
        return DetectorMask(saturation >= self.params.min_saturation, view.downsample)


@pytest.fixture
def saturation(monkeypatch: pytest.MonkeyPatch) -> type[TissueDetector]:
    """The example registered for one test (the registries are restored afterwards)."""
    monkeypatch.setattr(DETECTORS, "_items", dict(DETECTORS._items))
    monkeypatch.setattr(DETECTOR_PARAMS, "_items", dict(DETECTOR_PARAMS._items))
    monkeypatch.setattr(SaturationParams, "name", SaturationParams.name)
    return register_detector("saturation", SaturationParams)(SaturationDetector)


def test_worked_example_saturation_detector(saturation: type[TissueDetector], slide: Path, tmp_path: Path) -> None:
    config = TilingConfig(method="saturation", detector=SaturationParams(min_saturation=30), tile_size=T, qc_mode="off")
    report = tile_cohort([SlideJob("s", str(slide))], tmp_path, config, workers=0, progress=False)
    assert report.ok
    store = open_store(tmp_path / "s.zarr")
    assert store.attrs["method"] == "saturation"
    assert store.attrs["tiling_identity"]["saturation"] == {"min_saturation": 30}
    # the kept tiles are those whose overview footprint is >= half saturated: recomputed from the overview here
    with open_slide(slide) as s:
        plan = plan_tiles(s, SlideJob("s", str(slide)), config)
    sat = cv2.cvtColor(plan.overview, cv2.COLOR_RGB2HSV)[..., 1] >= 30
    per = T / plan.overview_downsample  # overview px per tile side (16)
    rows, cols = plan.grid.rows, plan.grid.cols
    frac = sat[: int(rows * per), : int(cols * per)].reshape(rows, int(per), cols, int(per)).mean(axis=(1, 3))
    kept = {tuple(g) for g in store.grid.tolist()}
    assert kept == {(c, r) for r, c in zip(*np.nonzero(frac >= 0.5 - 1e-9), strict=True)}
    assert 0 < len(kept) < rows * cols
    # a config file takes it by name, its parameters beside the others, checked against its bounds
    section = StoreSettings.from_section({"method": "saturation", "saturation": {"min_saturation": 30}})
    assert tiler_config(section).detector == SaturationParams(min_saturation=30)
    with pytest.raises(ValueError, match=r"saturation.min_saturation=300; expected a value <= 255"):
        StoreSettings.from_section({"method": "saturation", "saturation": {"min_saturation": 300}}, "data.tiling")


def test_module_lists_every_builtin_in_its_description() -> None:
    for name in ("tissue", "greyscale", "otsu", "unet"):
        assert f"``{name}``" in (detectors.__doc__ or "")
