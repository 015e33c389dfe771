"""``make bench-real``: the colon benchmark of Ilse et al. 2018 on its real images, through the CLI.

Data: ``crc-histophenotypes`` (100 H&E images of 500 x 500 px, ``images.csv`` with
``has_epithelial`` and ``nuclei.csv`` with the annotated nucleus centres; README in
``../shared/realdata``). One bag per image, label = the image holds epithelial nuclei. Two
instance constructions:

* ``points`` (the paper's): 27 x 27 px patches centred on every annotated nucleus,
  ``pipelines/ilse_colon.yaml``, tiles by ``tile --points``;
* ``grid`` (what a user would do): 32 px grid tiles from the tissue, no annotations,
  ``pipelines/ilse_colon_grid.yaml`` with only its four dataset keys changed, tiles by
  ``tile --config``: the same commands the held-out check runs.

Each construction runs as shell commands in ``--work`` (subprocesses, ``nice``): ``manifest folder
--crossval K [--repeats R] --seed S``, ``tile``, ``train --folds``, ``eval --folds``; their wall and
CPU times (user + system of the child processes) are recorded. From ``results/<name>_cv/`` the
bench reads, per method, ``eval --folds``'s ``cv_table.csv`` (the paper's layout: mean +- standard
error over folds of accuracy and AUC, over repeats when R > 1; the pooled out-of-fold AUC with its
bootstrap interval); and computes **attention against the
instance truth**: for every positive test image, each instance's attention score from the
fold's trained model against "this patch holds an epithelial nucleus" (points) or "this tile
contains an annotated epithelial nucleus centre" (grid), as a ROC AUC per image (scikit-learn),
averaged over images.

    python -m benchmarks.real --data ../shared/realdata/crc-histophenotypes --work runs/bench_real   # 10-fold, both
    python -m benchmarks.real ... --folds 5 --repeats 1 --constructions grid --epochs 10

Writes ``<work>/bench_real.json`` and ``<work>/bench_real.md`` (the tables of docs/real-data.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.training.decisions import CALIBRATION_FILE

__all__ = ["PAPER", "pipeline_name", "attention_truth", "fold_table", "instance_truth", "main", "method_table",
           "run_check_commands", "seed_aucs", "summarise"]

log = logging.getLogger(__name__)

#: The paper's colon table (Ilse et al. 2018, mean +- s.e. over 5 x 10-fold CV; ../shared/docs/methods.md): the
#: attention rows are firm, the embedding-level mean and max pooling rows recalled ("about").
PAPER = {"attention": {"accuracy": "0.904 ± 0.011", "auc": "0.968 ± 0.009"},
         "gated_attention": {"accuracy": "0.898 ± 0.020", "auc": "0.968 ± 0.010"},
         "mean": {"accuracy": "about 0.860", "auc": "about 0.940"},
         "max": {"accuracy": "about 0.824", "auc": "about 0.918"}}
#: An independent reproduction on the colon set (PMC10072016, Table 6; 10-fold x 5 repeats).
REPRODUCTION = {"attention": {"accuracy": "0.900", "auc": "0.959 ± 0.008"},
                "gated_attention": {"accuracy": "0.890", "auc": "0.955 ± 0.009"},
                "mean": {"accuracy": "0.832", "auc": "0.902"}, "max": {"accuracy": "0.810", "auc": "0.910"}}
#: Nominal resolution of the colon images (20x), the labels file's ``mpp`` column (um/px).
COLON_MPP = 0.5
CONSTRUCTIONS = {"points": ("pipelines/ilse_colon.yaml", 27), "grid": ("pipelines/ilse_colon_grid.yaml", 32)}
#: The four dataset-specific keys of a pipeline YAML; the bench changes only these.
DATASET_KEYS = ("name", "data.manifest", "data.tiles_dir", "data.features_dir")


def pipeline_name(construction: str) -> str:
    """The pipeline name a construction runs under: its template's own ``name`` (``ilse_colon``, ``ilse_colon_grid``),
    so the tables land in ``<work>/<construction>/results/<name>_cv/`` (``ilse_colon_cv`` for the paper's)."""
    return str(yaml.safe_load(Path(CONSTRUCTIONS[construction][0]).read_text())["name"])


def write_inputs(data_dir: Path, work: Path) -> tuple[Path, Path]:
    """``labels.csv`` (slide_id, label, mpp) and ``points.csv`` (slide_id, x, y, class) from the data set's files."""
    images = pd.read_csv(data_dir / "images.csv")
    labels = pd.DataFrame({"slide_id": images["image"], "label": images["has_epithelial"].astype(int), "mpp": COLON_MPP})
    nuclei = pd.read_csv(data_dir / "nuclei.csv")
    points = pd.DataFrame({"slide_id": nuclei["image"], "x": nuclei["x"], "y": nuclei["y"], "class": nuclei["class"]})
    work.mkdir(parents=True, exist_ok=True)
    lp, pp = work / "labels.csv", work / "points.csv"
    write_text_atomic(lp, labels.to_csv(index=False))
    write_text_atomic(pp, points.to_csv(index=False))
    return lp, pp


def dataset_config(template: Path, out: Path, folder: Path, name: str, overrides: dict[str, Any] | None = None) -> Path:
    """``template`` with only its four dataset keys set (under ``folder``), plus ``overrides`` (dotted keys) if asked."""
    raw = yaml.safe_load(template.read_text())
    raw["name"] = name
    raw["data"]["manifest"] = str(folder / "manifest.csv")
    raw["data"]["tiles_dir"] = str(folder / "tiles")
    raw["data"]["features_dir"] = str(folder / "features")
    for key, value in (overrides or {}).items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    write_text_atomic(out, yaml.safe_dump(raw, sort_keys=False))
    return out


def run_cli(args: list[str], cwd: Path, log_file: Path, processes: int = 1) -> dict[str, float]:
    """Run ``wsi-pipeline ARGS`` in ``cwd`` under ``nice -n 10``, in ``processes`` copies at once (each with
    ``cores / processes`` threads; ``train --folds`` copies share the runs through their run locks, and when a copy
    ends on a run another copy still held, one more pass in one process settles it); return the wall and CPU
    seconds (raises on failure)."""
    cmd = ["nice", "-n", "10", sys.executable, "-m", "wsi_pipeline.cli.main", *args]
    env = os.environ.copy()
    if processes > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_file, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}{f'  ({processes} processes)' if processes > 1 else ''}\n")
        fh.flush()
        procs = [subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env) for _ in range(processes)]
        rcs = [p.wait() for p in procs]
        if processes > 1 and any(rcs):
            # a copy that found its last run held by another copy exits 1 ("not trained here"); once all copies have
            # ended, one more pass finds every run complete (exit 0) or finishes what is left, and its status counts
            fh.write("\n$ (once more in one process: a copy ended while another held a run)\n")
            fh.flush()
            rcs = [subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT).returncode]
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if any(rcs):
        raise RuntimeError(f"`wsi-pipeline {' '.join(args)}` failed with exit status {max(rcs)}; see {log_file}")
    return {"wall_s": wall, "cpu_s": cpu}


