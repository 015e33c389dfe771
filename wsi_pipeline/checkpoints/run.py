"""The run checkpoint (``best.pt``, ``last.pt``) as one typed artefact: :class:`RunCheckpoint`.

:meth:`RunCheckpoint.build` is the one place a run checkpoint is made (the training loop, tests,
benchmarks); :meth:`RunCheckpoint.to_state` turns it into the plain containers and tensors the
file holds (``torch.load(..., weights_only=True)`` reads them back), :meth:`RunCheckpoint.from_state`
reads any layout this package ever wrote, through :func:`wsi_pipeline.checkpoints.migrations.migrate`.
Files are written and read by :func:`wsi_pipeline.checkpoints.files.save_run_checkpoint` and
:func:`~wsi_pipeline.checkpoints.files.load_run_checkpoint` (atomic write, both integrity checks).

The file's keys (schema version 2; ``format`` and ``integrity`` are added by the file layer)::

    schema_version   2 (absent = 1: :mod:`wsi_pipeline.checkpoints.migrations`)
    config           the run's resolved pipeline config (plain dict; its methods list holds this run's method)
    method           the method's config (plain dict)
    seed, epoch      the run's seed; epochs completed
    models           {"encoder": state dict or None, "aggregator": state dict, ...}
    encoder_info     what the encoder started from and how it is stored, or None
                     (:func:`wsi_pipeline.methods.models.encoder_checkpoint`)
    endpoint         :meth:`wsi_pipeline.tasks.base.Endpoint.to_state`
    best             {"metric", "value", "epoch", "loss"} of the best validation epoch, or None
    tiling           the settings that tiled the training stores, or None
    stain_reference  the training tiles' stain summary (:mod:`wsi_pipeline.data.stain_stats`), or None
    stain_normalise  ``none``, ``macenko`` or ``reinhard`` (``data.stain.normalise``)
    stain            the fitted normalisation (:meth:`wsi_pipeline.data.stain_slides.StainContext.state`), or None
    patchgd          a ``patchgd`` method's resolved options as trained
                     (:meth:`wsi_pipeline.config.patchgd.PatchGDConfig.to_state`, versioned), else absent
    optimizer, scheduler, rng, history   last.pt only (:class:`ResumeState`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wsi_pipeline.config.pipeline import (
    MethodConfig,
    PipelineConfig,
    config_from_dict,
    config_to_dict,
    upgrade_saved_config,
)
from wsi_pipeline.config.patchgd import PatchGDConfig
from wsi_pipeline.config.schema import Checked, build, spec
from wsi_pipeline.config.strategy_traits import strategy_traits
from wsi_pipeline.checkpoints.migrations import SCHEMA_VERSION, migrate
from wsi_pipeline.methods.endpoints import endpoint_outputs
from wsi_pipeline.tasks import Endpoint

if TYPE_CHECKING:
    import torch

__all__ = ["ResumeState", "RunCheckpoint"]

#: Keys of the file written only for resuming (``last.pt``).
_RESUME_KEYS = ("optimizer", "scheduler", "rng", "history")
#: Keys the file layer adds and checks (:mod:`wsi_pipeline.checkpoints.files`).
_FILE_KEYS = ("format", "integrity")


@dataclass(frozen=True)
class ResumeState(Checked):
    """What ``last.pt`` holds beyond ``best.pt`` to continue a run exactly.

    Attributes
    ----------
    optimizer : ``optimizer.state_dict()``.
    scheduler : the epoch schedule's state (:meth:`wsi_pipeline.training.optim.EpochSchedule.state_dict`).
    rng : :func:`wsi_pipeline.checkpoints.files.capture_rng`.
    history : one dict per epoch (the rows of ``history.csv``).
    """

    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    history: Any  # list of per-epoch dicts

    def to_state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "scheduler": self.scheduler, "rng": self.rng, "history": list(self.history)}


@dataclass(frozen=True)
class RunCheckpoint(Checked):
    """A trained run's checkpoint (the module docstring lists the file's keys).

    Make one with :meth:`build`; read one with :meth:`from_state` (or
    :func:`wsi_pipeline.checkpoints.files.load_run_checkpoint`).
    """

    config: dict[str, Any]
    method: dict[str, Any]
    seed: int
    epoch: int = field(metadata=spec(ge=0))
    models: dict[str, Any]
    endpoint: dict[str, Any]
    encoder_info: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    tiling: dict[str, Any] | None = None
    stain_reference: dict[str, Any] | None = None
    stain_normalise: str = "none"
    stain: dict[str, Any] | None = None
    patchgd: dict[str, Any] | None = None
    resume: ResumeState | None = None
    schema_version: int = field(default=SCHEMA_VERSION, metadata=spec(ge=SCHEMA_VERSION, le=SCHEMA_VERSION))

    @classmethod
    def build(
        cls,
        config: PipelineConfig,
        method: MethodConfig,
        *,
        seed: int,
        epoch: int,
        models: Mapping[str, Mapping[str, torch.Tensor] | None],
        endpoint: Endpoint | None = None,
        encoder_info: Mapping[str, Any] | None = None,
        best: Mapping[str, Any] | None = None,
        tiling: Mapping[str, Any] | None = None,
        stain_reference: Mapping[str, Any] | None = None,
        stain: Mapping[str, Any] | None = None,
        resume: ResumeState | None = None,
    ) -> RunCheckpoint:
        """The checkpoint of ``method`` (one of ``config``'s methods) after ``epoch`` epochs.

        ``models``: state dicts by module name (``encoder`` None when the checkpoint does not
        hold it). ``endpoint``: what the model predicts (default: the method's task and loss with
        the aggregator's output size, :func:`~wsi_pipeline.methods.endpoints.endpoint_outputs`).
        ``stain``: the fitted normalisation's state; ``resume``: ``last.pt``'s extra state.
        """
        if endpoint is None:
            endpoint = Endpoint(task=method.task_key, loss=str(method.loss),
                                n_outputs=endpoint_outputs(method, config.data.n_classes))
        return cls(
            config=config_to_dict(config), method=config_to_dict(method), seed=int(seed), epoch=int(epoch),
            models={k: (None if v is None else dict(v)) for k, v in models.items()}, endpoint=endpoint.to_state(),
            encoder_info=None if encoder_info is None else dict(encoder_info), best=None if best is None else dict(best),
            tiling=None if tiling is None else dict(tiling),
            stain_reference=None if stain_reference is None else dict(stain_reference),
            stain_normalise=str(config.data.stain.normalise), stain=None if stain is None else dict(stain),
            patchgd=method.patchgd_config.to_state() if strategy_traits(method.strategy).grid_head else None, resume=resume,
        )

    def to_state(self) -> dict[str, Any]:
        """Plain containers and tensors (what the file holds; the file layer adds ``format`` and ``integrity``).

        Optional entries that are None are left out, as files have always had them.
        """
        state: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "resume":
                state.update(value.to_state() if value is not None else {})
            elif value is not None or f.default is not None:
                state[f.name] = value
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], where: str = "checkpoint") -> RunCheckpoint:
        """Read a checkpoint's state in any layout this package wrote (migrated to today's first);
        ``ValueError``/``TypeError`` naming ``where`` and the key when it is not a run checkpoint."""
        if not isinstance(state, Mapping):
            raise ValueError(f"{where}: a run checkpoint is a mapping of entries; got {type(state).__name__}")
        missing = [k for k in ("config", "method", "epoch", "models") if k not in state]
        if missing:
            raise ValueError(f"{where} is not a run checkpoint: it has no {', '.join(map(repr, missing))} "
                             f"(its keys: {sorted(map(str, state))})")
        raw = {k: v for k, v in migrate(state, where).items() if k not in _FILE_KEYS}
        resume = {k: raw.pop(k) for k in _RESUME_KEYS if k in raw}
        if resume:
            raw["resume"] = build(ResumeState, resume, where)
        return build(cls, raw, where)

    # ---- what readers need ---------------------------------------------------------------

    def pipeline_config(self) -> PipelineConfig:
        """The saved run config, built with today's builder (configs saved by earlier versions upgraded)."""
        return config_from_dict(upgrade_saved_config(self.config))

    def method_config(self, config: PipelineConfig, where: str = "checkpoint") -> MethodConfig:
        """This run's method in ``config`` (:meth:`pipeline_config`); ``ValueError`` when it is missing."""
        name = self.method.get("name")
        found = next((m for m in config.methods if m.name == name), None)
        if found is None:
            raise ValueError(f"{where}: method {name!r} is missing from the saved config")
        return found

    def build_method(self, method: MethodConfig, where: str = "checkpoint") -> MethodConfig:
        """``method`` as its models were built in training: a ``patchgd`` method with the options stored
        in the checkpoint (what the saved config resolves to today may differ, e.g. a preset's defaults)."""
        if self.patchgd is None:
            return method
        stored = PatchGDConfig.from_state(self.patchgd, f"{where}: patchgd")
        return dataclasses.replace(method, patchgd=stored.to_mapping())

    def endpoint_spec(self) -> Endpoint:
        """What the model predicts (:class:`~wsi_pipeline.tasks.base.Endpoint`)."""
        return Endpoint.from_state(self.endpoint)
