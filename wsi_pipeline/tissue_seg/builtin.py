"""The tissue model shipped with the package, and the recipe that trains it.

``wsi_pipeline/tissue_seg/weights/tissue_unet.pt`` (23 KB) is the best checkpoint of::

    python -m wsi_pipeline.tissue_seg.builtin --work /tmp/tissue_builtin

which generates :data:`N_SLIDES` synthetic slides with :func:`wsi_pipeline.synthetic.slides.make_slide`
(seeds ``1000 + i``; tissue fractions, stain tints, glass grey levels 232..246 and pen marks varied
from a seeded generator; the glass stays above the paper's 230 threshold, below which the paper's
labels call the glass tissue), trains with :func:`wsi_pipeline.tissue_seg.stage.train` at :data:`MPP` um/px
for :data:`EPOCHS` epochs (seed 0, Adam lr :data:`LR`, batch 1, 20 % validation slides, paper
labels) and copies ``best.pt`` into the package. The run is deterministic on one machine
(CPU, same PyTorch); across machines float rounding may differ in the last digits.
No real slide is used, so nothing of a real slide ships with the package.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

__all__ = ["BUILTIN_MODEL", "make_training_slides", "main"]

BUILTIN_MODEL = Path(__file__).with_name("weights") / "tissue_unet.pt"
N_SLIDES = 16
MPP = 2.0
EPOCHS = 40
LR = 1e-3


def make_training_slides(folder: Path, n: int = N_SLIDES, seed: int = 0) -> list[Path]:
    """Write ``n`` varied synthetic slides (level-0 0.5 um/px) into ``folder``; return their paths."""
    from wsi_pipeline.synthetic.slides import make_slide

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"syn{i:02d}.svs"
        if not p.exists():
            w, h = (int(v) for v in rng.integers(1400, 2600, size=2))
            tint = tuple(float(v) for v in rng.uniform(0.85, 1.15, size=3))
            make_slide(p, size=(w, h), seed=1000 + i, tissue_fraction=float(rng.uniform(0.15, 0.6)), mpp=0.5,
                       pen_marks=int(rng.integers(0, 3)), tint=tint, glass_grey=int(rng.integers(232, 247)))
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Generate the data, train, and copy the best checkpoint to :data:`BUILTIN_MODEL` (or ``--install``)."""
    from wsi_pipeline.tissue_seg.stage import slides_from_folder, train

    p = argparse.ArgumentParser(prog="python -m wsi_pipeline.tissue_seg.builtin", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the generated slides and the run")
    p.add_argument("--install", type=Path, default=BUILTIN_MODEL, help=f"where to copy best.pt (default {BUILTIN_MODEL})")
    p.add_argument("--epochs", type=int, default=EPOCHS)
    args = p.parse_args(argv)
    make_training_slides(args.work / "slides")
    best = train(slides_from_folder(args.work / "slides"), args.work / "run", mpp=MPP, epochs=args.epochs, lr=LR, seed=0)
    args.install.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.work / "run" / "best.pt", args.install)
    print(f"best epoch {best['epoch']}: val loss {best['val_loss']:.4f}, val Dice {best['val_dice']:.4f} -> {args.install}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