def method_table(cv_table: pd.DataFrame) -> pd.DataFrame:
    """Per method, from ``eval --folds``'s ``cv_table.csv``: accuracy and AUC as mean +- standard error
    (over folds with one repeat, over repeats with several: ``se_over``), the pooled out-of-fold AUC
    and its bootstrap 95 % interval."""
    rows = []
    for method, d in cv_table.groupby("method", sort=False):
        by = d.set_index("metric")
        row: dict[str, Any] = {"method": method}
        for m in ("accuracy", "auc"):
            row[m], row[f"{m}_se"] = float(by.loc[m, "mean"]), float(by.loc[m, "se"])
        row["pooled_auc"] = float(by.loc["auc", "pooled"])
        row["pooled_auc_ci"] = (float(by.loc["auc", "ci_low"]), float(by.loc["auc", "ci_high"]))
        row["n_folds"], row["n_repeats"] = int(by.loc["auc", "n_folds"]), int(by.loc["auc", "n_repeats"])
        rows.append(row)
    return pd.DataFrame(rows)


def _crossval(folder: Path, name: str) -> tuple[Any, list[Any]]:
    """The pipeline ``<folder>/<name>.yaml`` the bench wrote and its folds (:func:`~wsi_pipeline.manifests.folds.fold_runs`)."""
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.manifests.folds import fold_runs

    config = load_config(folder / f"{name}.yaml")
    return config, fold_runs(config.data.manifest)


