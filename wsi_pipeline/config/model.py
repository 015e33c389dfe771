"""The model sections of a method: ``encoder`` (with the BatchNorm mode and its warning),
``aggregator`` (or PatchGD head) and ``bigl``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from wsi_pipeline.config.choices import BNMode, encoder_names, model_names
from wsi_pipeline.config.schema import positive, spec

if TYPE_CHECKING:
    from wsi_pipeline.config.pipeline import MethodConfig

__all__ = ["AggregatorConfig", "BagStatisticsWarning", "BiglConfig", "EncoderConfig", "bag_statistics_warning"]


@dataclass(frozen=True)
class EncoderConfig:
    """Tile encoder: a name from ``wsi_pipeline.models.ENCODERS``, optional weights file, BatchNorm mode.

    ``bn``: ``frozen`` (running statistics, exact for every strategy), ``chunk`` (batch
    statistics per chunk, ``accumulate`` only; the ABMIL-ACC paper's setting, "the paper's, not exact": each
    chunk is normalised by its own statistics, not the bag's) or ``train`` (batch statistics of
    the whole bag; ``full`` and ``bigl``; ``patchgd``: train mode throughout, the PatchGD paper's).

    ``calibrate_bn``: before training, re-estimate the BatchNorm running statistics on this many
    randomly drawn training tiles (0: off). Meant for an encoder without pretrained weights
    (whose initial statistics describe nothing) used with ``bn: frozen``; a frozen method's
    feature files are extracted with the calibrated encoder.

    ``recalibrate_bn``: calibrate again at the start of every epoch, so that frozen statistics
    follow the weights as they train (an encoder trained from scratch otherwise drifts away from
    the statistics it started with, and training can diverge). Exact gradients within each epoch
    are kept: the statistics are constant while the epoch's steps are taken.

    ``chunk`` and ``train`` normalise with the statistics of the bag (or chunk) being trained on,
    while validation, evaluation and prediction normalise with running statistics: the model can
    learn to read the label from the bag's own statistics and then fails at evaluation. Training
    with them emits a :class:`BagStatisticsWarning` (see :func:`bag_statistics_warning`).
    """

    name: str = field(default="resnet18", metadata=spec(choices=encoder_names))
    weights: str | None = None
    bn: BNMode = "frozen"
    calibrate_bn: int = 0
    recalibrate_bn: bool = False

    def __post_init__(self) -> None:
        if self.calibrate_bn < 0:
            raise ValueError(f"encoder.calibrate_bn={self.calibrate_bn}; expected a number of tiles >= 0 (0 = off)")
        if self.recalibrate_bn and self.calibrate_bn <= 0:
            raise ValueError("encoder.recalibrate_bn needs encoder.calibrate_bn > 0 (the number of tiles to calibrate on)")


class BagStatisticsWarning(UserWarning):
    """Training normalises BatchNorm with bag statistics, evaluation with running statistics."""


def bag_statistics_warning(method: "MethodConfig") -> str | None:
    """Why training ``method`` with bag-statistics BatchNorm is risky; None when it does not use them.

    A method uses bag statistics when its encoder trains (any strategy but ``frozen``) with
    ``encoder.bn`` ``train`` (the whole bag is one BatchNorm batch: ``full``, ``bigl``, and
    ``patchgd``'s tiles of a step) or ``chunk`` (each accumulation chunk is one: the ABMIL-ACC
    paper's setting). Validation, evaluation and prediction run BatchNorm on running statistics,
    so what the model learned from the statistics of its bags is not what it sees there.
    """
    if method.strategy == "frozen" or method.encoder.bn == "frozen":
        return None
    batch = "each chunk of the bag" if method.encoder.bn == "chunk" else "the whole bag"
    return (
        f"method {method.name!r}: encoder.bn={method.encoder.bn!r} normalises BatchNorm with the statistics of "
        f"{batch} in training, but validation, evaluation and prediction use running statistics. A few lesion "
        "tiles shift the statistics of all the others, so the model can learn to read the label from the bag's "
        "statistics instead of from its tiles, and then fail at evaluation (README: 'Bag-statistics BatchNorm'). Prefer "
        "`encoder: {bn: frozen, calibrate_bn: N, recalibrate_bn: true}`; keep bn=" + repr(method.encoder.bn)
        + " only to reproduce a paper, and check the validation metric, not the training loss"
    )


@dataclass(frozen=True)
class AggregatorConfig:
    """MIL aggregator (or PatchGD head): a registered name and its keyword options."""

    name: str = field(default="abmil", metadata=spec(choices=model_names))
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BiglConfig:
    """Big-Layers: residual stages run as Big-Layers after the stem, and the device chunk size in elements.

    ``device_budget_gb``: device memory a training step may use, in GB (10^9 bytes). The step is
    plain when it fits; otherwise the early units (stem, residual blocks) that do not fit run as
    fused runs, recomputed chunk by chunk, their checkpoints on the device when they fit and in
    host memory when not (:mod:`wsi_pipeline.bigl.budget` states the rule; the plan is logged and
    written to the run folder as ``bigl_plan.txt``). ``auto`` (default): the CUDA device's free
    memory minus a margin (10 % of its memory, at least 1 GiB); on the CPU, where host and device
    memory are one, ``auto`` keeps the fixed plan. ``null``: the fixed plan, the paper's: the stem
    and ``stages`` residual stages offloaded layer by layer. ``max_elements`` caps one chunk step
    in both.

    ``embed_budget_mib``: validation and evaluation embed with the plain encoder on the device when
    one call's estimated activations fit this many MiB, through Big-Layers otherwise
    (:class:`wsi_pipeline.bigl.EmbeddingEncoder`); None: half the CUDA device's memory, no limit
    on the CPU.
    """

    stages: int = 1
    max_elements: int = 2**27
    embed_budget_mib: float | None = None
    device_budget_gb: float | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        if self.stages < 0:
            raise ValueError(f"bigl.stages={self.stages}; expected >= 0")
        positive("bigl.max_elements", self.max_elements)
        if isinstance(self.device_budget_gb, (int, float)) and not isinstance(self.device_budget_gb, bool):
            positive("bigl.device_budget_gb", self.device_budget_gb)
        if self.embed_budget_mib is not None and not self.embed_budget_mib >= 0:
            raise ValueError(f"bigl.embed_budget_mib={self.embed_budget_mib}; expected MiB >= 0 or null (device default)")
