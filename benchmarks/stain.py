"""`make bench-stain`: stain normalisation and augmentation against two stain shifts, and their cost per tile.

The demo's cohort (:class:`wsi_pipeline.synthetic.cohort.DemoCohort`: 40 internal slides, train/val/test
20/10/10, and 16 ``external`` slides with another tint and more scanner noise) plus two cohorts of
16 slides painted like the internal ones, re-stained in optical-density space as between two
scanners/labs and given the external scanner noise: ``external_shift``
(:data:`wsi_pipeline.synthetic.texture.SCANNER_SHIFT`: Ruifrok & Johnston's H&E vectors to
Macenko's reference vectors, H turned by 8 degrees and E by 30, both stains 25 % denser) and
``external_pale`` (the same vectors, both stains at 60 %: an under-stained or faded section).
Tiled once with the demo's settings.

Then, for each arm (``none``, ``macenko``, ``reinhard``: ``data.stain.normalise``; ``hed``: HED
jitter on every bag, ``train.augment`` with ``hed_p: 1``, ``hed_scale: 0.2``, ``hed_shift: 0.1`` and
nothing else), the demo pipeline's
``abmil_frozen`` and ``abmil_e2e`` are trained for every seed (the demo's settings otherwise) and
evaluated on all tiles (``eval.protocols: [all]``, no bootstrap); the table gives AUC per cohort,
mean +- sd over seeds, and is written to ``<out>/stain_table.md``. Finished runs are reused.

``--timing`` only measures the per-tile cost: :func:`~wsi_pipeline.data.tensors.tiles_to_tensor`
with and without each normaliser, HED jitter, and a ResNet-18 forward for scale, on 32 px and
256 px tiles (CPU, ``--threads``), plus one slide's stain estimate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

ARMS: dict[str, dict[str, Any]] = {
    "none": {},
    "macenko": {"data": {"stain": {"normalise": "macenko"}}},
    "reinhard": {"data": {"stain": {"normalise": "reinhard"}}},
    "hed": {"train": {"augment": {"enabled": True, "hed_p": 1.0, "hed_scale": 0.2, "hed_shift": 0.1, "blur_p": 0.0,
                                  "jitter_p": 0.0, "flips": False, "rotation": False}}},
}
METHODS = ("abmil_frozen", "abmil_e2e")
COHORTS = ("internal", "external", "external_shift", "external_pale")


def _shifts() -> dict[str, Any]:
    """The external cohorts' stain changes in optical-density space (None: the demo's tint only)."""
    from wsi_pipeline.synthetic.texture import SCANNER_SHIFT, stain_shift_matrix

    pale = stain_shift_matrix(((0.65, 0.70, 0.29), (0.07, 0.99, 0.11)), ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581)),
                              (0.6, 0.6))
    return {"external": None, "external_shift": SCANNER_SHIFT, "external_pale": pale}


def make_cohort(folder: Path) -> Path:
    """The demo cohort plus the re-stained external cohorts under ``folder``; the merged manifest.

    Each cohort is generated once (its ``<cohort>.csv`` marks it done); the manifest is re-merged
    from them, so a cohort added later joins the finished ones.
    """
    from wsi_pipeline.manifests.merge import merge_manifests
    from wsi_pipeline.manifests.schema import write_manifest
    from wsi_pipeline.synthetic.cohort import EXTERNAL_NOISE, DemoCohort, make_slide_cohort

    c = DemoCohort()
    common = dict(size=c.size, seed=c.seed, lesion_contrast=c.lesion_contrast, lesion_size=c.lesion_size, lesions=(2, 3),
                  mimic_fraction=c.mimic_fraction, stain_jitter=c.stain_jitter, density_jitter=c.density_jitter)
    internal = folder / "internal.csv"
    if not internal.is_file():
        make_slide_cohort(folder, c.n_internal, cohort="internal", **common)
    external = []
    for name, od in _shifts().items():
        path = folder / f"{name}.csv"
        if not path.is_file():
            extra = {} if od is None else {"noise": EXTERNAL_NOISE, "od_matrix": od}
            make_slide_cohort(folder, c.n_external, cohort=name, splits=None, **extra, **common)
        external.append(path)
    merged = merge_manifests([internal], external)
    for col in ("path", "lesion_mask"):
        merged[col] = [os.path.relpath(p, folder) for p in merged[col]]
    return write_manifest(merged, folder / "manifest.csv")


def arm_config(arm: str, out: Path, seeds: list[int], epochs: int | None) -> Any:
    """The demo pipeline for one arm: its own name, runs, features and results under ``out``."""
    from wsi_pipeline.config.io import read_yaml
    from wsi_pipeline.config.overrides import deep_merge
    from wsi_pipeline.config.pipeline import config_from_dict

    raw = read_yaml(Path("pipelines/demo.yaml"))
    raw = deep_merge(raw, ARMS[arm])
    raw["name"] = f"stain_{arm}"
    raw["data"].update(manifest=str(out / "cohort" / "manifest.csv"), tiles_dir=str(out / "tiles"),
                       features_dir=str(out / "features" / arm))
    raw.update(runs_dir=str(out / "runs"), results_dir=str(out / "results"), seeds=seeds)
    raw["eval"].update(protocols=["all"], bootstrap=0)
    raw["methods"] = [m for m in raw["methods"] if m["name"] in METHODS]
    if epochs is not None:
        raw["train"]["epochs"] = epochs
    return config_from_dict(raw)


def run_study(out: Path, seeds: list[int], arms: list[str], epochs: int | None, progress: bool) -> str:
    """Cohort, tiles, every arm trained and evaluated; returns (and writes) the markdown table."""
    from wsi_pipeline.config.tiling import tiler_config
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.export.metrics_json import read_metrics_json
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.training.loop import train_pipeline

    t0 = time.perf_counter()
    manifest = make_cohort(out / "cohort")
    cfg0 = arm_config("none", out, seeds, epochs)
    tile_cohort(manifest, cfg0.data.tiles_dir, tiler_config(cfg0.data.tiling), progress=progress)
    print(f"[bench-stain] cohort and tiles: {time.perf_counter() - t0:.0f} s", flush=True)
    values: dict[tuple[str, str, str], list[float]] = {}
    for arm in arms:
        cfg = arm_config(arm, out, seeds, epochs)
        t1 = time.perf_counter()
        train_pipeline(cfg, device="cpu", progress=progress)
        t2 = time.perf_counter()
        res = out / "results" / cfg.name
        if not _has_cohorts(res / "metrics.json"):
            evaluate_pipeline(cfg, device="cpu", heatmaps=False, n_boot=0, progress=progress)
        print(f"[bench-stain] {arm}: train {t2 - t1:.0f} s, eval {time.perf_counter() - t2:.0f} s", flush=True)
        for r in read_metrics_json(res / "metrics.json"):
            if r.metric == "auc" and r.protocol == "all" and r.repeat is None and isinstance(r.seed, int) and r.seed in seeds:
                values.setdefault((r.method, arm, r.cohort), []).append(r.value)
    table = format_table(values, arms, seeds)
    (out / "stain_table.md").write_text(table)
    (out / "stain_values.json").write_text(json.dumps({"|".join(k): v for k, v in sorted(values.items())}, indent=1))
    return table


def _has_cohorts(metrics: Path) -> bool:
    """Whether an arm's ``metrics.json`` scores every cohort of :data:`COHORTS`."""
    from wsi_pipeline.export.metrics_json import read_metrics_json

    return metrics.is_file() and set(COHORTS) <= {r.cohort for r in read_metrics_json(metrics)}