def _test_predictions(folder: Path, config: Any, runs: list[Any]) -> pd.DataFrame:
    """Every fold's test rows (:func:`~wsi_pipeline.evaluation.crossval.fold_test_predictions`: one per slide,
    method and seed, calibrated), with the fold's ``repeat``, ``fold`` and pipeline name (``fold_name``)."""
    from wsi_pipeline.evaluation.crossval import fold_test_predictions
    from wsi_pipeline.manifests.folds import fold_config

    frames = [fold_test_predictions(config, run, folder / config.results_dir)
              .assign(repeat=run.repeat, fold=run.fold, fold_name=fold_config(config, run).name) for run in runs]
    return pd.concat(frames, ignore_index=True)


def uncalibrated_accuracy(folder: Path, name: str) -> pd.DataFrame:
    """Per method: the accuracy of the seed ensemble without calibration, i.e. at 0.5 on the mean over seeds of
    each model's own probability of class 1 (mean +- s.e. over folds and repeats).

    Each seed's own probability comes back from its calibrated one through its run's ``calibration.json``: with
    Platt's map ``a s + b`` the model's log-odds are ``s = (log-odds - b) / a``; a run without the file was not
    calibrated (``a = 1, b = 0``). The predictions files round probabilities to 1e-5, which moves ``s`` by at
    most about ``1e-5 / (p (1 - p) a)``. Empty for a task without ``prob_1`` (not binary)."""
    config, runs = _crossval(folder, name)
    d = _test_predictions(folder, config, runs)
    if "prob_1" not in d.columns:
        return pd.DataFrame(columns=["method", "accuracy_uncalibrated", "accuracy_uncalibrated_se"])
    from wsi_pipeline.manifests.folds import fold_config

    fold_cfgs = {c.name: c for c in (fold_config(config, run) for run in runs)}
    maps: dict[tuple[str, str, int], tuple[float, float]] = {}
    for key in d[["fold_name", "method", "seed"]].drop_duplicates().itertuples(index=False):
        fold_name, method, seed = str(key[0]), str(key[1]), int(key[2])
        cal = folder / fold_cfgs[fold_name].run_dir(method, seed) / CALIBRATION_FILE
        rec = json.loads(cal.read_text()) if cal.is_file() else {}
        maps[(fold_name, method, seed)] = (float(rec.get("scale", 1.0)), float(rec.get("shift", 0.0)))
    p = d["prob_1"].to_numpy(np.float64).clip(1e-12, 1 - 1e-12)
    ab = np.array([maps[(str(f), str(m), int(s))] for f, m, s in zip(d["fold_name"], d["method"], d["seed"])])
    own = 1.0 / (1.0 + np.exp(-((np.log(p) - np.log1p(-p)) - ab[:, 1]) / ab[:, 0]))
    per_slide = d.assign(own=own).groupby(["method", "repeat", "fold", "slide_id"], sort=False).agg(
        own=("own", "mean"), label=("label", "first")).reset_index()
    per_slide["hit"] = (per_slide["own"] >= 0.5) == (per_slide["label"] == 1)
    acc = per_slide.groupby(["method", "repeat", "fold"], sort=False)["hit"].mean().reset_index()
    out = acc.groupby("method", sort=False)["hit"].agg(["mean", "std", "count"]).reset_index()
    out["accuracy_uncalibrated"] = out["mean"]
    out["accuracy_uncalibrated_se"] = out["std"] / np.sqrt(out["count"])
    return out[["method", "accuracy_uncalibrated", "accuracy_uncalibrated_se"]]


def seed_aucs(folder: Path, name: str) -> pd.DataFrame:
    """Per method: the pooled out-of-fold AUC of each training seed alone (``pooled_auc_by_seed``, a list in seed
    order) and their mean (``pooled_auc_seed_mean``), beside the seed average that ``cv_table.csv`` pools.

    Each fold's test rows as ``eval --folds`` pools them (:func:`~wsi_pipeline.evaluation.crossval.fold_test_predictions`
    of the pipeline ``<folder>/<name>.yaml``, calibrated ``prob_1``), pooled over every fold (and repeat: a slide
    then counts once per repeat); scikit-learn's ROC AUC. Empty for a task without ``prob_1`` (not binary)."""
    from sklearn.metrics import roc_auc_score

    config, runs = _crossval(folder, name)
    d = _test_predictions(folder, config, runs)
    if "prob_1" not in d.columns:
        return pd.DataFrame(columns=["method", "pooled_auc_by_seed", "pooled_auc_seed_mean"])
    rows = []
    for method, g in d.groupby("method", sort=False):
        aucs = [float(roc_auc_score(s["label"], s["prob_1"])) for _, s in g.groupby("seed") if s["label"].nunique() == 2]
        rows.append({"method": method, "pooled_auc_by_seed": aucs, "pooled_auc_seed_mean": float(np.mean(aucs)) if aucs else np.nan})
    return pd.DataFrame(rows)


