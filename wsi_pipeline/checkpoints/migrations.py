"""Every migration of an older run checkpoint layout, one step per schema version.

A run checkpoint's state (what ``torch.load(..., weights_only=True)`` returns, see
:class:`wsi_pipeline.checkpoints.run.RunCheckpoint`) records its layout in
``schema_version``. Files written before the number existed are version 1. :func:`migrate`
applies ``MIGRATIONS[v]`` (version v -> v + 1) until the state is at :data:`SCHEMA_VERSION`, so a
reader only ever sees today's layout; nothing else in the package looks for missing keys.

Version history
---------------
1. ``wsi-pipeline/checkpoint-v1`` as written up to this schema (no ``schema_version``). Over its
   life some keys were added; a version-1 file may lack any of them:
   ``seed`` (0), ``encoder_info`` (None: the whole encoder state is stored),
   ``endpoint`` (checkpoints written before endpoints are classification models:
   ``cross_entropy`` over ``data.n_classes`` outputs), ``stain_normalise`` (the saved config's
   ``data.stain.normalise``, else ``none``), ``tiling``, ``stain_reference`` and ``stain`` (None);
   ``patchgd`` (None: a PatchGD model's options are resolved from its saved config, as then).
2. Every key present (None where the run had nothing to record), ``schema_version: 2``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "migrate", "schema_version"]

#: The layout this version of the package writes.
SCHEMA_VERSION = 2


def schema_version(state: Mapping[str, Any]) -> int:
    """The layout version of a checkpoint state (1 for files written before versions were recorded)."""
    v = state.get("schema_version", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"schema_version={v!r}; expected an integer >= 1")
    return v


def _section(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``parent[key]`` when it is a mapping, else an empty one."""
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def _v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
    """Fill in the keys version 1 files may lack (module docstring), as the readers of that time did."""
    out = dict(state)
    data = _section(_section(out, "config"), "data")
    out.setdefault("seed", 0)
    out.setdefault("encoder_info", None)
    if not out.get("endpoint"):  # written before endpoints: a classifier over data.n_classes outputs
        n_classes = data.get("n_classes")
        if n_classes is None:
            raise ValueError("has no endpoint and its config no data.n_classes; it cannot be a classification model")
        out["endpoint"] = {"task": "classification", "loss": "cross_entropy", "n_outputs": int(n_classes)}
    if "stain_normalise" not in out:
        out["stain_normalise"] = str(_section(data, "stain").get("normalise", "none"))
    for key in ("tiling", "stain_reference", "stain", "patchgd"):
        out.setdefault(key, None)
    out["schema_version"] = 2
    return out


#: ``MIGRATIONS[v]`` turns a version-v state into version v + 1.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


def migrate(state: Mapping[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """``state`` in today's layout (:data:`SCHEMA_VERSION`), a new dict; ``ValueError`` naming ``where``
    for a state written by a newer version of the package or one a step cannot read."""
    out = dict(state)
    try:
        version = schema_version(out)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if version > SCHEMA_VERSION:
        raise ValueError(f"{where} has checkpoint schema version {version}, newer than this version of wsi-pipeline "
                         f"reads ({SCHEMA_VERSION}); update wsi-pipeline to load it")
    while version < SCHEMA_VERSION:
        try:
            out = MIGRATIONS[version](out)
        except ValueError as e:
            raise ValueError(f"{where} (checkpoint schema version {version}) {e}") from e
        version += 1
    return out
