"""One bag per patient: the tiles of all of a patient's slides, read as one store (``data.bags: patient``).

:func:`patient_units` groups slides by ``patient_id`` into units that training and evaluation
treat as slides (the unit's ``slide_id`` is the patient id, its target the patient's); a
:class:`PatientStore` reads a unit's tiles as one store, the slides' tiles one after the other in
the order of the manifest. Tile positions across slides mean nothing (``grid`` is each slide's
own), so grid heads (PatchGD) cannot take patient bags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from wsi_pipeline.data.store import TileStore, open_store

__all__ = ["PatientStore", "patient_units"]


class PatientStore(TileStore):
    """The tiles of several stores (a patient's slides) read as one :class:`TileStore`.

    Attributes as :class:`TileStore`, concatenated in store order; ``attrs`` are the first store's
    with ``slide_id`` set to the patient; ``parts`` the member stores and ``offsets`` where each starts.
    """

    def __init__(self, patient_id: str, stores: Sequence[TileStore | Any]) -> None:  # no TileStore.__init__: nothing to open
        self.parts = [s if isinstance(s, TileStore) else open_store(s) for s in stores]
        if not self.parts:
            raise ValueError(f"patient {patient_id!r} has no tile store")
        first = self.parts[0]
        self.path = first.path.parent / f"{patient_id} (patient of {len(self.parts)} slides)"
        self.attrs = {**first.attrs, "slide_id": patient_id, "slides": [p.slide_id for p in self.parts]}
        self.coords = np.concatenate([p.coords for p in self.parts])
        self.grid = np.concatenate([p.grid for p in self.parts])
        self.foreground = np.concatenate([p.foreground for p in self.parts])
        self.tile_size = first.tile_size
        sizes = [len(p) for p in self.parts]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.shard_tiles = first.shard_tiles
        self.stain = None  # no normalisation across a patient's slides (data.bags: patient refuses data.stain)

    @property
    def slide_id(self) -> str:
        return str(self.attrs["slide_id"])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, indices: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Tiles as uint8 (k, T, T, 3) in the order of ``indices`` (positions in the concatenation)."""
        idx = np.arange(len(self)) if indices is None else np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"tile index out of range [0, {len(self)}) in {self.path}")
        out = np.empty((len(idx), self.tile_size, self.tile_size, 3), np.uint8)
        part = np.searchsorted(self.offsets, idx, side="right") - 1
        for k, store in enumerate(self.parts):
            sel = np.flatnonzero(part == k)
            if sel.size:
                out[sel] = store.read(idx[sel] - self.offsets[k])
        return out

    def array(self, name: str) -> np.ndarray:
        return np.concatenate([p.array(name) for p in self.parts])


def patient_units(slides: Sequence[Any]) -> list[Any]:
    """One unit per patient (first-slide order): a :class:`~wsi_pipeline.data.bags.Slide` whose ``slide_id``
    is the patient, ``parts`` its slides, ``label`` the highest of theirs, ``target`` the patient's."""
    groups: dict[str, list[Any]] = {}
    for s in slides:
        groups.setdefault(s.patient_id or s.slide_id, []).append(s)
    return [replace(members[0], slide_id=patient, label=max(m.label for m in members), patient_id=patient,
                    parts=tuple(members)) for patient, members in groups.items()]
