"""The resolution (microns per level-0 pixel) used for a slide, where it came from, and the error when it is missing.

Precedence, per slide (:func:`resolve_mpp`):

1. ``run-forced``: the run's ``--mpp-force`` (every slide, whatever it or the manifest says);
2. ``manifest``: the manifest's ``mpp`` column for this slide (explicit, per slide);
3. ``slide``: the slide's own metadata;
4. ``run-fallback``: the run's ``--mpp``, only for slides that have no mpp of their own;
5. ``none``: no mpp (an error where one is needed).
"""

from __future__ import annotations

import math

__all__ = ["MPP_SOURCES", "MissingMppError", "resolve_mpp"]

#: Values of ``mpp_source`` in store attributes and ``tiling_report.csv``, in precedence order.
MPP_SOURCES: tuple[str, ...] = ("run-forced", "manifest", "slide", "run-fallback", "none")


class MissingMppError(ValueError):
    """A slide without mpp in a step that needs one; the message names the slide and the fixes."""


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
    force_mpp: float | None = None,
    slide_id: str = "",
    path: str = "",
    needed_for: str | None = None,
) -> tuple[float | None, str]:
    """Choose the mpp (um per level-0 px) of a slide.

    Precedence: ``force_mpp`` (``--mpp-force``), then the manifest's ``mpp`` for this slide, then
    the slide's own metadata, then ``run_mpp`` (``--mpp``, a fallback for slides without one).

    Parameters
    ----------
    slide_mpp : the value from the slide's properties (None when absent).
    manifest_mpp : the manifest's ``mpp`` for this slide (None/NaN when empty).
    run_mpp : the run-wide fallback ``--mpp`` (None when not given).
    force_mpp : the run-wide ``--mpp-force`` (None when not given).
    slide_id, path : for the error message.
    needed_for : what needs the mpp (e.g. ``"--mpp-target 0.5"``); when given and no mpp is
        found, raise :class:`MissingMppError`.

    Returns
    -------
    (mpp or None, source) with source one of :data:`MPP_SOURCES`.
    """
    order = ((force_mpp, "run-forced"), (manifest_mpp, "manifest"), (slide_mpp, "slide"), (run_mpp, "run-fallback"))
    for value, source in order:
        v = _valid(value)
        if v is not None:
            return v, source
    if needed_for:
        raise MissingMppError(
            f"slide {slide_id!r} ({path}) has no mpp (microns per pixel) in its metadata, and {needed_for} needs one; "
            f"give it per slide in an `mpp` column of the manifest (--manifest), or with `--mpp <um/px>` for every slide "
            f"that has none (e.g. --mpp 0.25 for 40x, 0.5 for 20x; slides with their own mpp keep it). "
            f"`--mpp-force <um/px>` overrides every slide's mpp, including correct ones"
        )
    return None, "none"
