"""`make demo`: the whole pipeline on a synthetic cohort the package generates itself.

Stages (each reused when already finished, so a second run is quick):

1. **cohort**: internal slides (train/val/test) and an external cohort with another stain tint
   and more scanner noise, with their lesion masks and one manifest
   (``<runs>/<name>/cohort/manifest.csv``; written last, so its presence marks the stage done);
2. **tile**: the tiling stage on that manifest (complete stores are skipped);
3. **train**: every method and seed of the pipeline (finished runs are skipped);
4. **eval**: metrics, predictions, heatmaps and ``report.html`` (skipped when ``metrics.json``
   is newer than every run's ``done`` marker).

Seed study (``wsi-pipeline demo --seeds 0,1,2,3,4``, ``make demo-study``): the same cohort and
tiles, every method trained once per seed (runs of seeds already trained, e.g. the demo's seed 0,
are reused), evaluated into ``<results_dir>/seed-study/<name>/``; the table of mean +- sd
(sample standard deviation over seeds) and minimum per method of internal AUC, internal
localisation and external AUC (all tiles) is printed and written to ``seed_study.md`` there
(:func:`seed_study_table`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.synthetic.cohort import DemoCohort  # defined beside the generator (bench.stain builds it too)
from wsi_pipeline.synthetic.mosaic import LungMosaicCohort

__all__ = [
    "REPOSITORY_PIPELINES",
    "SurvivalCohort",
    "c_index_table",
    "default_config",
    "format_seed_study",
    "mosaic_config",
    "parse_seeds",
    "results_table",
    "run_demo",
    "seed_study_table",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SurvivalCohort(DemoCohort):
    """The survival demo's synthetic cohort (``wsi-pipeline demo --task survival``, ``make demo-survival``).

    The classification demo's slides (benign mimics, stain and density jitter, lesion contrast 0.7),
    with 1 to 4 lesions on half of the slides and none on the others, so the lesion burden varies;
    each slide gets a survival time whose hazard rises with its lesion fraction
    (:func:`~wsi_pipeline.synthetic.survival.survival_targets`: Weibull shape ``shape``, log hazard
    ratio ``beta`` at the internal cohort's mean lesion fraction) and independent censoring of a
    ``censoring`` share of the slides (25 %). The external cohort (another stain tint, more scanner
    noise) shares the internal cohort's hazard model.
    """

    n_internal: int = 48
    beta: float = 2.0
    shape: float = 3.0
    censoring: float = 0.25


@dataclass
class _Timer:
    times: dict[str, float] = field(default_factory=dict)

    def stage(self, name: str, seconds: float) -> None:
        self.times[name] = seconds
        print(f"[demo] {name}: {seconds:.1f} s", flush=True)


def make_cohort(folder: Path, cohort: DemoCohort | SurvivalCohort | LungMosaicCohort, *, progress: bool = True) -> Path:
    """Generate the internal and external cohorts under ``folder``; return the merged manifest
    (with ``time`` and ``event`` for a :class:`SurvivalCohort`); or the mosaic cohort of real tiles
    of a :class:`~wsi_pipeline.synthetic.mosaic.LungMosaicCohort`."""
    from wsi_pipeline.manifests.merge import merge_manifests
    from wsi_pipeline.manifests.schema import write_manifest
    from wsi_pipeline.synthetic.cohort import make_slide_cohort

    manifest = folder / "manifest.csv"
    spec_path = folder / "demo_cohort.json"
    spec = json.loads(json.dumps(asdict(cohort)))  # as the JSON file holds it (tuples become lists)
    if manifest.is_file():
        found = json.loads(spec_path.read_text()) if spec_path.is_file() else None
        if found != spec:
            differ = ("settings unrecorded" if not isinstance(found, dict) else
                      "; ".join(f"{k}: {found.get(k, '<absent>')!r} there, {v!r} now" for k, v in spec.items() if found.get(k) != v))
            raise ValueError(
                f"{folder} holds a demo cohort made with other settings ({differ}; e.g. by an earlier version "
                f"of wsi-pipeline); its runs and results belong to it: delete {folder.parent} and the pipeline's "
                f"results folder (rm -rf {folder.parent} results/demo) to start over"
            )
        return manifest
    if isinstance(cohort, LungMosaicCohort):
        from wsi_pipeline.synthetic.mosaic import make_mosaic_cohort

        folder.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec, indent=1))
        return make_mosaic_cohort(folder, cohort, progress=progress)  # its manifest is written last
    survival = isinstance(cohort, SurvivalCohort)
    common = dict(size=cohort.size, seed=cohort.seed, lesion_contrast=cohort.lesion_contrast,
                  lesion_size=cohort.lesion_size, lesions=(1, 4) if survival else (2, 3), mimic_fraction=cohort.mimic_fraction,
                  stain_jitter=cohort.stain_jitter, density_jitter=cohort.density_jitter)
    internal = make_slide_cohort(folder, cohort.n_internal, cohort="internal", **common)
    external = make_slide_cohort(folder, cohort.n_external, cohort="external", splits=None, **common)
    merged = merge_manifests([internal], [external])
    if survival:
        _add_survival(merged, cohort)
    # paths relative to the manifest, so the cohort folder can move
    for col in ("path", "lesion_mask"):
        merged[col] = [os.path.relpath(p, folder) for p in merged[col]]
    spec_path.write_text(json.dumps(spec, indent=1))
    return write_manifest(merged, manifest)  # last: marks the stage done


def _add_survival(manifest: pd.DataFrame, cohort: SurvivalCohort) -> None:
    """Add ``time`` and ``event`` to the demo manifest in place: one hazard model, each cohort censored at the stated rate."""
    import numpy as np

    from wsi_pipeline.synthetic.survival import survival_targets

    frac = manifest["lesion_fraction"].to_numpy(float)
    internal = (manifest["cohort"] == "internal").to_numpy()
    reference = float(frac[internal & (frac > 0)].mean())
    time = np.zeros(len(manifest))
    event = np.zeros(len(manifest), dtype=np.int64)
    for k, part in enumerate((internal, ~internal)):
        t, e, _ = survival_targets(frac[part], seed=cohort.seed * 2 + k, beta=cohort.beta, shape=cohort.shape,
                                   censoring=cohort.censoring, reference=reference)
        time[part], event[part] = t, e
    manifest["time"] = time
    manifest["event"] = event


def c_index_table(records: Iterable[Any], methods: Sequence[str], seeds: Sequence[int]) -> str:
    """Markdown table of Harrell's C-index (all tiles) per seed and method on the internal test split and the
    external cohort, and their mean over seeds."""
    rows = [r if isinstance(r, dict) else asdict(r) for r in records]
    look = {(r["method"], r["seed"], r["split"]): r["value"] for r in rows
            if r["metric"] == "c_index" and r["protocol"] == "all" and r.get("repeat") is None}
    lines = ["| seed | " + " | ".join(f"`{m}` internal | `{m}` external" for m in methods) + " |",
             "|---" * (1 + 2 * len(methods)) + "|"]

    def cell(v: Any) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.3f}"

    for seed in seeds:
        lines.append(f"| {seed} | " + " | ".join(f"{cell(look.get((m, seed, 'test')))} | {cell(look.get((m, seed, 'external')))}"
                                                 for m in methods) + " |")
    lines.append("| mean | " + " | ".join(f"{cell(look.get((m, 'mean', 'test')))} | {cell(look.get((m, 'mean', 'external')))}"
                                          for m in methods) + " |")
    return "Harrell's C-index, all tiles (internal test split and external cohort):\n\n" + "\n".join(lines) + "\n"


def _eval_is_current(results: Path, run_dirs: list[Path]) -> bool:
    metrics = results / "metrics.json"
    if not metrics.is_file() or not (results / "report.html").is_file():
        return False
    done = [d / "done" for d in run_dirs]
    return all(p.is_file() for p in done) and metrics.stat().st_mtime > max(p.stat().st_mtime for p in done)


def results_table(metrics_json: Path) -> pd.DataFrame:
    """Method x (cohort, protocol) table of AUC and accuracy (and localisation AUC) from ``metrics.json``:
    mean ± std over seeds; ``auc_repeat_std``: std over repeats of the per-repeat protocols."""
    from wsi_pipeline.export.metrics_json import read_metrics_json, summary_table

    return summary_table(read_metrics_json(metrics_json), ("auc", "accuracy", "auc_repeat_std", "localisation_auc"))


#: The seed study's columns: (heading, evaluation split, metric), all tiles. The internal test
#: split is ``test``; the external cohort's is ``external`` (see :mod:`wsi_pipeline.evaluation.sets`).
STUDY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("internal AUC", "test", "auc"),
    ("localisation", "test", "localisation_auc"),
    ("external AUC", "external", "auc"),
)


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2,3,4"`` -> ``(0, 1, 2, 3, 4)``; ``a-b`` ranges are accepted (``"0-4"``).

    Raises ``ValueError`` naming ``--seeds`` for anything but distinct integers >= 0.
    """
    seeds: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                lo, hi = (int(v) for v in part.split("-", 1))
                if hi < lo:
                    raise ValueError(part)
                seeds.extend(range(lo, hi + 1))
            else:
                seeds.append(int(part))
        except ValueError:
            raise ValueError(f"--seeds {text!r}: {part!r} is not an integer or a range a-b; expected e.g. 0,1,2,3,4") from None
    if any(v < 0 for v in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: expected distinct integers >= 0, got {seeds}")
    return tuple(seeds)


def seed_study_table(records: Iterable[Any], methods: Sequence[str] | None = None) -> pd.DataFrame:
    """Per method, mean, sample sd (ddof 1; NaN for one seed), min and seed count of each study column.

    Parameters
    ----------
    records : ``metrics.json`` records (:class:`~wsi_pipeline.export.metrics_json.MetricRecord` or
        dicts with method, seed, cohort, split, protocol, metric, value); only per-seed (integer
        seed) records of protocol ``all`` are used, so the runner's own mean/std rows are ignored.
    methods : row order (default: order of first appearance).

    Returns
    -------
    DataFrame indexed by method, columns ``(heading, stat)`` with stat in mean, sd, min, n.
    """
    rows = [r if isinstance(r, dict) else asdict(r) for r in records]
    df = pd.DataFrame(rows, columns=["method", "seed", "cohort", "split", "protocol", "metric", "value"])
    df = df[df["seed"].map(lambda v: isinstance(v, int) and not isinstance(v, bool)) & (df["protocol"] == "all")]
    order = list(methods) if methods is not None else list(dict.fromkeys(df["method"]))
    out: dict[tuple[str, str], list[float]] = {}
    for heading, split, metric in STUDY_COLUMNS:
        sel = df[(df["split"] == split) & (df["metric"] == metric)]
        for stat in ("mean", "sd", "min", "n"):
            out[(heading, stat)] = []
        for m in order:
            # one value per seed (one cohort holds the split); NaN values (undefined metrics) are dropped
            v = pd.to_numeric(sel.loc[sel["method"] == m, "value"], errors="coerce").dropna().to_numpy(float)
            out[(heading, "mean")].append(float(v.mean()) if len(v) else math.nan)
            out[(heading, "sd")].append(float(v.std(ddof=1)) if len(v) > 1 else math.nan)
            out[(heading, "min")].append(float(v.min()) if len(v) else math.nan)
            out[(heading, "n")].append(float(len(v)))
    table = pd.DataFrame(out, index=pd.Index(order, name="method"))
    table.columns = pd.MultiIndex.from_tuples(table.columns)
    return table


def format_seed_study(table: pd.DataFrame, seeds: Sequence[int]) -> str:
    """Markdown table of :func:`seed_study_table`: ``mean +- sd (min m)`` per cell, 2 decimals."""

    def cell(row: pd.Series, heading: str) -> str:
        mean, sd, lo = row[(heading, "mean")], row[(heading, "sd")], row[(heading, "min")]
        if math.isnan(mean):
            return "-"
        spread = f" +- {sd:.2f}" if not math.isnan(sd) else ""
        return f"{mean:.2f}{spread} (min {lo:.2f})"

    headings = [h for h, _, _ in STUDY_COLUMNS]
    lines = [f"Seed study: seeds {', '.join(str(s) for s in seeds)}; mean +- sd (min) over seeds, all tiles.", "",
             "| method | " + " | ".join(headings) + " |", "|---" * (len(headings) + 1) + "|"]
    for method, row in table.iterrows():
        lines.append(f"| `{method}` | " + " | ".join(cell(row, h) for h in headings) + " |")
    return "\n".join(lines) + "\n"




def _write_summary(results: Path, methods: list[str], seed: int) -> None:
    """Write ``summary.md`` (the README's table for this run); ``make demo`` then says whether README.md agrees
    (``python -m tools.readme_table --check``, in the repository: the README is not part of the package)."""
    from wsi_pipeline.export.demo_table import demo_summary
    from wsi_pipeline.export.metrics_json import read_metrics_json
    from wsi_pipeline.io_atomic import write_text_atomic

    summary = demo_summary(read_metrics_json(results / "metrics.json"), methods, seed)
    path = write_text_atomic(results / "summary.md", summary)
    print(f"\n{summary}(written to {path})")


#: The repository's pipeline configs, beside the package (a source checkout, or an editable install of one).
REPOSITORY_PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


def default_config(name: str) -> Path:
    """The demo's default pipeline config ``pipelines/<name>``: the working folder's when it holds one (the
    repository), else the repository's beside the package (:data:`REPOSITORY_PIPELINES`, as an absolute path).

    ``FileNotFoundError`` naming both places and ``--config`` when neither holds it (a package installed
    without its repository).
    """
    local = Path("pipelines") / name
    if local.is_file():
        return local
    beside = REPOSITORY_PIPELINES / name
    if beside.is_file():
        return beside
    raise FileNotFoundError(
        f"demo: no pipeline config pipelines/{name} in the working folder {Path.cwd()} nor beside the package "
        f"({beside}); run the demo from the wsi-pipeline repository, or pass --config FILE (a copy of the "
        f"repository's pipelines/{name})")


def mosaic_config(template: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``<out>/<template name>``: the pipeline YAML ``template`` with its cohort, tiles, features, runs and
    results under ``out`` (``<out>/cohort/manifest.csv``, ``<out>/tiles``, ...); return its path."""
    import yaml

    from wsi_pipeline.io_atomic import write_text_atomic

    src = Path(template)
    raw = yaml.safe_load(src.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise ValueError(f"{src}: expected a pipeline YAML with a data section")
    base = Path(out)
    raw["data"].update(manifest=str(base / "cohort" / "manifest.csv"), tiles_dir=str(base / "tiles"),
                       features_dir=str(base / "features"))
    raw["runs_dir"], raw["results_dir"] = str(base / "runs"), str(base / "results")
    head = f"# Written by `wsi-pipeline demo --cohort lung-mosaic` from {src}: paths under {base}.\n"
    return write_text_atomic(base / src.name, head + yaml.safe_dump(raw, sort_keys=False))


def run_demo(config_path: str | os.PathLike = "pipelines/demo.yaml", *,
             cohort: DemoCohort | SurvivalCohort | LungMosaicCohort = DemoCohort(),
             workers: int | None = None, device: str | None = None, overrides: tuple[str, ...] = (),
             progress: bool = True, seeds: Sequence[int] | None = None, make_only: bool = False) -> int:
    """Run the four stages of the demo; print the results table, the time per stage and the outputs.

    ``seeds`` (the seed study): train every method for each of these seeds instead of the
    config's, evaluate into ``<results_dir>/seed-study/<name>/`` and print and write the
    :func:`format_seed_study` table (``seed_study.md``). ``make_only``: stop once the cohort is
    written. Returns the exit status (0 when every stage succeeded).
    """
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.config.tiling import tiler_config
    from wsi_pipeline.training.loop import train_pipeline

    config = load_config(config_path, list(overrides))
    if seeds is not None:
        config = dataclasses.replace(config, seeds=tuple(seeds), results_dir=str(Path(config.results_dir) / "seed-study"))
    timer = _Timer()
    manifest = Path(config.data.manifest)
    t0 = time.perf_counter()
    make_cohort(manifest.parent, cohort, progress=progress)
    timer.stage("cohort", time.perf_counter() - t0)
    if make_only:
        print(f"cohort:      {manifest}\nconfig:      {config_path}")
        return 0

    t0 = time.perf_counter()
    report = tile_cohort(manifest, config.data.tiles_dir, tiler_config(config.data.tiling), workers=workers, progress=progress)
    timer.stage("tile", time.perf_counter() - t0)
    if not report.ok:
        print(f"[demo] tiling failed for some slides: {report.summary()}")
        return 1

    t0 = time.perf_counter()
    run_dirs = train_pipeline(config, device=device, progress=progress)
    timer.stage("train", time.perf_counter() - t0)

    t0 = time.perf_counter()
    results = Path(config.results_dir) / config.name
    if _eval_is_current(results, run_dirs):
        print(f"[demo] eval: reusing {results} (newer than every run)")
    else:
        evaluate_pipeline(config, device=device or "auto", progress=progress)
    timer.stage("eval", time.perf_counter() - t0)

    survival = isinstance(cohort, SurvivalCohort)  # its demo reads Harrell's C; the class cohorts' the AUC tables
    if survival:
        from wsi_pipeline.export.metrics_json import read_metrics_json
        from wsi_pipeline.io_atomic import write_text_atomic

        table = c_index_table(read_metrics_json(results / "metrics.json"), [m.name for m in config.methods], config.seeds)
        print("\n" + table + f"(written to {write_text_atomic(results / 'c_index.md', table)})")
    else:
        with pd.option_context("display.width", 200, "display.max_columns", 50):
            print("\n" + results_table(results / "metrics.json").to_string())
    if seeds is None and not survival and not isinstance(cohort, LungMosaicCohort):
        _write_summary(results, [m.name for m in config.methods], config.seeds[0])
    if seeds is not None and not survival:
        from wsi_pipeline.export.metrics_json import read_metrics_json
        from wsi_pipeline.io_atomic import write_text_atomic

        study = format_seed_study(seed_study_table(read_metrics_json(results / "metrics.json"),
                                                   [m.name for m in config.methods]), config.seeds)
        print("\n" + study + f"(written to {write_text_atomic(results / 'seed_study.md', study)})")
    total = sum(timer.times.values())
    print("\ntime per stage: " + ", ".join(f"{k} {v:.0f} s" for k, v in timer.times.items()) + f" (total {total:.0f} s)")
    print(f"runs:        {Path(config.runs_dir) / config.name}")
    print(f"results:     {results}")
    print(f"report:      {results / 'report.html'}")
    print(f"heatmaps:    {results / 'heatmaps'}")
    from wsi_pipeline.viewer import view_command

    print(f"look at the slides, attention, tiles and QC in the browser:\n  "
          f"{view_command(manifest=manifest, predictions=results, tiles=config.data.tiles_dir)}")
    return 0
