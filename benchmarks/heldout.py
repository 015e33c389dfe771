"""``make bench-heldout``: the grid pipeline's defaults on a real image set they were never tuned on.

The held-out check of the attention-MIL work runs ``pipelines/ilse_colon_grid.yaml`` (its four
dataset keys edited, nothing else) on a set of 58 real H&E images of 896 x 768 px with one
whole-image label (32 negative, 26 positive), 5-fold. That set is not ours to see. This bench
builds a set of the same shape from other real tissue, the LC25000 lung tiles in
``../shared/realdata/lc25000-lung``, and runs the held-out check's commands on it exactly:
``manifest folder --crossval 5 --seed 0`` (an ``mpp`` column of 0.5), ``tile --config``,
``train --folds``, ``eval --folds``.

The image set (fixed before any result was seen; ``--cohort-seed`` draws another):

* 58 PNG images of 3 x 4 real 224 px tiles (672 x 896 px, near the check's 768 x 896), 32
  negative and 26 positive. ``--contrast benign-tumour`` (the default): negatives are benign lung
  only, positives have between 25 % and 50 % of their 12 tiles (3 to 6, at random places) from
  adenocarcinoma or squamous-cell carcinoma, the rest benign. ``--contrast aca-scc``, a harder
  set where colour alone does not tell the classes apart: negatives are adenocarcinoma only,
  positives have 3 to 6 squamous-cell carcinoma tiles among adenocarcinoma;
* the source's near-copies (each class grown from a few hundred originals by rotations and
  flips) are grouped first (:mod:`wsi_pipeline.synthetic.near_copies`) and every group is used in
  one image at most, at most 3 of its tiles: no two images, hence no two folds, share a tile or a
  near-copy of it.

The instance truth for attention is "this 32 px tile's centre lies in a witness cell of the
mosaic" (a tumour tile; a squamous one for ``aca-scc``). ``--template`` runs another recipe on the same images (e.g. an earlier version of the
grid pipeline, for a before-and-after table); each recipe works in its own folder under ``--work``.

    python -m benchmarks.heldout --source ../shared/realdata/lc25000-lung --work runs/bench_heldout
    python -m benchmarks.heldout ... --template /tmp/old_grid.yaml --tag before

Writes ``<work>/<tag>/heldout.json`` and ``heldout.md`` (the table of docs/real-data.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from benchmarks.real import dataset_config, fold_table, machine_line, run_check_commands
from wsi_pipeline.config.compare import config_differences
from wsi_pipeline.io_atomic import write_text_atomic

__all__ = ["CELL", "CONTRASTS", "build_cohort", "cell_truth", "main"]

log = logging.getLogger(__name__)

#: Side (px) of one source tile in the mosaic images.
CELL = 224
#: The paper's breast table (Ilse et al. 2018, mean +- s.e. over 5 x 10-fold CV; ../shared/docs/methods.md):
#: the shape of set this bench imitates, for scale only (other tissue).
PAPER_BREAST = {"attention": "0.745 / 0.775", "gated_attention": "0.755 / 0.799", "mean": "0.741 / 0.796"}


#: ``--contrast`` -> (classes of the negative images' tiles, classes of the positive images' witness tiles).
CONTRASTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "benign-tumour": (("lung_n",), ("lung_aca", "lung_scc")), "aca-scc": (("lung_aca",), ("lung_scc",))}


def build_cohort(source: Path, out: Path, *, n_negative: int = 32, n_positive: int = 26, rows: int = 3, cols: int = 4,
                 tumour_fraction: tuple[float, float] = (0.25, 0.5), max_per_group: int = 3, seed: int = 0,
                 contrast: str = "benign-tumour") -> Path:
    """Write the image set to ``out`` (``images/*.png``, ``labels.csv`` with slide_id, label, mpp 0.5, and
    ``cells.csv``: every placed tile with its image, row, col, ``tumour`` (1 for a tile of the positives'
    witness classes), source file and near-copy group); returns ``labels.csv``.

    Resumable: an existing ``out/cohort.json`` (written last) means the set is complete and is kept; one
    recording other settings (another draw's seed, another contrast) raises ``ValueError`` naming them.
    Raises ``ValueError`` when the source has too few near-copy groups for the images asked.
    """
    from PIL import Image

    from wsi_pipeline.synthetic.mosaic import LungMosaicCohort, index_tiles

    done = out / "cohort.json"
    spec = {"source": str(source), "contrast": contrast, "n_negative": n_negative, "n_positive": n_positive, "rows": rows, "cols": cols,
            "tumour_fraction": list(tumour_fraction), "max_per_group": max_per_group, "seed": seed}
    if done.is_file():
        diffs = config_differences(json.loads(done.read_text()), spec, names=("found", "asked"))
        if diffs:
            raise ValueError(f"{done}: this folder holds another image set: {'; '.join(diffs)}; give the new set its own folder")
        return out / "labels.csv"
    benign, tumour = CONTRASTS[contrast]  # "benign" fills every image, "tumour" is the positives' witness class
    # near-copies at the lung mosaic cohort's Hamming threshold (hashing 2,700 tiles takes about 15 s)
    tiles = index_tiles(source, benign + tumour, max_distance=LungMosaicCohort.max_distance, progress=False)
    rng = np.random.default_rng(seed)
    n_cells = rows * cols
    queues: dict[str, list[list[str]]] = {}
    # a group holding tiles of both kinds (a near-copy across classes) is left out: it would join two images
    kind_of = tiles["class"].isin(tumour)
    mixed = kind_of.groupby(tiles["group"]).nunique() > 1
    tiles = tiles[~tiles["group"].isin(mixed.index[mixed])]
    group_of = dict(zip(tiles["file"], tiles["group"]))
    for kind, classes in (("benign", benign), ("tumour", tumour)):
        sub = tiles[tiles["class"].isin(classes)]
        groups = [g["file"].tolist() for _, g in sub.groupby("group")]
        order = rng.permutation(len(groups))
        queues[kind] = [list(rng.permutation(groups[i]))[:max_per_group] for i in order]

    def take(kind: str, n: int) -> list[str]:
        got: list[str] = []
        while len(got) < n:
            if not queues[kind]:
                raise ValueError(f"{source}: too few near-copy groups of {kind} tiles for {n_negative + n_positive} images")
            group = queues[kind].pop()
            got += group[: n - len(got)]  # the rest of the group is dropped: a group never spans two images
        return got

    labels = np.array([0] * n_negative + [1] * n_positive)
    rng.shuffle(labels)
    (out / "images").mkdir(parents=True, exist_ok=True)
    cells, rows_out = [], []
    lo, hi = int(np.ceil(tumour_fraction[0] * n_cells)), int(np.floor(tumour_fraction[1] * n_cells))
    for i, label in enumerate(labels):
        sid = f"lung{i + 1:02d}"
        n_t = int(rng.integers(lo, hi + 1)) if label else 0
        is_t = np.zeros(n_cells, bool)
        is_t[rng.choice(n_cells, n_t, replace=False)] = True
        t_files, b_files = take("tumour", n_t), take("benign", n_cells - n_t)
        files = [t_files.pop() if t else b_files.pop() for t in is_t]
        arrs = [np.asarray(Image.open(source / f).convert("RGB")) for f in files]
        img = np.concatenate([np.concatenate(arrs[r * cols:(r + 1) * cols], axis=1) for r in range(rows)], axis=0)
        Image.fromarray(img).save(out / "images" / f"{sid}.png")
        for k, (f, t) in enumerate(zip(files, is_t)):
            cells.append({"slide_id": sid, "row": k // cols, "col": k % cols, "tumour": int(t), "file": f,
                          "group": int(group_of[f])})
        rows_out.append({"slide_id": sid, "label": int(label), "mpp": 0.5})
    write_text_atomic(out / "cells.csv", pd.DataFrame(cells).to_csv(index=False))
    write_text_atomic(out / "labels.csv", pd.DataFrame(rows_out).to_csv(index=False))
    write_text_atomic(done, json.dumps(spec, indent=1))
    return out / "labels.csv"


def cell_truth(cells: pd.DataFrame, tile_size: int) -> Callable[[str, np.ndarray], np.ndarray]:
    """``truth(slide_id, coords) -> bool array``: a tile (top-left ``coords``, level-0 px) whose centre lies in a witness cell."""
    tumour = {(r.slide_id, r.row, r.col) for r in cells.itertuples() if r.tumour}

    def truth(sid: str, coords: np.ndarray) -> np.ndarray:
        c = np.asarray(coords, np.float64).reshape(-1, 2) + tile_size / 2.0
        return np.array([(sid, int(y // CELL), int(x // CELL)) in tumour for x, y in c], bool)

    return truth


def claim_folder(folder: Path, cohort: Path) -> None:
    """Tie a recipe's folder (manifest, tiles, runs) to the image set in ``cohort``: its ``cohort.json`` is
    copied there on first use, and a folder already tied to another set raises ``ValueError`` (the runs
    would resume on the other set's images, which carry the same slide ids)."""
    spec = (cohort / "cohort.json").read_text()
    stamp = folder / "cohort.json"
    if stamp.is_file():
        diffs = config_differences(json.loads(stamp.read_text()), json.loads(spec), names=("its runs", str(cohort)))
        if diffs:
            raise ValueError(f"{folder}: holds runs of another image set: {'; '.join(diffs)}; give this set another --tag")
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(stamp, spec)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build (or reuse) the image set, then the held-out check's commands with ``args.template`` in ``work/<tag>``."""
    work = args.work.resolve()
    # one folder per image set: the contrast and, past the first draw, the draw's seed in its name
    contrast = "" if args.contrast == "benign-tumour" else f"_{args.contrast}"
    cohort = work / f"cohort{contrast}{f'_seed{args.cohort_seed}' if args.cohort_seed else ''}"
    labels = build_cohort(args.source.resolve(), cohort, seed=args.cohort_seed, contrast=args.contrast)
    folder = work / args.tag
    claim_folder(folder, cohort)
    name = args.name
    cfg = dataset_config(args.template.resolve(), folder / f"{name}.yaml", folder, name)
    raw = yaml.safe_load(cfg.read_text())
    tile_size = int(raw["data"]["tiling"]["tile_size"])
    times = run_check_commands(folder, cfg, cohort / "images", labels,
                               ["--crossval", str(args.folds), "--seed", str(args.seed)], args.processes,
                               methods=tuple(args.method))
    table = fold_table(folder, name, cell_truth(pd.read_csv(cohort / "cells.csv"), tile_size))
    return {"tag": args.tag, "contrast": args.contrast, "methods": args.method or "all", "template": str(args.template), "folds": args.folds, "times": times,
            "epochs": raw["train"]["epochs"], "table": table.to_dict(orient="records")}


def markdown(res: dict[str, Any], machine: str) -> str:
    """The table of one recipe's run."""
    lines = [f"### Held-out lung set `{res['contrast']}`, recipe `{res['tag']}` ({Path(res['template']).name}, {res['folds']}-fold, "
             f"{res['epochs']} epochs)\n",
             "| method | accuracy (calibrated) | accuracy at 0.5 | AUC per fold | pooled OOF AUC (95 % CI) | "
             "pooled AUC by seed (their mean) | attention AUC vs witness cells | paper, breast: accuracy / AUC |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["table"]:
        att = "" if pd.isna(r.get("attention_auc")) else f"{r['attention_auc']:.3f} ± {r['attention_auc_se']:.3f}"
        raw = "" if pd.isna(r.get("accuracy_uncalibrated")) else f"{r['accuracy_uncalibrated']:.3f}"
        lo, hi = r["pooled_auc_ci"]
        by_seed = r.get("pooled_auc_by_seed")
        seeds = (f"{' / '.join(f'{a:.3f}' for a in by_seed)} ({r['pooled_auc_seed_mean']:.3f})"
                 if isinstance(by_seed, list) and by_seed else "")
        lines.append(f"| {r['method']} | {r['accuracy']:.3f} ± {r['accuracy_se']:.3f} | {raw} | {r['auc']:.3f} ± "
                     f"{r['auc_se']:.3f} | {r['pooled_auc']:.3f} ({lo:.3f}-{hi:.3f}) | {seeds} | {att} | "
                     f"{PAPER_BREAST.get(r['method'], '')} |")
    lines += ["", "| step | wall (s) | CPU (s) |", "|---|---|---|"]
    for step, v in res["times"].items():
        lines.append(f"| {step} | {v['wall_s']:.0f} | {v['cpu_s']:.0f} |")
    lines.append(f"\nMachine: {machine}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.heldout", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=Path("../shared/realdata/lc25000-lung"),
                   help="the LC25000 lung folder (lung_n/, lung_aca/, lung_scc/ of 224 px tiles)")
    p.add_argument("--work", type=Path, default=Path("runs/bench_heldout"), help="working folder (image set, runs, results)")
    p.add_argument("--template", type=Path, default=Path("pipelines/ilse_colon_grid.yaml"),
                   help="the pipeline run with only its four dataset keys edited (default: the grid pipeline)")
    p.add_argument("--tag", default="current", help="subfolder of --work for this recipe's manifest, tiles, runs and results")
    p.add_argument("--name", default="lung_heldout", help="the pipeline's name (its `name` key)")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds (default 5, the held-out check's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the folds (default 0, the held-out check's)")
    p.add_argument("--contrast", choices=sorted(CONTRASTS), default="benign-tumour",
                   help="what tells positive images from negative ones (see the module's help; default benign-tumour)")
    p.add_argument("--cohort-seed", type=int, default=0, help="seed of the image set's draw (default 0; another seed builds another set, in "
                   "cohort_<contrast>_seed<N>)")
    p.add_argument("--method", action="append", default=[],
                   help="train and evaluate only this method of the pipeline (repeatable; default: every method, as the "
                        "held-out check does)")
    p.add_argument("--processes", type=int, default=2, help="`train --folds` processes at once (default 2, one per core)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (args.source / "lung_n").is_dir():
        print(f"bench-heldout: {args.source} has no lung_n/; point --source at ../shared/realdata/lc25000-lung", file=sys.stderr)
        return 2
    res = run(args)
    folder = args.work.resolve() / args.tag
    write_text_atomic(folder / "heldout.json", json.dumps(res, indent=1, default=float))
    text = markdown(res, machine_line())
    write_text_atomic(folder / "heldout.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
