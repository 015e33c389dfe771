"""The ``eval`` section and the evaluation protocol, with its one spelling.

A protocol is written ``all`` (every tile of a slide), ``sub<k>x<R>`` (R random draws of k tiles,
scored per draw and averaged over draws: the papers' score) or ``ens<k>x<R>`` (the same draws,
each slide's probabilities averaged over them, scored once). The name is also what file names,
``metrics.json`` and reports use, so a protocol reads the same everywhere (see
:mod:`wsi_pipeline.inference.protocols` for how each is scored).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import HeatmapMode, Level, PatientPool
from wsi_pipeline.config.io import short_repr
from wsi_pipeline.config.limits import MAX_CHUNK_TILES
from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.devices import check_device
from wsi_pipeline.failures import ConfigTypeError

__all__ = ["ALL", "EvalConfig", "PROTOCOL_SPELLING", "EvalProtocol", "parse_protocol", "parse_protocol_tuple", "parse_protocols", "saved_protocol"]

#: How a protocol is written, for messages and ``--help``.
PROTOCOL_SPELLING = "all, sub<k>x<R> (R draws of k tiles, metric per draw, e.g. sub256x100) or ens<k>x<R> (mean probability over the draws)"
_NAME_RE = re.compile(r"(sub|ens)([0-9]+)x([0-9]+)")


#: Most bootstrap resamples (``eval.bootstrap``, ``eval --bootstrap``): 1000 give the 95 % intervals.
MAX_BOOTSTRAP = 100_000
#: Largest ``R`` of ``sub<k>x<R>`` / ``ens<k>x<R>`` (repeats are kept per slide: memory grows with R).
MAX_REPEATS = 10_000
#: Largest ``k`` (tiles per subset; a whole slide at 20x has well under a million tiles).
MAX_SUBSET_TILES = 1_000_000


@dataclass(frozen=True)
class EvalProtocol(Checked):
    """How a slide is scored: all tiles (``k is None``) or ``repeats`` random subsets of ``k`` tiles.

    ``ensemble`` False (the papers' protocol, ``sub<k>x<R>``): metrics per repeat, mean over repeats.
    ``ensemble`` True (``ens<k>x<R>``): metrics of the slide probabilities averaged over repeats.
    ``name`` is the protocol's one spelling; it appears in file names
    (``predictions_<cohort>_<name>.csv``), in ``metrics.json`` and in saved configs.
    """

    #: tiles per subset (None: all tiles); at most :data:`MAX_SUBSET_TILES`.
    k: int | None = field(default=None, metadata=spec(ge=1, le=MAX_SUBSET_TILES))
    #: random subsets per slide (each is kept per slide; the papers use 100); at most :data:`MAX_REPEATS`.
    repeats: int = field(default=1, metadata=spec(ge=1, le=MAX_REPEATS))
    ensemble: bool = False

    @property
    def is_all(self) -> bool:
        return self.k is None

    @property
    def per_repeat(self) -> bool:
        """True for the papers' subsample protocol (metric per repeat, then the mean over repeats)."""
        return self.k is not None and not self.ensemble

    @property
    def draw_name(self) -> str:
        """``all`` or ``sub<k>x<repeats>``: keys the subsets, shared by ``sub`` and ``ens`` of the same k, R."""
        return "all" if self.k is None else f"sub{self.k}x{self.repeats}"

    @property
    def name(self) -> str:
        """``all``, ``sub<k>x<R>`` or ``ens<k>x<R>``."""
        if self.k is None:
            return "all"
        return f"{'ens' if self.ensemble else 'sub'}{self.k}x{self.repeats}"

    def to_raw(self) -> str:
        """The YAML form: the name."""
        return self.name

    def __str__(self) -> str:
        return self.name


ALL = EvalProtocol()


def parse_protocol(value: Any, where: str = "protocol") -> EvalProtocol:
    """A :class:`EvalProtocol` from its name (``all``, ``sub256x100``, ``ens256x100``); a EvalProtocol passes through.

    Raises ``ValueError`` naming ``where`` (the field or option), the value and the accepted spelling.
    """
    if isinstance(value, EvalProtocol):
        return value
    if value == "all":
        return ALL
    m = _NAME_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{where}={short_repr(value)}; expected {PROTOCOL_SPELLING}")
    try:
        return EvalProtocol(int(m.group(2)), int(m.group(3)), ensemble=m.group(1) == "ens")
    except ValueError as e:  # k or R outside its bounds: say which protocol, as written
        raise ValueError(f"{where}={short_repr(value)}: {e}; a protocol takes 1 to at most {MAX_SUBSET_TILES} tiles per "
                         f"subset and 1 to at most {MAX_REPEATS} repeats (each repeat is kept per slide; the papers use 100)") from None


def parse_protocols(values: Sequence[Any] | None, where: str = "protocols") -> list[EvalProtocol]:
    """Parse a list of protocols; duplicates are dropped, order kept; None or empty means ``[all]``."""
    if isinstance(values, (str, bytes)) or (values is not None and not isinstance(values, Sequence)):
        raise ValueError(f"{where}={short_repr(values)}; expected a list of protocols ({PROTOCOL_SPELLING})")
    out: list[EvalProtocol] = []
    for i, v in enumerate(values or ["all"]):
        p = parse_protocol(v, f"{where}[{i}]")
        if p not in out:
            out.append(p)
    return out


_SAVED_KINDS = {"subsample": "sub", "subsample_ensemble": "ens"}


def saved_protocol(value: Any) -> Any:
    """A protocol as configs saved before the one spelling wrote it (``{subsample: {k: 256,
    repeats: 100}}``, ``{subsample_ensemble: ...}``) turned into its name (``sub256x100``); any
    other value unchanged. Only for reading saved run configs (checkpoints), never user input.
    """
    if isinstance(value, Mapping) and len(value) == 1:
        kind, body = next(iter(value.items()))
        if kind in _SAVED_KINDS and isinstance(body, Mapping) and set(body) <= {"k", "repeats"} and "k" in body:
            return f"{_SAVED_KINDS[kind]}{body['k']}x{body.get('repeats', 1)}"
    return value


def parse_protocol_tuple(value: Any, where: str) -> tuple[EvalProtocol, ...]:
    """A non-empty list of protocol names (``eval.protocols``, ``predict.protocols``) as a tuple of :class:`EvalProtocol`."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigTypeError(f"{where} must be a non-empty list of protocols ({PROTOCOL_SPELLING}); got {short_repr(value)}")
    return tuple(parse_protocol(v, f"{where}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class EvalConfig(Checked):
    """Validation during training, and every setting of the evaluation stage (``wsi-pipeline eval``).

    Each ``eval`` flag sets one of these (``--bootstrap N`` is ``--set eval.bootstrap=N``), so the
    stage reads one typed config: :func:`wsi_pipeline.evaluation.evaluate.evaluate_pipeline`.

    Attributes
    ----------
    val_protocol : protocol of the per-epoch validation (the paper validates with the test protocol);
        the default of every method's ``val_protocol``, which a method may set itself.
    protocols : protocols of the evaluation stage.
    seed : seed of the random tile draws of subsampling protocols (and random pseudo-bags).
    bootstrap : resamples of the slides for the 95 % intervals (0: no intervals; each costs one
        scikit-learn call per metric and seed, ~1 ms).
    level : ``slide`` (metrics of slides, as always) or ``patient``: also metrics of patients, each
        scored from its slides' scores pooled by ``patient_pool`` (records ``patient_<metric>``).
    patient_pool : ``mean`` (default: the mean of the slides' class probabilities, risks or
        predicted values) or ``max``.
    horizons : survival: times (in the manifest's ``time`` unit) of the time-dependent AUC; empty
        (default) means the 25th, 50th and 75th percentiles of the training split's event times.
    methods : evaluate only these methods (``--method``, repeatable); empty (default): every method.
        Each must be a method of the pipeline.
    device : ``auto`` (CUDA, then Apple MPS, then CPU), ``cpu``, ``cuda``, ``cuda:<i>`` or ``mps``
        (``--device``; :data:`wsi_pipeline.devices.DEVICES`).
    batch_size : tiles per encoder call (``--batch-size``); None (default): each method's ``chunk_size``.
    heatmaps : write heatmaps, per-tile scores and GeoJSON for one model (``--no-heatmaps``: false).
    heatmap_method : the method whose seed best on validation draws the heatmaps (``--heatmap-method``);
        None (default): the run best on validation.
    heatmap_mode : colour normalisation of the heatmaps: ``rank`` (per slide), ``minmax`` (per slide)
        or ``raw`` scores (``--heatmap-mode``).
    results : output folder (``--results``); None (default): ``<results_dir>/<name>``. With
        ``eval --folds``, the folder that holds ``<name>_fold<k>/`` and ``<name>_cv/``.
    """

    val_protocol: EvalProtocol = field(default=ALL, metadata=spec(parse=parse_protocol))
    protocols: tuple[EvalProtocol, ...] = field(default=(ALL, EvalProtocol(256, 100)), metadata=spec(parse=parse_protocol_tuple))
    seed: int = 0
    bootstrap: int = field(default=1000, metadata=spec(ge=0, le=MAX_BOOTSTRAP))
    level: Level = "slide"
    patient_pool: PatientPool = "mean"
    horizons: tuple[float, ...] = ()
    methods: tuple[str, ...] = ()
    device: str = field(default="auto", metadata=spec(check=check_device))
    batch_size: int | None = field(default=None, metadata=spec(gt=0, le=MAX_CHUNK_TILES))
    heatmaps: bool = True
    heatmap_method: str | None = None
    heatmap_mode: HeatmapMode = "rank"
    results: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [h for h in self.horizons if not h > 0]
        if bad:
            raise ValueError(f"eval.horizons={list(self.horizons)}; expected times > 0 (in the manifest's time unit)")
