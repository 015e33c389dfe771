"""The one override syntax of every command's ``--set``: ``section.key=value``.

``train.lr=5e-5`` sets a key of a section, ``train.demon.beta_init=0.8`` one of a sub-section,
and in a list (``methods``) a path element is an index or an entry's ``name``:
``methods.abmil_e2e.chunk_size=32``. Values are parsed as YAML (``5e-5`` -> a number, ``[0, 1]``
-> a list, ``null`` -> None, ``all`` -> a string). Overrides apply to the raw YAML mapping, before
validation, so a wrong key or type is reported as in a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from wsi_pipeline.config.io import load_yaml

__all__ = ["OVERRIDE_HELP", "OVERRIDE_METAVAR", "apply_overrides", "deep_merge"]

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


def _list_index(node: list, key: str, item: str) -> int:
    if key.lstrip("-").isdigit():
        idx = int(key)
        if not -len(node) <= idx < len(node):
            raise ValueError(f"override {item!r}: index {idx} out of range for a list of {len(node)}")
        return idx
    names = [e.get("name") if isinstance(e, Mapping) else None for e in node]
    if key not in names:
        raise ValueError(f"override {item!r}: no entry named {key!r}; entries: {[n for n in names if n]}")
    return names.index(key)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw config mapping (in place; also returned).

    Raises ``ValueError`` naming the override: no ``=``, an empty key path, a key under a value,
    a list index out of range or a list entry name that does not exist.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected section.key=value, e.g. train.lr=5e-5")
        path, text = item.split("=", 1)
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise ValueError(f"override {item!r}: empty key path")
        value = load_yaml(text, f"override {item!r}") if text.strip() else None
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
