"""YAML in and out: reading a config file, config dataclasses -> plain containers, atomic saving."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from wsi_pipeline.io_atomic import write_text_atomic

__all__ = ["config_to_dict", "read_yaml", "write_yaml"]


def read_yaml(path: str | os.PathLike, what: str = "pipeline config") -> dict[str, Any]:
    """The mapping in YAML file ``path`` (``yaml.safe_load``; an empty file is ``{}``).

    Raises ``FileNotFoundError`` (no such file), ``ValueError`` (not valid YAML) or ``TypeError``
    (not a mapping), each naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}; configs live in pipelines/*.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise TypeError(f"{path}: a {what} must be a mapping of sections; got {type(raw).__name__}")
    return raw


def _to_raw(obj: Any) -> Any:
    if hasattr(obj, "to_raw"):
        return obj.to_raw()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_raw(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): _to_raw(v) for k, v in obj.items()}
    return obj


def config_to_dict(config: Any) -> Any:
    """Plain YAML-able containers (dict/list/str/int/float/bool/None) for any config dataclass.

    A value with a ``to_raw()`` method (a protocol) is written in its YAML form;
    ``config_from_dict(config_to_dict(c)) == c`` for a pipeline config.
    """
    return _to_raw(config)


def write_yaml(config: Any, path: str | os.PathLike) -> Path:
    """Write ``config`` (a config dataclass or plain containers) as YAML, atomically; return ``path``."""
    return write_text_atomic(path, yaml.safe_dump(config_to_dict(config), sort_keys=False))
