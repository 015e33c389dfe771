"""The resolution (microns per level-0 pixel) used for a slide, and the error when it is missing."""

from __future__ import annotations

import math

__all__ = ["MissingMppError", "resolve_mpp"]


class MissingMppError(ValueError):
    """A slide without mpp in a step that needs one; the message names the slide and both fixes."""


def _valid(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v > 0 else None


def resolve_mpp(
    slide_mpp: float | None,
    *,
    manifest_mpp: float | None = None,
    run_mpp: float | None = None,
    slide_id: str = "",
    path: str = "",
    needed_for: str | None = None,
) -> tuple[float | None, str]:
    """Choose the mpp (um per level-0 px) of a slide.

    Precedence: the manifest's ``mpp`` for this slide, then the run's ``--mpp``, then the
    slide's own properties. A manifest or run value overrides the slide's (scanners sometimes
    write wrong values).

    Parameters
    ----------
    slide_mpp : the value from the slide's properties (None when absent).
    manifest_mpp : the manifest's ``mpp`` for this slide (None/NaN when empty).
    run_mpp : the run-wide ``--mpp`` (None when not given).
    slide_id, path : for the error message.
    needed_for : what needs the mpp (e.g. ``"--mpp-target 0.5"``); when given and no mpp is
        found, raise :class:`MissingMppError`.

    Returns
    -------
    (mpp or None, source) with source one of ``"manifest"``, ``"run"``, ``"slide"``, ``"none"``.
    """
    for value, source in ((manifest_mpp, "manifest"), (run_mpp, "run"), (slide_mpp, "slide")):
        v = _valid(value)
        if v is not None:
            return v, source
    if needed_for:
        raise MissingMppError(
            f"slide {slide_id!r} ({path}) has no mpp (microns per pixel) in its metadata, and {needed_for} needs one; "
            f"give it for the whole run with `--mpp <um/px>` (e.g. --mpp 0.25 for 40x, 0.5 for 20x), "
            f"or per slide in an `mpp` column of the manifest (--manifest)"
        )
    return None, "none"
