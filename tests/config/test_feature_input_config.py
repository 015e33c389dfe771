"""``data.features`` (precomputed feature files) and ``encoder: {name: precomputed}`` in the pipeline schema: what
goes together, and each wrong combination refused by name."""

from __future__ import annotations

import copy

import pytest

from wsi_pipeline.config.pipeline import config_from_dict

RAW = {
    "name": "f",
    "data": {"manifest": "m.csv", "features": {"dir": "feats", "format": "trident"}, "n_classes": 2},
    "methods": [{"name": "a", "strategy": "frozen", "encoder": {"name": "precomputed"}, "aggregator": {"name": "abmil"}}],
}


def _with(**changes) -> dict:
    raw = copy.deepcopy(RAW)
    for path, value in changes.items():
        *keys, last = path.split("__")
        node = raw
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return raw


def test_feature_input_without_tiles_dir_is_valid():
    config = config_from_dict(RAW)
    assert config.data.tiles_dir is None and config.data.features is not None
    assert (config.data.features.dir, config.data.features.format) == ("feats", "trident")
    assert config.methods[0].encoder.dim is None  # read from the files when training starts


@pytest.mark.parametrize("changes,match", [
    ({"data__features": None}, r"data has neither tiles_dir .* nor features"),
    ({"data__features": {"dir": "feats", "format": "h5ad"}}, r"format"),
    ({"methods__0__encoder": {"name": "resnet18"}}, r"method 'a': encoder 'resnet18' embeds tiles, but this pipeline's "
                                                    r"input is precomputed feature files"),
    ({"methods__0__strategy": "accumulate"}, r"method 'a': strategy 'accumulate' trains the encoder on tiles"),
    ({"methods__0__train": {"augment": {"enabled": True}}}, r"method 'a': train.augment needs tiles"),
    ({"data__stain": {"normalise": "macenko"}}, r"data.stain.normalise='macenko' with data.features"),
    ({"data__bags": "patient"}, r"data.bags: patient is not supported with data.features"),
    ({"methods__0__encoder": {"name": "precomputed", "weights": "w.pt"}}, r"encoder.weights='w.pt' with encoder 'precomputed'"),
])
def test_wrong_combinations_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(_with(**changes))


def test_precomputed_without_feature_files_is_refused():
    raw = _with(data__features=None)
    raw["data"]["tiles_dir"] = "tiles"
    with pytest.raises(ValueError, match=r"methods \['a'\] use encoder 'precomputed' but data.features is not set"):
        config_from_dict(raw)


def test_encoder_dim_belongs_to_precomputed_only():
    raw = _with(methods__0__encoder={"name": "resnet18", "dim": 64})
    raw["data"] = {"manifest": "m.csv", "tiles_dir": "tiles", "n_classes": 2}
    with pytest.raises(ValueError, match=r"encoder.dim is set for encoder 'resnet18'"):
        config_from_dict(raw)


def test_resolving_the_width_from_the_files():
    from wsi_pipeline.methods.models import build_models
    from wsi_pipeline.training.precomputed import resolve_precomputed

    config = resolve_precomputed(config_from_dict(RAW), 24)
    assert config.methods[0].encoder.dim == 24
    encoder, aggregator = build_models(config.methods[0], 2)
    assert encoder.num_features == 24 and not list(encoder.parameters())
    with pytest.raises(ValueError, match=r"encoder.dim=24, but the feature files have 32 features per tile"):
        resolve_precomputed(config, 32)
