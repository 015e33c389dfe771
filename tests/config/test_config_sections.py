"""Config sections: one choice list per option (agreeing with the registries and strategies), one
TilingConfig and its bridge, PatchGD options checked by the builder with one head rule, saved
configs of earlier versions, atomic saving."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from wsi_pipeline.config import choices
from wsi_pipeline.config.pipeline import (
    EncoderConfig,
    StoreSettings,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    save_config,
    upgrade_saved_config,
)
from wsi_pipeline.config.tiling import DEFAULT_MIN_FOREGROUND, TilingConfig, tiler_config
from wsi_pipeline.config.tiling_params import GreyscaleParams, OtsuParams, TissueParams


def test_choice_lists_are_the_literals_and_the_registries():
    hints = typing.get_type_hints(TrainConfig)
    assert typing.get_args(hints["schedule"]) == choices.SCHEDULES
    assert typing.get_args(hints["select_metric"]) == choices.SELECT_METRICS
    assert typing.get_args(typing.get_type_hints(EncoderConfig)["bn"]) == choices.BN_MODES
    from wsi_pipeline.config.patchgd_presets import PRESETS
    from wsi_pipeline.models import AGGREGATORS, ENCODERS
    from wsi_pipeline.models.heads import HEADS
    from wsi_pipeline.training import accumulate, strategies

    assert set(choices.strategy_names()) == set(strategies.STRATEGIES.names())
    assert set(choices.PATCHGD_PRESETS) == set(PRESETS)
    assert choices.encoder_names() == ENCODERS.names() and choices.head_names() == HEADS.names()
    assert set(choices.model_names()) == set(AGGREGATORS.names()) | set(HEADS.names())
    # the strategies' BatchNorm modes are subsets of the one list, named in config.choices
    assert set(accumulate.BN_MODES) == set(choices.ACCUMULATE_BN_MODES)
    assert strategies.STRATEGIES.get("accumulate").bn_modes == choices.ACCUMULATE_BN_MODES
    assert strategies.STRATEGIES.get("patchgd").bn_modes == choices.PATCHGD_BN_MODES
    for name in choices.strategy_names():
        assert set(strategies.STRATEGIES.get(name).bn_modes) <= set(choices.BN_MODES)
    assert tuple(DEFAULT_MIN_FOREGROUND) == choices.TILING_METHODS


def test_strategy_traits_name_the_registered_strategies():
    """One traits entry per registered strategy , and
    the registry classes' own attributes agree with the traits (features read, optimiser stepped)."""
    from wsi_pipeline.config.strategy_traits import STRATEGY_TRAITS, grid_head_strategies, strategy_traits
    from wsi_pipeline.training import strategies

    assert choices.strategy_names() == list(STRATEGY_TRAITS)
    assert set(STRATEGY_TRAITS) == set(strategies.STRATEGIES.names())
    for name, traits in STRATEGY_TRAITS.items():
        cls = strategies.STRATEGIES.get(name)
        assert strategy_traits(name) is traits and cls.name == name
        assert cls.uses_features == (not traits.trains_encoder), name
        assert cls.steps_optimizer == traits.grid_head, name
        assert (not traits.trains_encoder or traits.grid_head) == (not cls.applies_augment or cls.uses_features), name
    assert grid_head_strategies() == ["patchgd"]
    with pytest.raises(ValueError, match=r"strategy='fancy'; expected one of \['frozen', 'full', 'accumulate', 'bigl', 'patchgd'\]"):
        strategy_traits("fancy")


@pytest.mark.parametrize("name", choices.strategy_names())
def test_models_follow_the_strategy_traits(name):
    """What ``build_models`` makes of each strategy is what its traits say: a trained or frozen encoder,
    Big-Layers or plain, a grid head or the MIL aggregator."""
    import torch

    from wsi_pipeline.config.pipeline import AggregatorConfig, EncoderConfig, MethodConfig
    from wsi_pipeline.config.strategy_traits import strategy_traits
    from wsi_pipeline.methods.models import build_models
    from wsi_pipeline.models.aggregators.abmil import ABMIL
    from wsi_pipeline.models.encoders import ResNet
    from wsi_pipeline.models.heads import GridHead

    traits = strategy_traits(name)
    method = MethodConfig(name="m", strategy=name, encoder=EncoderConfig(name="resnet18"),
                          aggregator=AggregatorConfig(name="abmil"))
    torch.manual_seed(0)
    encoder, aggregator = build_models(method, 2, device="cpu")
    assert any(p.requires_grad for p in encoder.parameters()) == traits.trains_encoder
    assert isinstance(encoder, ResNet) != traits.big_layers  # Big-Layers replaces the plain ResNet
    assert isinstance(aggregator, GridHead) == traits.grid_head
    assert isinstance(aggregator, ABMIL) != traits.grid_head


