"""Frozen-encoder features: one HDF5 file per slide, the layout CLAM users know.

``<out_dir>/<slide_id>.h5`` holds

- ``features`` float32 [N, D]: the encoder's embedding of each tile of the slide's tile store,
  in store order;
- ``coords`` int64 [N, 2]: (x, y) of each tile's top-left corner in level-0 px (from the store);
- ``grid`` int32 [N, 2]: (col, row) of each tile on the store's tile grid;
- attributes: ``slide_id``, ``encoder`` (name: ``resnet18``, a foundation preset such as
  ``uni_v1``, or ``timm:<architecture>``), ``weights_sha256`` (sha256 over the encoder's state
  dict: names, dtypes, shapes and bytes, in key order), ``weights_file_sha256`` (sha256 of the
  weights file the encoder was loaded from; empty without one), ``preprocessing`` (JSON: the
  resize, normalisation and embedding the encoder applied to this store's tiles),
  ``precision`` (``float32``, or ``bfloat16`` autocast), ``store_fingerprint`` (see
  :func:`store_fingerprint`), ``stain`` (the slide's stain normalisation: ``none``, or the method
  and a hash of the target and the slide's estimate, :meth:`~wsi_pipeline.data.stain.StainNormaliser.tag`;
  files written before it existed count as ``none``), ``n_tiles``, ``feature_dim``, ``tile_size`` (px),
  ``package_version``, ``created``, and ``complete = True``.

Files are written under a temporary name and renamed into place, so a file that exists is
complete. A file whose encoder, weights hashes, preprocessing, precision, store fingerprint and stain
normalisation match is up to date and is skipped (the normalisation is part of the cache key). Training the aggregator alone (the frozen baseline) reads these files with
:func:`read_features`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import pandas as pd

from wsi_pipeline.devices import resolve_device
from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.jobs.slide_jobs import run_slides, write_report_csv
from wsi_pipeline.slide_ids import slide_output_path
from wsi_pipeline.output_dirs import check_output_dir
from wsi_pipeline.types import TileStoreLike

if TYPE_CHECKING:
    import torch

__all__ = [
    "LazyFeatures",
    "extract_features",
    "features_path",
    "read_features",
    "store_fingerprint",
    "weights_sha256",
    "REPORT_NAME",
]

log = logging.getLogger(__name__)

#: Per-slide status table written beside the feature files.
REPORT_NAME = "features_report.csv"
#: Its columns.
REPORT_COLUMNS: tuple[str, ...] = ("slide_id", "status", "n_tiles", "seconds", "error", "note")
#: ``note`` of a slide the tiler left without a store (skipped by a rule, or failed): ``skipped``, not ``failed``.
LEFT_OUT_NOTE = "left out by the tiler"


def features_path(out_dir: str | os.PathLike, slide_id: str) -> Path:
    """Return the feature file ``<out_dir>/<slide_id>.h5``."""
    return slide_output_path(out_dir, slide_id, ".h5")


def weights_sha256(module: Any) -> str:
    """sha256 (hex) over ``module.state_dict()``: each entry's name, dtype, shape and raw bytes, in key order."""
    import torch

    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def store_fingerprint(store: TileStoreLike) -> str:
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
    ``features``/``coords`` datasets. TRIDENT's, STAMP's and CLAM's ``.pt`` files are read too
    (:func:`wsi_pipeline.data.feature_formats.read_slide_features`; coordinates in level-0 px, ``grid``
    in the attributes).
    """
    import h5py

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"feature file {path} not found; run `wsi-pipeline features` first")
    foreign = _foreign_features(path)
    if foreign is not None:
        return foreign
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


def _foreign_features(path: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]] | None:
    """``read_features``' answer for a TRIDENT or STAMP file, or CLAM's ``.pt``; None for ours (and CLAM's h5,
    whose datasets are ours)."""
    from wsi_pipeline.data.feature_formats import detect_format, read_slide_features

    try:
        fmt = detect_format(path)
    except ValueError:  # no known layout: our reader names what is missing
        return None
    if fmt in ("wsi-pipeline", "clam") and path.suffix != ".pt":
        return None
    sf = read_slide_features(path, fmt)
    return sf.features, sf.coords_or_index, {**sf.file_attrs, "grid": sf.grid}


#: Attribute -> why a file whose value differs is rebuilt.
_STALE_BECAUSE = {
    "encoder": "another encoder",
    "weights_sha256": "encoder weights changed (other weights, or BatchNorm calibrated on another training set)",
    "weights_file_sha256": "another encoder weights file",
    "preprocessing": "another preprocessing (resize, normalisation or embedding)",
    "precision": "another precision (float32 / bfloat16)",
    "store_fingerprint": "tile store rebuilt or retiled",
    "stain": "stain normalisation changed (data.stain, or the slide's stain estimate)",
    "layout": "another file layout (features --layout)",
}
#: Value of an attribute absent from files written before it existed.
_ABSENT_MEANS = {"stain": "none", "layout": "wsi-pipeline"}
#: ``precision`` attribute values.
PRECISIONS = {False: "float32", True: "bfloat16"}


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
                if k not in f.attrs and k not in _ABSENT_MEANS:
                    return f"written by an older version (no {k} recorded)"
                if f.attrs.get(k, _ABSENT_MEANS.get(k)) != v:
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


def _write_h5(path: Path, feats: np.ndarray, coords: np.ndarray, grid: np.ndarray, attrs: Mapping[str, Any],
              layout: str = "wsi-pipeline", store: TileStoreLike | None = None) -> None:
    """Write a feature file atomically (:func:`~wsi_pipeline.io_atomic.atomic_path`), ``complete`` set last.

    ``layout``: ours, or ``trident`` / ``stamp`` (:func:`wsi_pipeline.data.feature_formats.write_features`, from
    ``store``'s tile geometry and mpp; our attributes kept on the file, so up-to-date files are still skipped)."""
    import h5py

    if layout != "wsi-pipeline":
        from wsi_pipeline.data.feature_formats import write_features
        from wsi_pipeline.data.store import store_level0_size, store_tile_extent

        assert store is not None
        extent = store_tile_extent(store.attrs, store.tile_size)
        ds = float(store.attrs.get("downsample", 1.0) or 1.0)
        mpp = store.attrs.get("mpp")
        level0_mpp = float(mpp) / ds if mpp else None
        write_features(path, layout, feats, coords, tile_size_level0=extent,
                       level0_size=store_level0_size(store.attrs, coords, extent), mpp=level0_mpp,
                       patch_size=int(store.tile_size), encoder=str(attrs.get("encoder", "")),
                       attrs={**attrs, "complete": True})
        return
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("features", data=feats.astype(np.float32, copy=False))
            f.create_dataset("coords", data=coords.astype(np.int64, copy=False))
            f.create_dataset("grid", data=grid.astype(np.int32, copy=False))
            for k, v in attrs.items():
                f.attrs[k] = v
            f.attrs["complete"] = True


def _embed_store(store: TileStoreLike, encoder: Any, device: torch.device | str, batch_size: int, bf16: bool = False) -> np.ndarray:
    """Every tile of ``store`` embedded (with the store's stain normalisation, ``store.stain``), optionally
    under bfloat16 autocast: float32 [N, D].

    The next batch is read (decompressed, checksummed) in a second thread while the encoder runs on
    this one, and a convolutional encoder runs channels-last (NHWC), which the CPU's and the GPU's
    convolution kernels prefer (ResNet-18 on 256 px tiles: 15 -> 21 tiles/s on this project's 2-core
    CPU, 41 with ``bf16`` where the CPU has bfloat16 instructions).
    """
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from wsi_pipeline.data.tensors import tiles_to_tensor

    n = len(store)
    out = []
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    fmt = torch.channels_last if any(isinstance(m, torch.nn.Conv2d) for m in encoder.modules()) else torch.contiguous_format
    with torch.inference_mode(), autocast:
        if n == 0:  # learn D from one blank tile so the file still has shape [0, D]
            blank = torch.zeros(1, 3, store.tile_size, store.tile_size, device=device)
            return np.zeros((0, encoder(blank).shape[1]), np.float32)
        starts = list(range(0, n, batch_size))

        def read(start: int) -> np.ndarray:
            return store.read(np.arange(start, min(start + batch_size, n)))

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="feature-reader") as pool:
            pending = pool.submit(read, starts[0])
            for i in range(len(starts)):
                tiles = pending.result()
                if i + 1 < len(starts):
                    pending = pool.submit(read, starts[i + 1])  # read ahead while the encoder runs
                x = tiles_to_tensor(tiles, device=device, stain=store.stain).contiguous(memory_format=fmt)
                out.append(encoder(x).float().cpu().numpy())
    return np.concatenate(out, 0)


