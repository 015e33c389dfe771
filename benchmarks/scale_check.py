"""A scale check anyone can run (``make scale-check``): the whole flow at the size users work at.

Builds (once, cached in ``.bench-cache/``) 4 mosaics of real tissue from
``../shared/slides/CMU-1-Small-Region.svs`` (the decode benchmark's builder, each with another seed:
28672 x 28672 px at the scan's 0.5 um/px, about 4,500 tissue tiles of 256 px), labels 0/1/0/1 and
splits train, train, val, test, then runs, each stage in its own process:

tile (lossless) -> train frozen, accumulate and bigl (ResNet-18, 1 epoch, bags of 512 tiles, the
validation slide scored as ``sub512x1``) -> eval (the test slide, ``sub512x1``) -> predict (the test
slide, with its heatmap).

It prints, per stage, the wall time and the process's peak resident memory; for each training method
the data path's share of its steps (``steps.csv``'s data-wait share) and its tiles/s; and the tiling
report's store-to-slide size. The table goes to ``docs/scale-check.md`` when ``--write-docs`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from wsi_pipeline.io_atomic import write_text_atomic

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO.parent / "shared" / "slides" / "CMU-1-Small-Region.svs"

#: Run one command line in this process and leave its peak resident memory (bytes) in a file: the
#: larger of the process's own and its largest worker's (tiling runs its slides in worker processes).
_STAGE = """
import json, resource, sys
from wsi_pipeline.cli.main import main
rc = main(sys.argv[2:])
from wsi_pipeline.training.memory import measured_peak
peak = max(measured_peak(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
json.dump({"rc": rc, "maxrss": peak}, open(sys.argv[1], "w"))
sys.exit(rc)
"""


def _stage(name: str, argv: list[str], work: Path, rows: list[dict]) -> None:
    """Run one stage in a subprocess and append its row (seconds, peak RSS); a stage that finished in
    an earlier run of the same ``--work`` folder is not run again: its recorded row is reused."""
    record = work / f"{name}.json"
    done = work / f"{name}.row.json"
    if done.is_file():
        rows.append(json.loads(done.read_text()))
        print(f"  {name}: done earlier ({rows[-1]['seconds']:.0f} s, peak {rows[-1]['peak_rss_gib']:.2f} GiB)", flush=True)
        return
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _STAGE, str(record), *argv], cwd=work, env={**os.environ},
                       capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"stage {name} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    peak = json.loads(record.read_text())["maxrss"]
    rows.append({"stage": name, "seconds": round(seconds, 1), "peak_rss_gib": round(peak / 2**30, 2)})
    write_text_atomic(done, json.dumps(rows[-1]))
    print(f"  {name}: {seconds:.0f} s, peak {peak / 2**30:.2f} GiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=28672, help="level-0 side of each mosaic (px, a multiple of 4096)")
    p.add_argument("--bag", type=int, default=512, help="tiles per training bag")
    p.add_argument("--cache", type=Path, default=REPO / ".bench-cache", help="where the mosaics are kept")
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a new one under the cache)")
    p.add_argument("--write-docs", action="store_true", help="write the table to docs/scale-check.md")
    args = p.parse_args(argv)
    from benchmarks.decode import build_mosaic

    if not SOURCE.is_file():
        raise SystemExit(f"the real slides are not at {SOURCE.parent}: the scale check builds its slides from them")
    slides = []
    for i in range(4):
        path = args.cache / f"scale-mosaic-{args.size}-{i}.tif"
        build_mosaic(path, SOURCE, size=args.size, seed=100 + i)
        slides.append(path)
    work = args.work or args.cache / f"scale-check-{time.strftime('%Y%m%d-%H%M%S')}"
    work = work.resolve()  # the stages run with the work folder as their current directory
    work.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"slide_id": [f"m{i}" for i in range(4)], "path": [str(s) for s in slides], "label": [0, 1, 0, 1],
                  "split": ["train", "train", "val", "test"], "cohort": "scale"}).to_csv(work / "manifest.csv", index=False)
    raw = {
        "name": "scale", "seeds": [0], "runs_dir": "runs", "results_dir": "results",
        "data": {"manifest": "manifest.csv", "tiles_dir": "tiles", "features_dir": "features", "n_classes": 2},
        "train": {"epochs": 1, "bag_size": args.bag, "batch_bags": 1, "device": "cpu"},
        "eval": {"val_protocol": f"sub{args.bag}x1", "protocols": [f"sub{args.bag}x1"], "bootstrap": 0},
        "methods": [
            {"name": "frozen", "strategy": "frozen", "chunk_size": 64, "encoder": {"name": "resnet18"}},
            {"name": "accumulate", "strategy": "accumulate", "chunk_size": 64, "encoder": {"name": "resnet18", "bn": "frozen"}},
            {"name": "bigl", "strategy": "bigl", "chunk_size": 64, "encoder": {"name": "resnet18", "bn": "train"},
             "bigl": {"stages": 1}},
        ],
    }
    (work / "scale.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    rows: list[dict] = []
    print(f"scale check in {work}", flush=True)
    _stage("tile", ["tile", "--manifest", "manifest.csv", "--out", "tiles", "--no-progress", "--quiet"], work, rows)
    for m in ("frozen", "accumulate", "bigl"):
        _stage(f"train {m}", ["train", "--config", "scale.yaml", "--method", m, "--no-progress", "--quiet"], work, rows)
    _stage("eval", ["eval", "--config", "scale.yaml", "--no-progress", "--quiet", "--no-heatmaps"], work, rows)
    test_dir = work / "test_slide"
    test_dir.mkdir(exist_ok=True)
    link = test_dir / slides[3].name
    if not link.exists():
        link.symlink_to(slides[3])
    _stage("predict", ["predict", "--model", "runs/scale/accumulate/seed0", "--slides", str(test_dir), "--out", "predictions",
                       "--no-progress", "--quiet", "--protocol", f"sub{args.bag}x1", "--device", "cpu"], work, rows)
    report = pd.read_csv(work / "tiles" / "tiling_report.csv")
    print(f"\ntiles per slide: {report['n_tiles'].tolist()}; stores {report['store_bytes'].sum() / 2**20:.0f} MiB for "
          f"{report['slide_bytes'].sum() / 2**20:.0f} MiB of slides ({report['store_bytes'].sum() / report['slide_bytes'].sum():.2f}x)")
    for m in ("frozen", "accumulate", "bigl"):
        steps = pd.read_csv(work / "runs" / "scale" / m / "seed0" / "steps.csv")
        wait = (steps["data_wait_share"] * steps["seconds"]).sum() / steps["seconds"].sum()
        row = next(r for r in rows if r["stage"] == f"train {m}")
        row.update(data_wait_share=round(float(wait), 4), tiles_per_s=round(float(steps["tiles"].sum() / steps["seconds"].sum()), 1))
        memory = json.loads((work / "runs" / "scale" / m / "seed0" / "memory.json").read_text())
        row.update(predicted_gib=round(memory["predicted"]["host_bytes"] / 2**30, 2), measured_over_predicted=memory["host_ratio"])
    table = pd.DataFrame(rows).fillna("")
    text = table.to_markdown(index=False) if _has_tabulate() else "```\n" + table.to_string(index=False) + "\n```"
    total = sum(r["seconds"] for r in rows)
    print("\n" + text + f"\n\ntotal {total / 60:.1f} min (mosaics cached)")
    if args.write_docs:
        (REPO / "docs").mkdir(exist_ok=True)
        write_text_atomic(REPO / "docs" / "scale-check.md",
            "# Scale check\n\n`make scale-check` on this project's 2-core CPU machine: 4 mosaics of real tissue, "
            f"{args.size} px, bags of {args.bag} (ResNet-18, 1 epoch, 2 training slides, validation on one "
            f"{args.bag}-tile subset), written by `python -m benchmarks.scale_check --write-docs`.\n\n"
            + text + f"\n\nTotal {total / 60:.1f} min (mosaics cached).\n\n" + COLUMNS)
    return 0


COLUMNS = """Columns: `seconds`, the stage's wall time (its own process, start-up included); `peak_rss_gib`,
the larger of that process's peak resident memory and its largest worker's (tiling runs slides in
worker processes); for training, `tiles_per_s` and `data_wait_share` from the run's `steps.csv` (the
share of step time the training thread waited for the loader), `predicted_gib` the memory
preflight's host prediction and `measured_over_predicted` the measured peak over it (`memory.json`).
The frozen method's time includes extracting the features of every slide (all 4).
"""


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