def test_one_tiling_config():
    from wsi_pipeline.tiling import tiler, tissue

    assert tiler.TilingConfig is TilingConfig and tissue.OtsuParams is OtsuParams
    # data.tiling (StoreSettings; StoreSettings is its former name) uses the tiler's field names, all optional;
    # the detector's own keys sit beside them, the density settings are the tissue detector's parameters
    assert StoreSettings is StoreSettings
    tiler_fields = {f.name: f for f in dataclasses.fields(TilingConfig)}
    for f in dataclasses.fields(StoreSettings):
        if f.name != "schema_version":
            assert f.default is None and (f.name in tiler_fields or f.name == "tissue"), f.name
    with pytest.raises(ValueError, match=r"data.tiling.min_foreground=1.5; expected a value <= 1.0"):
        config_from_dict({"data": {"manifest": "m", "tiles_dir": "t", "n_classes": 2, "tiling": {"min_foreground": 1.5}},
                          "name": "p", "methods": [{"name": "a", "strategy": "frozen"}]})
    with pytest.raises(ValueError, match=r"data.tiling.method='grey'; expected one of \['tissue', 'greyscale', 'otsu', 'unet'\]"):
        config_from_dict({"data": {"manifest": "m", "tiles_dir": "t", "n_classes": 2, "tiling": {"method": "grey"}},
                          "name": "p", "methods": [{"name": "a", "strategy": "frozen"}]})


@pytest.mark.parametrize("made_with", [
    TilingConfig(),
    TilingConfig(method="otsu", tile_size=128, min_foreground=0.3, mpp_target=1.0, detector=OtsuParams(median_um=12.0)),
    TilingConfig(method="greyscale", detector=GreyscaleParams(grey_max="auto", grey_auto_margin=7, grey_min=5),
                 mpp_target=0.5, mpp_tolerance=0.1),
    TilingConfig(method="tissue", detector=TissueParams(min_od=0.05), qc_mode="off", points_filter=True),
])
def test_tiler_config_reproduces_a_stores_settings(made_with):
    """A store records ``output_params`` of the config that made it; the bridge must give a config that records the same."""
    from wsi_pipeline.tiling.params import output_params

    recorded = yaml.safe_load(yaml.safe_dump(output_params(made_with)))  # as a checkpoint keeps it
    again = tiler_config(recorded, mpp=0.25)
    assert output_params(again) == output_params(made_with)
    assert again.mpp == 0.25 and again.backend == "auto" and again.compression == "zstd"  # never taken from a store
    assert tiler_config({**recorded, "compression": "jpeg", "backend": "tiffslide"}) == tiler_config(recorded)


def test_tiler_config_from_the_data_tiling_section():
    assert tiler_config(StoreSettings()) == TilingConfig() == tiler_config(None)
    got = tiler_config(StoreSettings(tile_size=128, min_foreground=0.2, mpp_target=2.0), mpp=0.5)
    assert got == TilingConfig(tile_size=128, min_foreground=0.2, mpp_target=2.0, mpp=0.5)
    assert tiler_config(StoreSettings(method="otsu")).threshold == DEFAULT_MIN_FOREGROUND["otsu"]


def _patchgd(**method) -> dict:
    return {"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 3},
            "methods": [{"name": "pg", "strategy": "patchgd", **method}]}


@pytest.mark.parametrize("method, exc, match", [
    ({"patchgd": {"fraction": 1.5}}, ValueError, r"methods.pg.patchgd.fraction=1.5; expected a value <= 1.0"),
    ({"patchgd": {"zetta": 3}}, ValueError, r"unknown key 'zetta' in section 'methods.pg.patchgd'; valid keys: \['backbone_scale',"),
    ({"patchgd": {"k": 0}}, ValueError, r"methods.pg.patchgd.k=0; expected a value >= 1"),
    ({"patchgd": {"epsilon": "all"}}, TypeError, r"methods.pg.patchgd.epsilon: expected an integer or null, got str 'all'"),
    ({"patchgd": {"freeze_bn": "yes"}}, TypeError, r"methods.pg.patchgd.freeze_bn: expected true or false"),
    ({"patchgd": {"partial_window": "keep"}}, ValueError, r"methods.pg.patchgd.partial_window='keep'; expected one of 'step', 'drop'"),
    ({"patchgd": {"head": "mlp"}}, ValueError, r"methods.pg.patchgd.head='mlp'; expected one of \['cnn', 'cnn_paper', 'transformer'\]"),
    ({"patchgd": {"head_options": 3}}, TypeError, r"methods.pg.patchgd.head_options: expected a mapping"),
    ({"aggregator": {"name": "transmil"}}, ValueError, r"method 'pg': patchgd trains a grid head, not the aggregator 'transmil'"),
    ({"encoder": {"bn": "chunk"}}, ValueError, r"encoder.bn='chunk' is not supported by patchgd"),
])
def test_patchgd_section_is_checked_on_loading(method, exc, match):
    with pytest.raises(exc, match=match):
        config_from_dict(_patchgd(**method))