def instance_truth(coords: np.ndarray, tile_size: int, nuclei: pd.DataFrame, construction: str) -> np.ndarray:
    """Per tile: True where it holds an epithelial nucleus.

    ``points``: the tile is centred on a nucleus (the annotated point nearest the tile centre)
    and that nucleus is epithelial. ``grid``: an epithelial nucleus centre lies inside the tile
    (``x0 <= x < x0 + T``, same for y). ``coords``: (N, 2) top-left corners, level-0 px;
    ``nuclei``: the image's rows of ``nuclei.csv`` (x, y, class).
    """
    c = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
    xy = nuclei[["x", "y"]].to_numpy(np.float64)
    epi = (nuclei["class"] == "epithelial").to_numpy()
    if construction == "points":
        centre = c + (tile_size - 1) / 2.0
        d = ((centre[:, None, :] - xy[None, :, :]) ** 2).sum(-1)
        return epi[d.argmin(1)]
    ex = xy[epi]
    inside = ((ex[None, :, 0] >= c[:, None, 0]) & (ex[None, :, 0] < c[:, None, 0] + tile_size)
              & (ex[None, :, 1] >= c[:, None, 1]) & (ex[None, :, 1] < c[:, None, 1] + tile_size))
    return inside.any(1)


def attention_truth(folder: Path, name: str, truth_of: Callable[[str, np.ndarray], np.ndarray]) -> pd.DataFrame:
    """Per method: AUC of the attention scores against the instance truth, in each positive test image.

    ``truth_of(slide_id, coords)`` gives each tile's truth (bool) from its top-left corners (N, 2),
    level-0 px; images whose tiles are all one way are skipped.

    For every (repeat, fold) of the pipeline ``<folder>/<name>.yaml``, each of the fold's trained models
    (``best.pt`` of every method and seed) embeds the tiles of each positive image the fold tests and returns one
    attention score per tile (:class:`MILOutput.attention`). Returns
    the mean AUC over images, its standard error, the AUC of the scores pooled over all images
    after ranking within each image, and the share of positive tiles.
    """
    import torch
    from scipy.stats import rankdata
    from sklearn.metrics import roc_auc_score

    from wsi_pipeline.data.store import open_store, store_path
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.evaluation.crossval import fold_test_slides
    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.manifests.folds import fold_config

    config, runs = _crossval(folder, name)
    per: dict[str, list[float]] = {}
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for fold in runs:
        fold_cfg = fold_config(config, fold)
        test = fold_test_slides(config, fold)
        test = test[test["label"].astype(int) == 1]
        for m in fold_cfg.methods:
            for seed in fold_cfg.seeds:
                run = folder / fold_cfg.run_dir(m.name, seed)
                if not (run / "best.pt").is_file():
                    continue
                tm = load_trained_model(run, which="best")
                for sid in test["slide_id"].astype(str):
                    store = open_store(store_path(Path(str(fold_cfg.data.tiles_dir)), sid))
                    truth = truth_of(sid, store.coords)
                    if truth.all() or not truth.any():
                        continue
                    with torch.no_grad():
                        z = tm.encoder(tiles_to_tensor(store.read()))
                        att = tm.aggregator(z).attention.double().numpy()
                    per.setdefault(m.name, []).append(float(roc_auc_score(truth, att)))
                    rank = (rankdata(att) - 1) / max(len(att) - 1, 1)  # ties share their mean rank (mean pooling: all 0.5)
                    pooled.setdefault(m.name, []).append((truth, rank))
    rows = []
    for method, aucs in per.items():
        t = np.concatenate([p[0] for p in pooled[method]])
        r = np.concatenate([p[1] for p in pooled[method]])
        v = np.asarray(aucs)
        rows.append({"method": method, "attention_auc": float(v.mean()),
                     "attention_auc_se": float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan"),
                     "attention_auc_pooled_rank": float(roc_auc_score(t, r)), "n_images": len(v),
                     "positive_tile_share": float(t.mean())})
    return pd.DataFrame(rows)


