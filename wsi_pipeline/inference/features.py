"""Frozen-encoder features: one HDF5 file per slide, the layout CLAM users know.

``<out_dir>/<slide_id>.h5`` holds

- ``features`` float32 [N, D]: the encoder's embedding of each tile of the slide's tile store,
  in store order;
- ``coords`` int64 [N, 2]: (x, y) of each tile's top-left corner in level-0 px (from the store);
- ``grid`` int32 [N, 2]: (col, row) of each tile on the store's tile grid;
- attributes: ``slide_id``, ``encoder`` (name), ``weights_sha256`` (sha256 over the encoder's
  state dict: names, dtypes, shapes and bytes, in key order), ``store_fingerprint`` (see
  :func:`store_fingerprint`), ``n_tiles``, ``feature_dim``, ``tile_size`` (px),
  ``package_version``, ``created``, and ``complete = True``.

Files are written under a temporary name and renamed into place, so a file that exists is
complete. A file whose encoder, weights hash and store fingerprint match is up to date and is
skipped. Training the aggregator alone (the frozen baseline) reads these files with
:func:`read_features`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.devices import resolve_device
from wsi_pipeline.progress import progress_bar
import pandas as pd

__all__ = [
    "extract_features",
    "features_path",
    "read_features",
    "store_fingerprint",
    "weights_sha256",
    "resolve_device",
    "REPORT_NAME",
]

log = logging.getLogger(__name__)

#: Per-slide status table written beside the feature files.
REPORT_NAME = "features_report.csv"


def features_path(out_dir: str | os.PathLike, slide_id: str) -> Path:
    """Return the feature file ``<out_dir>/<slide_id>.h5``."""
    return Path(out_dir) / f"{slide_id}.h5"


def weights_sha256(module: Any) -> str:
    """sha256 (hex) over ``module.state_dict()``: each entry's name, dtype, shape and raw bytes, in key order."""
    import torch

    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def store_fingerprint(store: Any) -> str:
    """sha256 (hex) identifying a tile store's content: its attributes (slide fingerprint, mpp,
    tile size, creation time, ...) and its tile coordinates. A rebuilt store changes it."""
    h = hashlib.sha256()
    attrs = {k: v for k, v in dict(store.attrs).items()}
    h.update(json.dumps(attrs, sort_keys=True, default=str).encode())
    h.update(np.ascontiguousarray(store.coords, dtype=np.int64).tobytes())
    h.update(str(len(store)).encode())
    return h.hexdigest()


