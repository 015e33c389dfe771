"""Whether a slide's complete store is current: the store's identity (slide fingerprint, settings, formula).

Resume compares the identity recorded in a store with the one the settings would give
(:func:`store_matches`); partial stores (``.<id>.zarr.tmp-<pid>``) of processes that are gone
are removed (:func:`clean_stale`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wsi_pipeline.config.store_settings import same_identity
from wsi_pipeline.data.store import complete_attrs
from wsi_pipeline.slides import slide_fingerprint
from wsi_pipeline.slides.fingerprint import same_slide
from wsi_pipeline.tiling.params import output_params

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.tiling.job import SlideJob

__all__ = ["TILE_FORMULA_VERSION", "clean_stale", "store_identity", "store_matches", "valid_mpp"]


#: Version of the tile formula (grid.TILE_FORMULA); stores built by an earlier one are rebuilt.
TILE_FORMULA_VERSION = 2


def valid_mpp(v: float | None) -> float | None:
    return float(v) if v is not None and math.isfinite(v) and v > 0 else None


def store_identity(job: SlideJob, config: TilingConfig, fingerprint: str) -> dict[str, Any]:
    """What determines a store's content, known before the slide is opened.

    The fallback ``--mpp`` is not in it: it matters only for slides without an mpp of their own,
    which :func:`store_matches` checks against the store's recorded ``mpp_source``.
    """
    identity = {
        "fingerprint": fingerprint, "tile_formula": TILE_FORMULA_VERSION,
        "mpp_manifest": valid_mpp(job.mpp), "mpp_force": valid_mpp(config.mpp_force), **output_params(config),
    }
    if config.regions is not None:  # the slide's own regions file: edited annotations rebuild the store
        from wsi_pipeline.tiling.regions import region_file

        try:
            path = region_file(config.regions, job.slide_id)
            identity["regions_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        except FileNotFoundError:
            identity["regions_sha256"] = None  # tiling the slide reports the missing file
    if config.points is not None:  # the slide's own points: edited points rebuild the store
        from wsi_pipeline.tiling.points import points_sha256

        identity["points_sha256"] = points_sha256(config.points, job.slide_id)
    return json.loads(json.dumps(identity))  # as the store's attributes hold it (tuples become lists)


def stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [int(st.st_size), int(st.st_mtime_ns)]


def store_matches(path: Path, job: SlideJob, config: TilingConfig) -> dict[str, Any] | None:
    """The attributes of a complete store at ``path`` built from the same slide file and settings, else None.

    The slide is identified by its fingerprint; when its size and modification time equal
    those recorded in the store, the recorded fingerprint is reused instead of re-hashing
    (a resume check of thousands of slides on a network file system stays cheap).
    """
    attrs = complete_attrs(path)
    if attrs is None:
        return None
    slide = Path(job.path)
    recorded = attrs.get("tiling_identity", {}).get("fingerprint")
    same_stat = recorded and attrs.get("slide_stat") == stat_key(slide)
    fingerprint = recorded if same_stat else slide_fingerprint(slide)
    if recorded and fingerprint != recorded and same_slide(recorded, fingerprint):
        fingerprint = recorded  # a store recorded before the spread blocks: compared by its own rule
    identity = attrs.get("tiling_identity")
    if not isinstance(identity, dict) or not same_identity(identity, store_identity(job, config, fingerprint)):
        return None
    # a store whose mpp came from the fallback (or that had none) depends on the fallback too
    source = str(attrs.get("mpp_source", ""))
    if (source in ("run-fallback", "none") or source.startswith("ignored")) and attrs.get("slide_mpp") != valid_mpp(config.mpp):
        return None
    return attrs


def clean_stale(out_dir: Path, slide_id: str) -> None:
    """Remove temporary stores of ``slide_id`` left by processes that no longer run."""
    prefix = f".{slide_id}.zarr."
    try:  # one listing compared by prefix (a glob matches a pattern against every name of a folder of thousands)
        with os.scandir(out_dir) as entries:
            found = [out_dir / e.name for e in entries if e.name.startswith(prefix)]
    except FileNotFoundError:
        return
    for p in found:
        pid_text = p.name.rsplit("-", 1)[-1]
        try:
            pid = int(pid_text)
            if pid != os.getpid():
                os.kill(pid, 0)
                continue  # a live process (another run) owns it
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        shutil.rmtree(p, ignore_errors=True)