#: What :func:`_slide_features` records of a slide it could not embed (report columns beyond the runner's).
_REPORT_DEFAULTS = {"n_tiles": 0}


def _slide_features(
    slide_id: str, row: dict[str, Any], encoder: Any, device: str, tiles_dir: str, out: str, encoder_name: str,
    digest: str, batch_size: int, overwrite: bool, stain: Any = None, file_digest: str = "", bf16: bool = False,
    layout: str = "wsi-pipeline",
) -> None:
    """The job runner's work for one slide (:func:`wsi_pipeline.jobs.slide_jobs.run_one`): embed its store into
    ``<out>/<slide_id>.h5`` unless up to date, filling ``row`` (``n_tiles``; ``status`` skipped when up to
    date; ``reason``, not a report column: why an existing file was re-extracted); ``stain``: the
    :class:`~wsi_pipeline.data.stain_slides.StainContext` the tiles go through (None: none)."""
    import torch

    import wsi_pipeline
    from wsi_pipeline.data.store import open_store, store_path

    dev = resolve_device(device)
    first = next(encoder.parameters(), None)
    if first is not None and first.device != torch.device(dev):  # a Dask worker got the broadcast copy on the CPU
        encoder.to(dev).eval()
    dest = features_path(out, slide_id)
    store = open_store(store_path(tiles_dir, slide_id))
    if stain is not None:
        stain.attach(store)
    from wsi_pipeline.models.foundation import preprocessing_record

    expected = {"encoder": encoder_name, "weights_sha256": digest, "weights_file_sha256": file_digest,
                "preprocessing": preprocessing_record(encoder, int(store.tile_size)), "precision": PRECISIONS[bool(bf16)],
                "store_fingerprint": store_fingerprint(store), "stain": store.stain.tag if store.stain is not None else "none",
                "layout": layout}
    row["n_tiles"] = len(store)
    reason = "--overwrite" if overwrite else _stale_reason(dest, expected)
    if reason is None:
        row["status"] = "skipped"
        return
    if reason != "no feature file":
        row["reason"] = reason
    feats = _embed_store(store, encoder, dev, int(batch_size), bool(bf16))
    attrs = {
        **expected,
        "slide_id": slide_id,
        "n_tiles": len(store),
        "feature_dim": int(feats.shape[1]),
        "tile_size": int(store.tile_size),
        "package_version": wsi_pipeline.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write_h5(dest, feats, store.coords, store.grid, attrs, layout, store)


def extract_features(
    manifest_df: pd.DataFrame,
    tiles_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    encoder_name: str = "resnet18",
    weights: str | Path | None = None,
    *,
    encoder: Any = None,
    batch_size: int = 64,
    device: str = "auto",
    overwrite: bool = False,
    seed: int = 0,
    progress: bool = True,
    cluster: Any = None,
    retries: int = 2,
    stain: Any = None,
    bf16: bool = False,
    layout: str = "wsi-pipeline",
) -> pd.DataFrame:
    """Embed every slide's tile store with a frozen encoder and write ``<out_dir>/<slide_id>.h5``.

    Parameters
    ----------
    manifest_df : manifest rows (``slide_id`` is used); stores are ``<tiles_dir>/<slide_id>.zarr``.
    tiles_dir, out_dir : folders of the tile stores and of the feature files (created).
    encoder_name : a registered encoder (``wsi_pipeline.models.ENCODERS``), recorded in the files.
    weights : weights file for :func:`wsi_pipeline.models.build_encoder` (a torchvision ResNet
        checkpoint, or the file a foundation model's card publishes). Without weights the
        encoder is randomly initialised from ``seed`` (reproducible, but not a useful baseline).
    encoder : an already built module [B, 3, T, T] -> [B, D] to use instead of building
        ``encoder_name`` (``encoder_name`` is then only the recorded name).
    batch_size : tiles per forward.
    device : ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``.
    overwrite : re-extract files that are up to date.
    progress : show a per-slide progress bar.
    cluster : None = in this process; else each slide is a Dask task (a ``--cluster`` string,
        a :class:`~wsi_pipeline.jobs.cluster.ClusterSpec` or a ``distributed.Client``; see
        :mod:`wsi_pipeline.jobs.slide_jobs`): the encoder is built here and sent to every worker,
        which runs it on its own ``device``.
    retries : with ``cluster``: extra runs of a slide whose worker died.
    stain : a fitted :class:`~wsi_pipeline.data.stain_slides.StainContext`: tiles are stain-normalised
        before the encoder, and the normalisation is recorded in each file (its cache key).
    bf16 : embed under bfloat16 autocast (features stored as float32; recorded as ``precision``).
    layout : ``wsi-pipeline`` (ours), ``trident`` (``features`` + ``coords`` with TRIDENT's attributes on it) or
        ``stamp`` (``feats`` + ``coords`` in micrometres, STAMP's attributes; needs the stores' mpp); see
        :mod:`wsi_pipeline.data.feature_formats`. A file of another layout is rebuilt.

    Returns
    -------
    DataFrame with one row per slide: ``slide_id, status`` (ok / skipped / failed), ``n_tiles,
    seconds, error``; also written atomically to ``<out_dir>/features_report.csv``. A bad slide (a
    missing or damaged store, a feature file that cannot be written: :mod:`wsi_pipeline.failures`)
    is recorded and the others go on; a bug, running out of memory or a full disk stops the run.
    """
    if int(batch_size) < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    out = Path(out_dir)
    check_output_dir(out, what="features folder")
    dev = resolve_device(device)
    encoder, digest, file_digest = _frozen_encoder(encoder_name, weights, encoder, seed, dev)

    from wsi_pipeline.data.bags import skipped_by_tiler

    slide_ids = [str(s) for s in manifest_df["slide_id"]]
    _report_orphans(out, slide_ids)
    # a slide the tiler skipped by rule (fluorescence under brightfield rules) or failed on has no store:
    # it is reported as skipped, with the tiler's reason, not as a features failure
    left_out = skipped_by_tiler(tiles_dir)
    left_rows = [{"slide_id": sid, "status": "skipped", "n_tiles": 0, "seconds": 0.0, "error": "",
                  "note": f"{LEFT_OUT_NOTE}: {left_out[sid]}"} for sid in slide_ids if sid in left_out]
    slide_ids = [sid for sid in slide_ids if sid not in left_out]
    # a bad slide (missing or damaged store, unwritable file) is a failed row; a bug stops the run (wsi_pipeline.failures)
    rows = run_slides(
        slide_ids, _slide_features,
        (device, str(tiles_dir), str(out), encoder_name, digest, int(batch_size), overwrite, stain, file_digest, bool(bf16),
         layout),
        defaults=_REPORT_DEFAULTS, broadcast=encoder.cpu() if cluster is not None else encoder,
        cluster=cluster, retries=retries, desc="features", progress=progress,
        report_path=out / REPORT_NAME, columns=REPORT_COLUMNS,
    )
    _log_reextracted(rows)
    if left_rows:
        rows = [*rows, *left_rows]
        write_report_csv(out / REPORT_NAME, rows, REPORT_COLUMNS)
    return pd.DataFrame(rows, columns=list(REPORT_COLUMNS))


def _frozen_encoder(encoder_name: str, weights: str | os.PathLike | None, encoder: Any, seed: int,
                    device: Any) -> tuple[Any, str, str]:
    """``(encoder on device in eval mode, weights_sha256, weights_file_sha256)``: ``encoder`` as given, else
    ``encoder_name`` built with ``weights`` (random from ``seed`` without, with a warning)."""
    import torch

    from wsi_pipeline.models.imagenet import resolve_weights

    weights = resolve_weights(encoder_name, None if weights is None else Path(weights) if not isinstance(weights, str) else weights)
    if encoder is None:
        from wsi_pipeline.models import build_encoder

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            encoder = build_encoder(encoder_name, weights=weights)
        if weights is None:
            log.warning("encoder randomly initialised: no --weights given, so %s is random (seed %d); its features are "
                        "not a useful baseline (--weights imagenet for a ResNet, or a model file)", encoder_name, seed)
    encoder = encoder.to(device).eval()
    base = getattr(encoder, "base_weights", None)
    if base is not None:
        file_digest = base["sha256"]
    elif weights is not None:
        from wsi_pipeline.models.foundation import file_sha256

        file_digest = file_sha256(weights)
    else:
        file_digest = ""
    return encoder, weights_sha256(encoder), file_digest


def _log_reextracted(rows: Sequence[Mapping[str, Any]]) -> None:
    """One warning naming why existing feature files were re-extracted (the rows' ``reason``), by count."""
    reasons: dict[str, int] = {}
    for row in rows:
        if row.get("reason"):
            reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
    if reasons:
        log.warning("re-extracted features of %s", "; ".join(f"{n} slide(s): {why}" for why, n in reasons.items()))


class LazyFeatures(Sequence):
    """Validation features read from h5 one slide at a time (a cohort's features need not fit in memory)."""

    def __init__(self, paths: list[Path] | list[list[Path]]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        import torch

        paths = self.paths[i]
        if isinstance(paths, (list, tuple)):  # a patient bag: its slides' features in order
            return torch.cat([torch.from_numpy(read_features(p)[0]) for p in paths])
        return torch.from_numpy(read_features(paths)[0])
