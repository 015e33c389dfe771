"""Bounds and choices hold on direct construction, not only on a YAML read (one validation path)."""

from __future__ import annotations

import dataclasses

import pytest

from wsi_pipeline.config.schema import Checked
from wsi_pipeline.config.store_settings import StoreSettings


def _sections() -> list[type]:
    import wsi_pipeline.config as config_pkg
    import pkgutil
    import importlib

    found = []
    for info in pkgutil.iter_modules(config_pkg.__path__):
        module = importlib.import_module(f"wsi_pipeline.config.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


def test_store_tiling_refuses_a_negative_tile_size_built_in_code() -> None:
    with pytest.raises(ValueError, match=r"StoreSettings\.tile_size=-1; expected a value >= 8"):  # StoreSettings: its alias
        StoreSettings(tile_size=-1)


#: The required fields of the sections that have some (a valid value each).
REQUIRED: dict[str, dict[str, object]] = {
    "DataConfig": {"manifest": "m.csv", "tiles_dir": "t"},
    "MethodConfig": {"name": "a", "strategy": "frozen"},
}


def _bad_value(meta: dict) -> object:
    """A value just outside a field's bounds, or one its ``check`` refuses."""
    if "gt" in meta:
        return meta["gt"]
    if "ge" in meta:
        return meta["ge"] - 1
    if "lt" in meta:
        return meta["lt"]
    if "le" in meta:
        return meta["le"] + 1
    return "not-a-valid-name"  # check: a device, an encoder name


@pytest.mark.parametrize("cls", _sections(), ids=lambda c: c.__name__)
def test_every_config_section_is_checked_on_construction(cls: type) -> None:
    """Each config dataclass derives from Checked, so spec() bounds and checks run on direct construction."""
    assert issubclass(cls, Checked), f"{cls.__qualname__} does not derive from Checked"
    checked = [f for f in dataclasses.fields(cls) if {"gt", "ge", "lt", "le", "check"} & set(f.metadata)]
    if not checked:
        return
    try:
        default = cls(**REQUIRED.get(cls.__name__, {}))
    except TypeError:
        pytest.skip(f"{cls.__name__} has required fields: add them to REQUIRED")
    for f in checked:
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{f.name}="):
            dataclasses.replace(default, **{f.name: _bad_value(dict(f.metadata))})


def test_bounds_moved_from_post_init_name_the_field_from_yaml_and_from_code() -> None:
    """A bound read from YAML names the key path; the same bound in code names Class.field."""
    from wsi_pipeline.config.schema import build
    from wsi_pipeline.config.train import AugmentConfig, DemonConfig, TrainConfig

    with pytest.raises(ValueError, match=r"^train\.lr=0.0; expected a value > 0$"):
        build(TrainConfig, {"lr": 0}, "train")
    with pytest.raises(ValueError, match=r"^TrainConfig\.lr=0; expected a value > 0$"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match=r"DemonConfig\.beta_init=1.0; expected a value < 1.0"):
        DemonConfig(beta_init=1.0)
    DemonConfig(beta_init=0.0)  # the bound's closed end is allowed
    with pytest.raises(ValueError, match=r"TrainConfig\.device='gpu'"):
        TrainConfig(device="gpu")
    with pytest.raises(ValueError, match=r"AugmentConfig\.blur_p=1.5; expected a value <= 1.0"):
        AugmentConfig(blur_p=1.5)
    with pytest.raises(ValueError, match=r"blur_kernel=4; expected an odd number"):
        AugmentConfig(blur_kernel=4)  # a rule no bound describes stays in __post_init__
