"""The one override syntax of every command's ``--set``: ``section.key=value``.

``train.lr=5e-5`` sets a key of a section, ``train.demon.beta_init=0.8`` one of a sub-section,
and in a list (``methods``) a path element is an index or an entry's ``name``:
``methods.abmil_e2e.chunk_size=32``. Values are parsed as YAML (``5e-5`` -> a number, ``[0, 1]``
-> a list, ``null`` -> None, ``all`` -> a string). Overrides apply to the raw YAML mapping, before
validation, so a wrong key or type is reported as in a file.

:func:`build_config` is the one builder of every stage's settings: a YAML file (or nothing), the
values of the stage's own flags set at their key paths (``eval --bootstrap 200`` is
``eval.bootstrap: 200``), then the ``--set`` overrides, then the stage's dataclass built from the
result, so a value is checked in one place (the dataclass) however it was given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from wsi_pipeline.config.io import load_yaml, read_yaml
from wsi_pipeline.failures import reworded

__all__ = ["OVERRIDE_HELP", "OVERRIDE_METAVAR", "apply_overrides", "apply_values", "build_config", "deep_merge", "section_of", "set_value"]

T = TypeVar("T")

#: ``metavar`` and help text of ``--set`` in every command.
OVERRIDE_METAVAR = "SECTION.KEY=VALUE"
OVERRIDE_HELP = (
    "override a config value (repeatable), e.g. --set train.lr=5e-5 or --set methods.abmil_e2e.chunk_size=32 "
    "(a list entry by index or name; the value is read as YAML)"
)


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in: nested mappings key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _list_index(node: list[Any], key: str, item: str) -> int:
    if key.lstrip("-").isdigit():
        idx = int(key)
        if not -len(node) <= idx < len(node):
            raise ValueError(f"override {item!r}: index {idx} out of range for a list of {len(node)}")
        return idx
    names = [e.get("name") if isinstance(e, Mapping) else None for e in node]
    if key not in names:
        raise ValueError(f"override {item!r}: no entry named {key!r}; entries: {[n for n in names if n]}")
    return names.index(key)


def set_value(raw: dict[str, Any], path: str, value: Any, item: str | None = None) -> dict[str, Any]:
    """Set ``value`` at the dotted key path ``path`` of a raw config mapping (in place; also returned).

    Missing sections on the way are created; in a list a path element is an index or an entry's
    ``name``. ``item`` is how the change is named in errors (default ``path=value``). Raises
    ``ValueError`` naming it: an empty key path, a key under a value, a list index out of range or a
    list entry name that does not exist.
    """
    item = item if item is not None else f"{path}={value!r}"
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ValueError(f"override {item!r}: empty key path")
    node: Any = raw
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        where = ".".join(keys[: i + 1])
        if isinstance(node, list):
            idx = _list_index(node, key, item)
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r}: {'.'.join(keys[:i])} is not a section")
        if last:
            node[key] = value
        else:
            if node.get(key) is None or isinstance(node.get(key), bool):
                node[key] = {}  # e.g. train.demon.beta_init when demon was `false`
            elif not isinstance(node[key], (dict, list)):
                raise ValueError(f"override {item!r}: {where} is a value, not a section")
            node = node[key]
    return raw


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw config mapping (in place; also returned).

    The value is read as YAML. Raises ``ValueError`` naming the override: no ``=``, or what
    :func:`set_value` refuses.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected section.key=value, e.g. train.lr=5e-5")
        path, text = item.split("=", 1)
        value = load_yaml(text, f"override {item!r}") if text.strip() else None
        set_value(raw, path, value, item)
    return raw


def apply_values(raw: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """Set each ``{key path: value}`` of ``values`` (a command's flags, already typed) in ``raw``."""
    for path, value in values.items():
        set_value(raw, path, value, f"{path}={value!r}")
    return raw


def section_of(raw: Mapping[str, Any], path: str) -> Any:
    """The sub-mapping of ``raw`` at dotted key ``path`` (``data.tiling``); ``{}`` where it is absent or null."""
    node: Any = raw
    for key in (k for k in path.split(".") if k):
        node = node.get(key) if isinstance(node, Mapping) else None
        if node is None:
            return {}
    return node


def build_config(
    path: str | os.PathLike[str] | None,
    make: Callable[[dict[str, Any]], T],
    *,
    values: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    what: str = "pipeline config",
) -> T:
    """The one way every stage's settings are made: YAML file -> flag values -> ``--set`` -> ``make``.

    Parameters
    ----------
    path : the YAML file (``--config``); None starts from an empty mapping.
    make : builds the stage's typed config from the raw mapping (e.g. ``lambda raw:
        build(FeaturesConfig, section_of(raw, "features"), "features")``); it does all the checking.
    values : ``{key path: value}`` of the command's own flags that were given (``{"eval.bootstrap": 200}``),
        set before ``overrides``, so ``--set`` has the last word.
    overrides : ``section.key=value`` strings (``--set``), values read as YAML.
    what : how the file is named when it is missing.

    Raises ``FileNotFoundError`` (no such file) or the ``ValueError`` / ``TypeError`` of a bad value,
    prefixed with the file name when there is one.
    """
    raw: dict[str, Any] = read_yaml(path, what) if path is not None else {}
    try:
        apply_values(raw, values or {})
        apply_overrides(raw, overrides)
        return make(raw)
    except (ValueError, TypeError) as e:
        if path is None:
            raise
        raise reworded(e, f"{Path(path)}: {e}") from e
