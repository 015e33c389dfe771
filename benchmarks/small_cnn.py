"""``make bench-small-cnn``: the training step of the attention-MIL paper's small network, channels-first
against channels-last memory and float32 against bfloat16 autocast, side by side.

One training step of ``pipelines/ilse_colon_grid.yaml``'s ``attention`` method (``ilse_cnn`` with
He's initialisation, the paper's attention without projection, the classification loss, backward,
Adam) on a whole bag of 32 px tiles, and one no-gradient forward (validation, frozen features,
eval), with the network's input in channels-first (NCHW, ``channels_last=False``) and in
channels-last (NHWC, the default) memory, and channels-last under bfloat16 autocast (``train.bf16``:
autocast around the forward, backward after it, weights and Adam in float32). Default bag sizes: 212 and 588 tiles, about the mean bag
of the colon grid construction and of the held-out lung sets (docs/real-data.md). The tiles are
random: the network's cost does not depend on the pixel values. The three variants are timed in
alternation (``--repeats`` rounds of ``--steps`` steps each, medians), at 1 thread and at every
core, and their embeddings of the same bag are compared with the channels-first one (the largest
difference, against the largest embedding value: float32 rounding for the other layout, which sums
in another order; bfloat16's 8-bit significand, about 2^-9 relative per rounding, for bf16). On a
CPU without bfloat16 instructions (the header says) autocast emulates them, slower than float32.

Examples::

    python -m benchmarks.small_cnn
    python -m benchmarks.small_cnn --bags 64 1024 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from wsi_pipeline.devices import cpu_has_bf16

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


#: The timed variants: (name, channels-last input, bfloat16 autocast).
VARIANTS = (("nchw", False, False), ("nhwc", True, False), ("bf16", True, True))


def measure(bag: int, threads: int, steps: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median tiles/s of a training step and of a forward pass per variant (:data:`VARIANTS`) on ``threads`` threads."""
    from wsi_pipeline.training.accumulate import classification_loss

    torch.set_num_threads(threads)
    x = torch.randn(bag, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    models = {name: _parts(cl, seed) for name, cl, _ in VARIANTS}
    casts = {name: bf for name, _, bf in VARIANTS}

    def cast(name: str) -> contextlib.AbstractContextManager:
        # autocast around the forward, backward outside it: what the training loop computes under `train.bf16`
        return torch.autocast("cpu", dtype=torch.bfloat16) if casts[name] else contextlib.nullcontext()

    def train_step(name: str) -> Callable[[], None]:
        enc, agg, opt = models[name]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with cast(name):
                loss = classification_loss(agg(enc(x)), 1)
            loss.backward()
            opt.step()
        return step

    def forward(name: str) -> Callable[[], None]:
        enc = models[name][0]

        def step() -> None:
            with torch.no_grad(), cast(name):
                enc(x)
        return step

    # the variants' embeddings of the bag, from the equal starting weights of the timed models
    encs = {name: m[0].eval() for name, m in models.items()}
    ref = encs["nchw"].state_dict()
    if not all(torch.equal(v, encs[n].state_dict()[k]) for n in encs for k, v in ref.items()):
        raise RuntimeError("the variants' networks do not start from equal weights")
    emb: dict[str, torch.Tensor] = {}
    for name, enc in encs.items():
        with torch.no_grad(), cast(name):
            emb[name] = enc(x).float()
    top = emb["nchw"].abs().max()
    out: dict[str, float] = {f"max_diff_rel_{n}": float((emb[n] - emb["nchw"]).abs().max() / top) for n in ("nhwc", "bf16")}
    for kind, make in (("train", train_step), ("forward", forward)):
        for enc, _, _ in models.values():
            enc.train(kind == "train")
        rates: dict[str, list[float]] = {name: [] for name in models}
        for name in models:
            make(name)()  # warm-up
        for _ in range(repeats):
            for name in models:
                rates[name].append(_rate(make(name), steps, bag))
        for name in models:
            out[f"{kind}_{name}"] = statistics.median(rates[name])
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
    print(f"bf16: NHWC under bfloat16 autocast (train.bf16); this CPU has bfloat16 instructions: {cpu_has_bf16()}")
    print("| bag | threads | train NCHW | train NHWC | NHWC / NCHW | train bf16 | bf16 / NHWC | forward NCHW | forward NHWC "
          "| NHWC / NCHW | forward bf16 | bf16 / NHWC | max diff / max: NHWC, bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in threads:
        for bag in args.bags:
            r = measure(bag, t, args.steps, args.repeats)
            cells = [f"{bag}", f"{t}"]
            for kind in ("train", "forward"):
                cells += [f"{r[f'{kind}_nchw']:.0f}", f"{r[f'{kind}_nhwc']:.0f}", f"{r[f'{kind}_nhwc'] / r[f'{kind}_nchw']:.2f}x",
                          f"{r[f'{kind}_bf16']:.0f}", f"{r[f'{kind}_bf16'] / r[f'{kind}_nhwc']:.2f}x"]
            cells.append(f"{r['max_diff_rel_nhwc']:.1e}, {r['max_diff_rel_bf16']:.1e}")
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