def run_check_commands(folder: Path, cfg: Path, images: Path, labels: Path, cv: list[str], processes: int, *,
                       tile_extra: tuple[str, ...] = (), methods: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """The held-out check's commands in ``folder``: ``manifest folder --slides IMAGES --labels LABELS CV`` (skipped
    when ``folder/manifest.csv`` exists), ``tile --config``, ``train --folds`` (in ``processes`` copies) and ``eval
    --folds``, each logged to ``folder/commands.log``; ``tile_extra`` goes to ``tile`` (e.g. ``--points FILE``),
    ``methods`` restricts training and evaluation (``--method``). Returns each step's wall and CPU seconds."""
    logf = folder / "commands.log"
    manifest = folder / "manifest.csv"
    times: dict[str, dict[str, float]] = {}
    if not manifest.is_file():
        times["manifest"] = run_cli(["manifest", "folder", "--slides", str(images), "--labels", str(labels), *cv,
                                     "--out", str(manifest)], folder, logf)
    times["tile"] = run_cli(["tile", "--config", str(cfg), "--manifest", str(manifest), "--out", str(folder / "tiles"),
                             *tile_extra, "--no-progress"], folder, logf)
    only = [a for m in methods for a in ("--method", m)]
    times["train"] = run_cli(["train", "--config", str(cfg), "--folds", "--no-progress", *only], folder, logf,
                             processes=processes)
    times["eval"] = run_cli(["eval", "--config", str(cfg), "--folds", "--no-progress", *only], folder, logf)
    return times


def fold_table(folder: Path, name: str, truth_of: Callable[[str, np.ndarray], np.ndarray]) -> pd.DataFrame:
    """Per method of the finished cross-validation in ``folder``: :func:`method_table` of
    ``results/<name>_cv/cv_table.csv``, the attention-vs-instance-truth AUCs (:func:`attention_truth` with
    ``truth_of``), the uncalibrated accuracy (:func:`uncalibrated_accuracy`) and each seed's pooled AUC
    (:func:`seed_aucs`)."""
    table = method_table(pd.read_csv(folder / "results" / f"{name}_cv" / "cv_table.csv"))
    att = attention_truth(folder, name, truth_of)
    return (table.merge(att, on="method", how="left").merge(uncalibrated_accuracy(folder, name), on="method", how="left")
            .merge(seed_aucs(folder, name), on="method", how="left"))


def run_construction(construction: str, args: argparse.Namespace, data_dir: Path, work: Path, labels: Path,
                     points: Path) -> dict[str, Any]:
    """All commands of one construction in ``work/<construction>``; returns times and tables."""
    template, tile_size = CONSTRUCTIONS[construction]
    folder = work / construction
    folder.mkdir(parents=True, exist_ok=True)
    name = pipeline_name(construction)
    overrides = {"train.epochs": args.epochs} if args.epochs else {}
    cfg = dataset_config(Path(template).resolve(), folder / f"{name}.yaml", folder, name, overrides)
    cv = ["--crossval", str(args.folds), "--seed", str(args.seed)] + (["--repeats", str(args.repeats)] if args.repeats > 1 else [])
    tile_extra = ("--points", str(points)) if construction == "points" else ()
    times = run_check_commands(folder, cfg, data_dir / "images", labels, cv, args.processes, tile_extra=tile_extra,
                               methods=tuple(args.method))
    res = summarise(folder, name, construction, data_dir)
    res.update({"config": str(cfg), "folds": args.folds, "repeats": args.repeats, "times": times,
                "epochs": args.epochs or yaml.safe_load(Path(template).read_text())["train"]["epochs"]})
    return res


def summarise(folder: Path, name: str, construction: str, data_dir: Path) -> dict[str, Any]:
    """The table of one construction's finished cross-validation in ``folder`` (``results/<name>_cv/cv_table.csv``)
    with the attention-vs-instance-truth AUCs of its trained models."""
    nuclei = pd.read_csv(data_dir / "nuclei.csv")
    tile_size = CONSTRUCTIONS[construction][1]
    by_image = {k: g for k, g in nuclei.groupby("image")}
    table = fold_table(folder, name, lambda sid, coords: instance_truth(coords, tile_size, by_image[sid], construction))
    return {"construction": construction, "table": table.to_dict(orient="records")}


def markdown(results: list[dict[str, Any]], machine: str) -> str:
    """The tables of docs/real-data.md."""
    lines = []
    for res in results:
        t = res.get("times", {})
        lines.append(f"### Construction {res['construction']} ({res.get('folds', '?')}-fold x {res.get('repeats', '?')} "
                     f"repeat(s), {res.get('epochs', '?')} epochs)\n")
        lines.append("| method | accuracy (calibrated) | accuracy at 0.5 (uncalibrated) | AUC | pooled OOF AUC (95 % CI) | "
                     "attention AUC vs epithelial | paper: accuracy / AUC | reproduction: accuracy / AUC |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in res["table"]:
            paper, repro = PAPER.get(r["method"], {}), REPRODUCTION.get(r["method"], {})
            att = "" if pd.isna(r.get("attention_auc")) else f"{r['attention_auc']:.3f} ± {r['attention_auc_se']:.3f}"
            raw = ("" if pd.isna(r.get("accuracy_uncalibrated", float("nan")))
                   else f"{r['accuracy_uncalibrated']:.3f} ± {r['accuracy_uncalibrated_se']:.3f}")
            lo, hi = r["pooled_auc_ci"]
            lines.append(f"| {r['method']} | {r['accuracy']:.3f} ± {r['accuracy_se']:.3f} | {raw} | {r['auc']:.3f} ± {r['auc_se']:.3f} | "
                         f"{r['pooled_auc']:.3f} ({lo:.3f}-{hi:.3f}) | {att} | "
                         f"{' / '.join(paper.get(k, '') for k in ('accuracy', 'auc')) if paper else ''} | "
                         f"{' / '.join(repro.get(k, '') for k in ('accuracy', 'auc')) if repro else ''} |")
        lines.append("")
        if not t:
            continue
        lines.append("| step | wall (s) | CPU (s) |")
        lines.append("|---|---|---|")
        for step, v in t.items():
            lines.append(f"| {step} | {v['wall_s']:.0f} | {v['cpu_s']:.0f} |")
        tot_w = sum(v["wall_s"] for v in t.values())
        tot_c = sum(v["cpu_s"] for v in t.values())
        lines.append(f"| total | {tot_w:.0f} | {tot_c:.0f} |\n")
    lines.append(f"Machine: {machine}")
    return "\n".join(lines) + "\n"


def machine_line() -> str:
    """CPU model, core count and the load average when the bench ended."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("../shared/realdata/crc-histophenotypes"),
                   help="the crc-histophenotypes folder (images/, images.csv, nuclei.csv)")
    p.add_argument("--work", type=Path, default=Path("runs/bench_real"), help="working folder (manifests, tiles, runs, results)")
    p.add_argument("--constructions", default="points,grid", help="comma-separated: points (the paper's), grid (a user's)")
    p.add_argument("--folds", type=int, default=10, help="cross-validation folds K (default 10, the paper's)")
    p.add_argument("--repeats", type=int, default=1, help="repeats R of the cross-validation (the paper: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the folds")
    p.add_argument("--epochs", type=int, default=None, help="override train.epochs of the pipelines (default: theirs)")
    p.add_argument("--method", action="append", default=[],
                   help="train and evaluate only this method of the pipelines (repeatable; default: every method)")
    p.add_argument("--processes", type=int, default=2,
                   help="`train --folds` processes at once, sharing the runs through their locks (default 2: one per core "
                        "of a 2-core machine, one thread each)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data_dir = args.data.resolve()
    if not (data_dir / "images.csv").is_file():
        print(f"bench-real: {data_dir} has no images.csv; point --data at ../shared/realdata/crc-histophenotypes", file=sys.stderr)
        return 2
    work = args.work.resolve()
    labels, points = write_inputs(data_dir, work)
    results = []
    for c in [s.strip() for s in args.constructions.split(",") if s.strip()]:
        if c not in CONSTRUCTIONS:
            print(f"bench-real: unknown construction {c!r}; choose from {sorted(CONSTRUCTIONS)}", file=sys.stderr)
            return 2
        log.info("construction %s ...", c)
        results.append(run_construction(c, args, data_dir, work, labels, points))
        write_text_atomic(work / "bench_real.json", json.dumps(results, indent=1, default=float))
    text = markdown(results, machine_line())
    write_text_atomic(work / "bench_real.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
