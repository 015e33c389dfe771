"""The tissue U-Net's checkpoint (``best.pt``, ``last.pt`` of ``wsi-pipeline tissue train``) as one typed artefact.

:meth:`TissueCheckpoint.build` makes one, :func:`save_tissue_checkpoint` writes it (through
:func:`wsi_pipeline.checkpoints.files.save_checkpoint`: atomic, digest inside, ``.sha256`` beside),
:func:`load_tissue_checkpoint` reads any layout this package wrote. The file's keys::

    kind             ``wsi-pipeline/tissue-unet-v1`` (what :func:`load_tissue_checkpoint` checks)
    schema_version   2 (absent = 1)
    model            the U-Net's state dict
    channels, mpp    its width and working resolution (um/px)
    best             {"epoch", "val_loss", "val_dice"} of the lowest validation loss, or absent
    settings, optimizer, epoch, history   ``last.pt`` only (:class:`TissueResume`)

Migrations (:data:`MIGRATIONS`, one step per version): version 1 ``last.pt`` files had no
``channels``/``mpp``; they are read from its ``settings`` JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wsi_pipeline.config.schema import Checked, build, spec

__all__ = ["MODEL_KIND", "SCHEMA_VERSION", "TissueCheckpoint", "TissueResume", "load_tissue_checkpoint",
           "save_tissue_checkpoint"]

#: The ``kind`` entry of every tissue model checkpoint.
MODEL_KIND = "wsi-pipeline/tissue-unet-v1"
#: The layout this version writes.
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class TissueResume(Checked):
    """``last.pt``'s state to continue training: the run's settings (JSON), optimiser, epochs done, history."""

    settings: str
    optimizer: dict[str, Any]
    epoch: int = field(metadata=spec(ge=0))
    history: Any  # list of per-epoch dicts


@dataclass(frozen=True)
class TissueCheckpoint(Checked):
    """A tissue U-Net checkpoint (the module docstring lists the file's keys)."""

    model: dict[str, Any]
    channels: int = field(metadata=spec(ge=1))
    mpp: float = field(metadata=spec(gt=0.0))
    best: dict[str, Any] | None = None
    resume: TissueResume | None = None
    schema_version: int = field(default=SCHEMA_VERSION, metadata=spec(ge=SCHEMA_VERSION, le=SCHEMA_VERSION))

    @classmethod
    def build(cls, model: torch.nn.Module, *, mpp: float, best: Mapping[str, Any] | None = None,
              resume: TissueResume | None = None) -> TissueCheckpoint:
        """The checkpoint of ``model`` (a :class:`~wsi_pipeline.tissue_seg.model.TissueUNet`) working at ``mpp`` um/px."""
        channels = getattr(model, "channels", None)
        if channels is None:
            raise TypeError(f"{type(model).__name__} has no `channels`: not a tissue U-Net")
        return cls(model=dict(model.state_dict()), channels=int(channels), mpp=float(mpp),
                   best=None if best is None else dict(best), resume=resume)

    def to_state(self) -> dict[str, Any]:
        """Plain containers and tensors (``torch.load(..., weights_only=True)`` reads them)."""
        state: dict[str, Any] = {"kind": MODEL_KIND, "schema_version": self.schema_version, "model": self.model,
                                 "channels": self.channels, "mpp": self.mpp}
        if self.best is not None:
            state["best"] = self.best
        if self.resume is not None:
            state.update({f.name: getattr(self.resume, f.name) for f in dataclasses.fields(self.resume)})
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], where: str = "checkpoint") -> TissueCheckpoint:
        """Read a tissue checkpoint's state in any layout this package wrote; ``ValueError`` naming ``where``
        when it is not a tissue model."""
        if not isinstance(state, Mapping) or state.get("kind") != MODEL_KIND:
            found = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"{where} is not a tissue model (kind {found!r}, expected {MODEL_KIND!r})")
        raw = migrate(state, where)
        raw = {k: v for k, v in raw.items() if k not in ("kind", "format", "integrity")}
        resume = {f.name: raw.pop(f.name) for f in dataclasses.fields(TissueResume) if f.name in raw}
        if resume:
            raw["resume"] = build(TissueResume, resume, where)
        return build(cls, raw, where)


def _v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
    """Version 1 ``last.pt`` files kept ``channels`` and ``mpp`` only in their ``settings`` JSON."""
    out = dict(state)
    if ("channels" not in out or "mpp" not in out) and isinstance(out.get("settings"), str):
        settings = json.loads(out["settings"])
        out.setdefault("channels", settings["channels"])
        out.setdefault("mpp", settings["mpp"])
    out["schema_version"] = 2
    return out


#: ``MIGRATIONS[v]`` turns a version-v state into version v + 1.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


def migrate(state: Mapping[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """``state`` in today's layout; ``ValueError`` naming ``where`` for one written by a newer version."""
    out = dict(state)
    version = out.get("schema_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: schema_version={version!r}; expected an integer >= 1")
    if version > SCHEMA_VERSION:
        raise ValueError(f"{where} has tissue checkpoint schema version {version}, newer than this version of "
                         f"wsi-pipeline reads ({SCHEMA_VERSION}); update wsi-pipeline to load it")
    while version < SCHEMA_VERSION:
        out = MIGRATIONS[version](out)
        version += 1
    return out


def save_tissue_checkpoint(path: str | os.PathLike, checkpoint: TissueCheckpoint) -> Path:
    """Write ``checkpoint`` to ``path`` (atomically, verified on loading)."""
    from wsi_pipeline.checkpoints.files import save_checkpoint

    return save_checkpoint(path, checkpoint.to_state())


def load_tissue_checkpoint(path: str | os.PathLike) -> TissueCheckpoint:
    """Read and verify a tissue checkpoint (``torch.load(weights_only=True)``); ``ValueError`` naming the file
    when it is damaged or not a tissue model."""
    from wsi_pipeline.checkpoints.files import load_checkpoint

    return TissueCheckpoint.from_state(load_checkpoint(path), where=str(path))