def format_table(values: dict[tuple[str, str, str], list[float]], arms: list[str], seeds: list[int]) -> str:
    """Method x arm rows, one column per cohort: AUC mean +- sd over seeds (2 decimals)."""

    def cell(v: list[float]) -> str:
        if not v:
            return "-"
        sd = f" +- {np.std(v, ddof=1):.2f}" if len(v) > 1 else ""
        return f"{np.mean(v):.2f}{sd}"

    lines = [f"AUC on all tiles, mean +- sd over seeds {', '.join(map(str, seeds))}.", "",
             "| method | stain | internal test | external (tint, noise) | external_shift (stain matrix, x1.25) |"
             " external_pale (stain matrix, x0.6) |",
             "|---|---|---|---|---|---|"]
    for m in METHODS:
        for arm in arms:
            lines.append(f"| `{m}` | {arm} | " + " | ".join(cell(values.get((m, arm, c), [])) for c in COHORTS) + " |")
    return "\n".join(lines) + "\n"


def timing(repeats: int = 5) -> str:
    """Per-tile cost of the tile -> tensor conversion with each normaliser and with HED jitter (CPU)."""
    import torch

    from wsi_pipeline.data.stain import StainNormaliser, estimate_stain, hed_jitter
    from wsi_pipeline.data.stain_slides import SlideStain
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.synthetic.texture import paint_tissue

    lines = [f"tile -> tensor, CPU, {torch.get_num_threads()} threads, median of {repeats} runs, microseconds per tile:", "",
             "| tile | batch | plain | macenko | reinhard | HED jitter | ResNet-18 forward | stain estimate (32 tiles) |",
             "|---|---|---|---|---|---|---|---|"]
    from wsi_pipeline.models import build_encoder

    encoder = build_encoder("resnet18").eval()
    for T, batch in ((32, 96), (256, 32)):
        side = int(math.ceil(math.sqrt(batch))) * T
        img = paint_tissue(np.random.default_rng(0), side, side)
        tiles = img[: side - side % T, : side - side % T].reshape(side // T, T, side // T, T, 3).swapaxes(1, 2).reshape(-1, T, T, 3)[:batch]
        tiles = np.ascontiguousarray(tiles)
        est = estimate_stain(tiles)
        t = time.perf_counter()
        estimate_stain(tiles[:32])
        est_ms = (time.perf_counter() - t) * 1e3

        def per_tile(fn: Any, batch: int = batch) -> float:
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return float(np.median(times[1:])) / batch * 1e6

        row = [per_tile(lambda tiles=tiles: tiles_to_tensor(tiles))]
        for m in ("macenko", "reinhard"):
            st = SlideStain(StainNormaliser(m, est), est)
            row.append(per_tile(lambda st=st, tiles=tiles: tiles_to_tensor(tiles, stain=st)))
        x = tiles_to_tensor(tiles)
        row.append(per_tile(lambda x=x: hed_jitter(x.clamp(0, 1), (1.05, 0.95, 1.0), (0.02, -0.02, 0.0))))
        with torch.no_grad():
            row.append(per_tile(lambda x=x: encoder(x)))
        lines.append(f"| {T} px | {batch} | " + " | ".join(f"{v:.0f}" for v in row) + f" | {est_ms:.0f} ms |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_stain", help="folder of the cohort, tiles, runs and results (default %(default)s)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated (default %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms to run, comma-separated, of {list(ARMS)} (default all)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: the demo pipeline's)")
    p.add_argument("--timing", action="store_true", help="only measure the per-tile cost")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s: a shared machine)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.timing:
        print(timing())
        return 0
    arms = [s.strip() for s in a.arms.split(",") if s.strip()]
    bad = [s for s in arms if s not in ARMS]
    if bad:
        p.error(f"--arms: unknown {bad}; choose from {list(ARMS)}")
    print(run_study(Path(a.out), [int(s) for s in a.seeds.split(",")], arms, a.epochs, not a.no_progress))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