def read_features(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Read a feature file: ``(features float32 [N, D], coords int64 [N, 2] level-0 px, attrs dict)``.

    Raises ``FileNotFoundError`` when the file is absent and ``ValueError`` when it lacks the
    ``features``/``coords`` datasets.
    """
    import h5py

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"feature file {path} not found; run `wsi-pipeline features` first")
    with h5py.File(path, "r") as f:
        missing = [k for k in ("features", "coords") if k not in f]
        if missing:
            raise ValueError(f"feature file {path} lacks dataset(s) {missing}; found {sorted(f.keys())}. Re-extract it.")
        feats = np.asarray(f["features"][:], dtype=np.float32)
        coords = np.asarray(f["coords"][:], dtype=np.int64)
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
        if "grid" in f:
            attrs["grid"] = np.asarray(f["grid"][:])
    return feats, coords, attrs


#: Attribute -> why a file whose value differs is rebuilt.
_STALE_BECAUSE = {
    "encoder": "another encoder",
    "weights_sha256": "encoder weights changed (other weights, or BatchNorm calibrated on another training set)",
    "store_fingerprint": "tile store rebuilt or retiled",
}


def _stale_reason(path: Path, expected: Mapping[str, Any]) -> str | None:
    """Why ``path`` must be (re)built for ``expected`` attributes, or None when it is up to date."""
    import h5py

    if not path.is_file():
        return "no feature file"
    try:
        with h5py.File(path, "r") as f:
            if not bool(f.attrs.get("complete", False)):
                return "incomplete file"
            for k, v in expected.items():
                if f.attrs.get(k) != v:
                    return _STALE_BECAUSE.get(k, f"{k} changed")
    except OSError as e:
        return f"unreadable file ({e})"
    return None


def _report_orphans(out: Path, slide_ids: list[str]) -> list[str]:
    """Feature files in ``out`` of slides not in ``slide_ids``: ignored, and named in one log line."""
    keep = set(slide_ids)
    orphans = sorted(p.stem for p in out.glob("*.h5") if p.stem not in keep)
    if orphans:
        more = f" (and {len(orphans) - 8} more)" if len(orphans) > 8 else ""
        log.info("%d feature file(s) in %s belong to slides not in this manifest and are ignored: %s%s",
                 len(orphans), out, ", ".join(orphans[:8]), more)
    return orphans


def _write_h5(path: Path, feats: np.ndarray, coords: np.ndarray, grid: np.ndarray, attrs: Mapping[str, Any]) -> None:
    import h5py

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("features", data=feats.astype(np.float32, copy=False))
            f.create_dataset("coords", data=coords.astype(np.int64, copy=False))
            f.create_dataset("grid", data=grid.astype(np.int32, copy=False))
            for k, v in attrs.items():
                f.attrs[k] = v
            f.attrs["complete"] = True
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _embed_store(store: Any, encoder: Any, device: str, batch_size: int) -> np.ndarray:
    import torch

    from wsi_pipeline.data.tensors import tiles_to_tensor

    n = len(store)
    out = []
    with torch.inference_mode():
        if n == 0:  # learn D from one blank tile so the file still has shape [0, D]
            blank = torch.zeros(1, 3, store.tile_size, store.tile_size, device=device)
            return np.zeros((0, encoder(blank).shape[1]), np.float32)
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(start + batch_size, n))
            x = tiles_to_tensor(store.read(idx), device=device)
            out.append(encoder(x).float().cpu().numpy())
    return np.concatenate(out, 0)


def _slide_features(
    slide_id: str, encoder: Any, dev: str, tiles_dir: str, out: str, encoder_name: str, digest: str, batch_size: int,
    overwrite: bool,
) -> tuple[dict[str, Any], str | None]:
    """Embed one slide's store into ``<out>/<slide_id>.h5`` unless up to date: its report row and why it was
    re-extracted (None when it was new, skipped or failed)."""
    import wsi_pipeline
    from wsi_pipeline.data.store import open_store, store_path

    t0 = time.perf_counter()
    dest = features_path(out, slide_id)
    row: dict[str, Any] = {"slide_id": slide_id, "status": "ok", "n_tiles": 0, "seconds": 0.0, "error": ""}
    why = None
    try:
        store = open_store(store_path(tiles_dir, slide_id))
        expected = {"encoder": encoder_name, "weights_sha256": digest, "store_fingerprint": store_fingerprint(store)}
        row["n_tiles"] = len(store)
        reason = "--overwrite" if overwrite else _stale_reason(dest, expected)
        if reason is None:
            row["status"] = "skipped"
        else:
            if reason != "no feature file":
                why = reason
            feats = _embed_store(store, encoder, dev, int(batch_size))
            attrs = {
                **expected,
                "slide_id": slide_id,
                "n_tiles": len(store),
                "feature_dim": int(feats.shape[1]),
                "tile_size": int(store.tile_size),
                "package_version": wsi_pipeline.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            _write_h5(dest, feats, store.coords, store.grid, attrs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log.error("features failed for %s: %s", slide_id, e)
        row.update(status="failed", error=f"{type(e).__name__}: {e}")
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row, why


def _slide_features_task(slide_id: str, encoder: Any, device: str, *args: Any) -> tuple[dict[str, Any], str | None]:
    """:func:`_slide_features` as a Dask task: the broadcast encoder goes to this worker's device once."""
    dev = resolve_device(device)
    if next(encoder.parameters()).device != __import__("torch").device(dev):
        encoder.to(dev).eval()
    return _slide_features(slide_id, encoder, dev, *args)


def extract_features(
    manifest_df: pd.DataFrame,
    tiles_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    encoder_name: str = "resnet18",
    weights: str | os.PathLike | None = None,
    *,
    encoder: Any = None,
    batch_size: int = 64,
    device: str = "auto",
    overwrite: bool = False,
    seed: int = 0,
    progress: bool = True,
    cluster: Any = None,
    retries: int = 2,
) -> pd.DataFrame:
    """Embed every slide's tile store with a frozen encoder and write ``<out_dir>/<slide_id>.h5``.

    Parameters
    ----------
    manifest_df : manifest rows (``slide_id`` is used); stores are ``<tiles_dir>/<slide_id>.zarr``.
    tiles_dir, out_dir : folders of the tile stores and of the feature files (created).
    encoder_name : a registered encoder (``wsi_pipeline.models.ENCODERS``), recorded in the files.
    weights : checkpoint path for :func:`wsi_pipeline.models.build_encoder`. Without weights the
        encoder is randomly initialised from ``seed`` (reproducible, but not a useful baseline).
    encoder : an already built module [B, 3, T, T] -> [B, D] to use instead of building
        ``encoder_name`` (``encoder_name`` is then only the recorded name).
    batch_size : tiles per forward.
    device : ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``.
    overwrite : re-extract files that are up to date.
    progress : show a per-slide progress bar.
    cluster : None = in this process; else each slide is a Dask task (a ``--cluster`` string,
        a :class:`~wsi_pipeline.jobs.cluster.ClusterSpec` or a ``distributed.Client``; see
        :mod:`wsi_pipeline.tiling.cluster`): the encoder is built here and sent to every worker,
        which runs it on its own ``device``.
    retries : with ``cluster``: extra runs of a slide whose worker died.

    Returns
    -------
    DataFrame with one row per slide: ``slide_id, status`` (ok / skipped / failed), ``n_tiles,
    seconds, error``; also written atomically to ``<out_dir>/features_report.csv``. A failing
    slide is recorded and the others go on.
    """
    import torch

    if int(batch_size) < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device)
    if encoder is None:
        from wsi_pipeline.models import build_encoder

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            encoder = build_encoder(encoder_name, weights=weights)
        if weights is None:
            log.warning("no --weights given: %s is randomly initialised (seed %d)", encoder_name, seed)
    encoder = encoder.to(dev).eval()
    digest = weights_sha256(encoder)

    slide_ids = [str(s) for s in manifest_df["slide_id"]]
    _report_orphans(out, slide_ids)
    reasons: dict[str, int] = {}
    args = (str(tiles_dir), str(out), encoder_name, digest, int(batch_size), overwrite)
    if cluster is not None:
        from wsi_pipeline.jobs.cluster import map_slides

        outcomes = map_slides(cluster, _slide_features_task, slide_ids, (device, *args), broadcast=encoder.cpu(),
                              progress=progress, desc="features", retries=retries)
        rows = []
        for slide_id, outcome in zip(slide_ids, outcomes):
            if isinstance(outcome, BaseException):
                row = {"slide_id": slide_id, "status": "failed", "n_tiles": 0, "seconds": 0.0,
                       "error": f"the Dask task failed: {type(outcome).__name__}: {outcome}"}
                reason = None
            else:
                row, reason = outcome
            rows.append(row)
            if reason:
                reasons[reason] = reasons.get(reason, 0) + 1
    else:
        rows = []
        for slide_id in progress_bar(slide_ids, desc="features", unit="slide", enabled=progress):
            row, reason = _slide_features(slide_id, encoder, dev, *args)
            rows.append(row)
            if reason:
                reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        log.warning("re-extracted features of %s", "; ".join(f"{n} slide(s): {why}" for why, n in reasons.items()))
    report = pd.DataFrame(rows, columns=["slide_id", "status", "n_tiles", "seconds", "error"])
    tmp = out / f".{REPORT_NAME}.tmp-{os.getpid()}"
    report.to_csv(tmp, index=False)
    os.replace(tmp, out / REPORT_NAME)
    return report
