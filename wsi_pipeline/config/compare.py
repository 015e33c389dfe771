"""The one comparison of a saved run config with the current one, key by key.

``train`` resuming a run (:func:`wsi_pipeline.training.rundir.check_resumable`), ``train`` meeting a
finished run whose config changed, and ``eval`` reading a run's ``best.pt``
(:func:`wsi_pipeline.inference.trained.load_trained_model` with ``expected``) all compare plain config
dicts (:func:`~wsi_pipeline.config.pipeline.config_to_dict`) with :func:`config_differences`; they
differ only in which keys they look at: resuming all but :data:`RESUME_FREE`, evaluation the
:data:`MODEL_SETTINGS` (what the model reads and predicts), so changed evaluation settings stay free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MODEL_SETTINGS", "RESUME_FREE", "config_differences", "flatten_config", "is_model_setting"]

#: Settings a resumed run may change (the last part of a key): where it runs and where runs and results are kept,
#: and the evaluation stage's own settings (eval.methods, batch_size, heatmaps, heatmap_method, heatmap_mode, results).
RESUME_FREE: tuple[str, ...] = ("device", "runs_dir", "results_dir", "methods", "batch_size", "heatmaps", "heatmap_method",
                                "heatmap_mode", "results")

#: The settings of a one-method run config that make a checkpoint what it is: the task and its outputs, the tiling
#: and stain handling of the tiles it reads, the models' kinds. A key is one of them, or below one.
MODEL_SETTINGS: tuple[str, ...] = (
    "data.n_classes", "data.tiling", "data.bags", "data.stain", "methods.0.task", "methods.0.targets", "methods.0.loss",
    "methods.0.loss_options", "methods.0.strategy", "methods.0.encoder.name", "methods.0.aggregator",
)


def flatten_config(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}`` of a nested config dict; a list of mappings (``methods``) is indexed ``methods.0.name``."""
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten_config(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, Mapping) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten_config(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: obj}


def is_model_setting(key: str) -> bool:
    """Whether flattened ``key`` is one of :data:`MODEL_SETTINGS` or lies below one."""
    return any(key == p or key.startswith(p + ".") for p in MODEL_SETTINGS)


def config_differences(saved: Mapping[str, Any], now: Mapping[str, Any], *, keys: Callable[[str], bool] | None = None,
                       names: Sequence[str] = ("saved", "now")) -> list[str]:
    """``"key: <saved> (saved) vs <now> (now)"`` for every flattened key whose values differ, leaving out the keys
    whose last part is in :data:`RESUME_FREE` and, when ``keys`` is given, those it rejects; ``names`` labels the two."""
    a, b = flatten_config(saved), flatten_config(now)
    return [
        f"{k}: {a.get(k, '<absent>')!r} ({names[0]}) vs {b.get(k, '<absent>')!r} ({names[1]})"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and k.rsplit(".", 1)[-1] not in RESUME_FREE and (keys is None or keys(k))
    ]
