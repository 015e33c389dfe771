"""``make bench-small-cnn``: the training step of the attention-MIL paper's small network, channels-first
against channels-last memory, side by side.

One training step of ``pipelines/ilse_colon_grid.yaml``'s ``attention`` method (``ilse_cnn`` with
He's initialisation, the paper's attention without projection, the classification loss, backward,
Adam) on a whole bag of 32 px tiles, and one no-gradient forward (validation, frozen features,
eval), with the network's input in channels-first (NCHW, ``channels_last=False``) and in
channels-last (NHWC, the default) memory. Default bag sizes: 212 and 588 tiles, about the mean bag
of the colon grid construction and of the held-out lung sets (docs/real-data.md). The tiles are
random: the network's cost does not depend on the pixel values. The two layouts are timed in
alternation (``--repeats`` rounds of ``--steps`` steps each, medians), at 1 thread and at every
core, and their embeddings of the same bag are compared (the largest difference, against the
largest embedding value: float32 rounding, since the two layouts sum in different orders).

Examples::

    python -m benchmarks.small_cnn
    python -m benchmarks.small_cnn --bags 64 1024 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

__all__ = ["main"]


def _parts(channels_last: bool, seed: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    from wsi_pipeline.models import build_aggregator
    from wsi_pipeline.models.small_cnn import IlseCNN

    torch.manual_seed(seed)
    encoder = IlseCNN(init="he", channels_last=channels_last).train()
    aggregator = build_aggregator("abmil", encoder.num_features, 2, gated=False, attn_dim=128, projection=False, dropout=0.0).train()
    params = list(encoder.parameters()) + list(aggregator.parameters())
    return encoder, aggregator, torch.optim.Adam(params, lr=5e-4, weight_decay=5e-4)


def _rate(step: Callable[[], None], steps: int, tiles: int) -> float:
    """Tiles per second of ``steps`` calls of ``step``."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * tiles / (time.perf_counter() - t0)


def measure(bag: int, threads: int, steps: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median tiles/s of a training step and of a forward pass in each layout, on ``threads`` threads."""
    from wsi_pipeline.training.accumulate import classification_loss

    torch.set_num_threads(threads)
    x = torch.randn(bag, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    models = {cl: _parts(cl, seed) for cl in (False, True)}

    def train_step(cl: bool) -> Callable[[], None]:
        enc, agg, opt = models[cl]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            classification_loss(agg(enc(x)), 1).backward()
            opt.step()
        return step

    def forward(cl: bool) -> Callable[[], None]:
        enc = models[cl][0]

        def step() -> None:
            with torch.no_grad():
                enc(x)
        return step

    # the two layouts' embeddings of the bag, from the equal starting weights of the timed models
    enc_a, enc_b = models[False][0].eval(), models[True][0].eval()
    if not all(torch.equal(v, enc_b.state_dict()[k]) for k, v in enc_a.state_dict().items()):
        raise RuntimeError("the two layouts' networks do not start from equal weights")
    with torch.no_grad():
        a, b = enc_a(x), enc_b(x)
    out: dict[str, float] = {"max_diff_rel": float((a - b).abs().max() / a.abs().max())}
    for kind, make in (("train", train_step), ("forward", forward)):
        for enc, _, _ in models.values():
            enc.train(kind == "train")
        rates: dict[bool, list[float]] = {False: [], True: []}
        for cl in (False, True):
            make(cl)()  # warm-up
        for _ in range(repeats):
            for cl in (False, True):
                rates[cl].append(_rate(make(cl), steps, bag))
        out[f"{kind}_nchw"] = statistics.median(rates[False])
        out[f"{kind}_nhwc"] = statistics.median(rates[True])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small_cnn", description=__doc__.split("\n\n")[0])
    p.add_argument("--bags", type=int, nargs="+", default=[212, 588], help="bag sizes in tiles (default 212 588)")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch threads to time at (default: 1 and every core, os.cpu_count())")
    p.add_argument("--steps", type=int, default=8, help="steps per timed round (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="alternated rounds per layout; medians are reported (default 5)")
    args = p.parse_args(argv)
    threads = args.threads or sorted({1, os.cpu_count() or 1})
    print(f"ilse_cnn + attention, 32 px tiles, CPU ({os.cpu_count()} cores), torch {torch.__version__}; "
          f"tiles/s, medians of {args.repeats} alternated rounds of {args.steps} steps")
    print("| bag | threads | train NCHW | train NHWC | train ratio | forward NCHW | forward NHWC | forward ratio | max diff / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in threads:
        for bag in args.bags:
            r = measure(bag, t, args.steps, args.repeats)
            print(f"| {bag} | {t} | {r['train_nchw']:.0f} | {r['train_nhwc']:.0f} | {r['train_nhwc'] / r['train_nchw']:.2f}x "
                  f"| {r['forward_nchw']:.0f} | {r['forward_nhwc']:.0f} | {r['forward_nhwc'] / r['forward_nchw']:.2f}x "
                  f"| {r['max_diff_rel']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