def test_patchgd_head_is_named_once():
    """The aggregator entry names the head unless ``patchgd.head`` does; ``inference`` uses the same rule."""
    from wsi_pipeline.config.patchgd import PatchGDConfig
    from wsi_pipeline.config.pipeline import patchgd_mapping, with_patchgd_head
    from wsi_pipeline.methods.models import patchgd_method

    cfg = config_from_dict(_patchgd(aggregator={"name": "transformer", "options": {"dim": 8, "dropout": 0.1}},
                                    patchgd={"head_options": {"dim": 16}}, encoder={"bn": "train"}))
    m = cfg.methods[0]
    assert m.patchgd == {"head_options": {"dim": 16}}  # the saved section holds what was written
    resolved = patchgd_mapping(m)
    assert resolved == {"head": "transformer", "head_options": {"dim": 16, "dropout": 0.1}, "freeze_bn": False}
    assert patchgd_method(m) == with_patchgd_head(m) == dataclasses.replace(m, patchgd=resolved)
    built = PatchGDConfig.from_mapping(resolved)
    assert (built.head, dict(built.head_options), built.freeze_bn) == ("transformer", {"dim": 16, "dropout": 0.1}, False)
    # patchgd.head wins over the aggregator entry; the default aggregator means the default head
    own = config_from_dict(_patchgd(aggregator={"name": "cnn_paper"}, patchgd={"head": "cnn"})).methods[0]
    assert patchgd_mapping(own)["head"] == "cnn" and "head_options" not in patchgd_mapping(own)
    plain = config_from_dict(_patchgd()).methods[0]
    assert PatchGDConfig.from_mapping(patchgd_mapping(plain)).head == PatchGDConfig().head == "cnn"


def test_saved_configs_of_earlier_versions_still_load(tmp_path):
    new = {"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
           "eval": {"val_protocol": "sub16x3", "protocols": ["all", "sub8x5", "ens8x5"]},
           "methods": [{"name": "a", "strategy": "frozen", "val_protocol": "sub16x3"}]}
    # earlier versions: protocols as mappings, and no per-method val_protocol (the pipeline's applied)
    old = {**new, "methods": [{"name": "a", "strategy": "frozen"}],
           "eval": {"val_protocol": {"subsample": {"k": 16, "repeats": 3}},
                           "protocols": ["all", {"subsample": {"k": 8, "repeats": 5}}, {"subsample_ensemble": {"k": 8, "repeats": 5}}]}}
    with pytest.raises(ValueError, match=r"eval.val_protocol="):
        config_from_dict(old)  # a pipeline YAML is held to the one spelling
    assert config_from_dict(upgrade_saved_config(old)) == config_from_dict(new)
    today = config_to_dict(config_from_dict(new))  # as a run folder saves it
    assert upgrade_saved_config(today) == today and upgrade_saved_config(old) != old and "subsample" in str(old)  # input untouched
    # a config saved before eval held the evaluation stage's settings compares equal to today's (a run is resumed)
    before = {**today, "eval": {k: v for k, v in today["eval"].items() if k not in ("methods", "device", "batch_size", "heatmaps",
                                                                                     "heatmap_method", "heatmap_mode", "results")}}
    assert upgrade_saved_config(before) == today


def test_save_is_atomic(tmp_path, monkeypatch):
    cfg = config_from_dict(_patchgd(patchgd={"fraction": 0.5}))
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg
    before = path.read_text()

    def broken(src, dst):
        raise OSError("disk full")

    import wsi_pipeline.io_atomic as io_atomic

    monkeypatch.setattr(io_atomic.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        save_config(dataclasses.replace(cfg, seeds=(7,)), path)
    monkeypatch.undo()
    assert path.read_text() == before and sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]
    assert config_to_dict(cfg)["methods"][0]["patchgd"] == {"fraction": 0.5}
