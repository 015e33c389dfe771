"""Embeddings of the same tiles and weights under two timm versions: every preset at reduced depth, real width.

Run ``make`` and ``embed`` with the pinned timm, ``embed`` again in a side environment holding the
other timm (e.g. ``python -m venv /tmp/timm0916``, a ``.pth`` file naming the shared venv's
site-packages for torch, ``pip install --no-deps timm==0.9.16``), then ``compare``::

    python -m benchmarks.timm_versions make DIR           # weights (timm layout) + tiles
    python -m benchmarks.timm_versions embed DIR          # DIR/emb_<timm version>.pt
    /tmp/timm0916/bin/python -m benchmarks.timm_versions embed DIR
    python -m benchmarks.timm_versions compare DIR 1.0.31 0.9.16

Each preset is built at ``--depth`` blocks (default 2) of its real width; the class, register and
position tokens are redrawn at N(0, 1) and the LayerScale factors at U(0.2, 0.5) so every token and
block matters (timm starts them near 0). float32 on the CPU with one thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _presets(depth: int) -> dict:
    from wsi_pipeline.models import foundation as fm

    return {name: fm.replace_preset(p, timm_kwargs={"depth": depth}, layout="timm") for name, p in fm.PRESETS.items()}


def _make(out: Path, depth: int, n_tiles: int) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from wsi_pipeline.models.foundation import build_foundation_encoder

    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tiles.npy", np.random.default_rng(0).integers(30, 230, (n_tiles, 224, 224, 3), dtype=np.uint8))
    for name, preset in _presets(depth).items():
        torch.manual_seed(0)
        enc = build_foundation_encoder(name, preset=preset)
        with torch.no_grad():
            for key, p in enc.model.named_parameters():
                if key in ("cls_token", "reg_token", "pos_embed"):
                    p.normal_(0.0, 1.0)
                elif key.endswith(".gamma"):
                    p.uniform_(0.2, 0.5)
        save_file({k: v.contiguous() for k, v in enc.model.state_dict().items()}, str(out / f"{name}.safetensors"))


def _embed(out: Path, depth: int) -> Path:
    import numpy as np
    import timm
    import torch

    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.models.foundation import build_foundation_encoder

    x = tiles_to_tensor(np.load(out / "tiles.npy"))
    res = {}
    for name, preset in _presets(depth).items():
        t0 = time.perf_counter()
        enc = build_foundation_encoder(name, weights=out / f"{name}.safetensors", preset=preset).eval()
        with torch.no_grad():
            res[name] = enc(x)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    path = out / f"emb_{timm.__version__}.pt"
    torch.save(res, path)
    print(f"timm {timm.__version__}, torch {torch.__version__} -> {path}")
    return path


def _compare(out: Path, a: str, b: str) -> None:
    import torch

    ea = torch.load(out / f"emb_{a}.pt", weights_only=True)
    eb = torch.load(out / f"emb_{b}.pt", weights_only=True)
    print(f"| preset | max relative difference (timm {a} vs {b}) | cosine (min over tiles) |")
    print("|---|---|---|")
    for name in ea:
        x, y = ea[name].double(), eb[name].double()
        rel = float((x - y).abs().max() / x.abs().max())
        cos = float(torch.nn.functional.cosine_similarity(x, y, dim=1).min())
        print(f"| `{name}` | {rel:.1e} | {cos:.10f} |")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one step (``make``, ``embed`` or ``compare``); return 0."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.timm_versions", description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("make", "embed", "compare"), help="make weights and tiles, embed them, or compare two runs")
    ap.add_argument("dir", type=Path, help="folder of the weights, tiles and embeddings")
    ap.add_argument("versions", nargs="*", help="compare: the two timm versions (e.g. 1.0.31 0.9.16)")
    ap.add_argument("--depth", type=int, default=2, help="transformer blocks per preset (real width; default 2)")
    ap.add_argument("--tiles", type=int, default=3, help="make: random 224 px tiles (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the same reduction order)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.step == "make":
        _make(args.dir, args.depth, args.tiles)
    elif args.step == "embed":
        _embed(args.dir, args.depth)
    else:
        if len(args.versions) != 2:
            ap.error("compare takes two timm versions")
        _compare(args.dir, *args.versions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
