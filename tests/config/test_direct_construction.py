"""Bounds and choices hold on direct construction, not only on a YAML read (one validation path)."""

from __future__ import annotations

import dataclasses

import pytest

from wsi_pipeline.config.schema import Checked
from wsi_pipeline.config.tiling import StoreTiling


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
    with pytest.raises(ValueError, match=r"StoreSettings\.tile_size=-1; expected a value >= 8"):  # StoreTiling: its alias
        StoreTiling(tile_size=-1)


@pytest.mark.parametrize("cls", _sections(), ids=lambda c: c.__name__)
def test_every_config_section_is_checked_on_construction(cls: type) -> None:
    """Each config dataclass derives from Checked, so spec() bounds run on direct construction."""
    assert issubclass(cls, Checked), f"{cls.__qualname__} does not derive from Checked"
    bounded = [f for f in dataclasses.fields(cls) if {"gt", "ge", "le"} & set(f.metadata)]
    for f in bounded:
        bad = f.metadata["gt"] if "gt" in f.metadata else f.metadata["ge"] - 1 if "ge" in f.metadata else f.metadata["le"] + 1
        try:
            default = cls()
        except TypeError:
            pytest.skip(f"{cls.__name__} has required fields")
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{f.name}="):
            dataclasses.replace(default, **{f.name: bad})
