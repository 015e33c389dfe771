"""The frozen baseline with augmentation (the Big-Layers paper's Baseline-Aug rows).

With ``train.augment.enabled`` a ``frozen`` method reads each training bag's tiles from the tile
store, augments them with one draw per bag, embeds them with the frozen encoder and trains the
aggregator on those embeddings; validation keeps reading the unaugmented h5 features. Without
augmentation it reads h5 features as before.

References are computed here: the tiles read from the store, flips and rotations in numpy, the
colour transforms with kornia's functions, the normalisation by hand, and a ResNet-18 built
from the frozen-encoder seed (eval mode, the whole bag in one call).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import wsi_pipeline.training.loop as loop
from wsi_pipeline.data.augment import AugmentParams, SlideAugment
from wsi_pipeline.data.bags import Bag, Slide
from wsi_pipeline.inference.features import features_path, read_features
from wsi_pipeline.models import build_encoder
from wsi_pipeline.data.store import open_store
from wsi_pipeline.checkpoints.files import load_run_checkpoint
from wsi_pipeline.config.pipeline import AugmentConfig, load_config
from wsi_pipeline.training.strategies import build_strategy

# every draw blurs and jitters (flips and rotations at random): the augmentation is never a no-op
AUG = {"enabled": True, "blur_p": 1.0, "jitter_p": 1.0}
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def reference_input(tiles: np.ndarray, p: AugmentParams, kernel: int) -> torch.Tensor:
    """uint8 (k, T, T, 3) -> normalised float (k, 3, T, T) with the draw ``p`` applied to every tile."""
    from kornia.enhance import adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation
    from kornia.filters import gaussian_blur2d

    # geometry first, in numpy: it commutes with the per-pixel colour transforms and the
    # symmetric (reflect-padded) Gaussian blur
    t = tiles
    if p.hflip:
        t = t[:, :, ::-1]
    if p.vflip:
        t = t[:, ::-1]
    t = np.rot90(t, p.rot90, axes=(1, 2))
    x = torch.from_numpy(np.ascontiguousarray(t).astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    if p.blur_sigma is not None:
        x = gaussian_blur2d(x, (kernel, kernel), (p.blur_sigma, p.blur_sigma))
    if p.brightness is not None:
        x = adjust_brightness(x, p.brightness - 1.0)
    if p.contrast is not None:
        x = adjust_contrast(x, p.contrast)
    if p.saturation is not None:
        x = adjust_saturation(x, p.saturation)
    if p.hue is not None:
        x = adjust_hue(x, p.hue * 2.0 * math.pi)
    x = x.clamp(0.0, 1.0)
    return (x - torch.from_numpy(MEAN).view(1, 3, 1, 1)) / torch.from_numpy(STD).view(1, 3, 1, 1)


def reference_encoder() -> torch.nn.Module:
    """The frozen encoder of a method without weights: ResNet-18 initialised from seed 0, eval mode."""
    torch.manual_seed(0)
    return build_encoder("resnet18").eval()


def write_config(tmp_path: Path, manifest: Path, methods: list[dict]) -> Path:
    raw = {
        "name": "t",
        "data": {"manifest": str(manifest), "tiles_dir": str(manifest.parent / "tiles"),
                 "features_dir": str(tmp_path / "features"), "n_classes": 2, "tiling": {"tile_size": 32}},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2, "lr": 1e-3},
        "seeds": [0],
        "runs_dir": str(tmp_path / "runs"),
        "methods": methods,
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def spy_on_strategies(monkeypatch) -> list[dict]:
    """Record, for every strategy the loop builds, each training bag (with the RNG state it starts
    from) and every aggregator input, training and validation."""
    records: list[dict] = []
    real = loop.build_strategy

    def build(method, n_classes, device, augment=None, *args, **options):  # the endpoint; the stain normalisation
        strategy = real(method, n_classes, device, augment, *args, **options)
        rec = {"method": method.name, "input": strategy.input, "val_input": strategy.val_input, "bags": [], "val": []}
        records.append(rec)
        step = strategy.bag_step

        def bag_step(bag, scale):
            rec["bags"].append({"bag": bag, "rng": torch.get_rng_state(), "z": []})
            return step(bag, scale)

        def hook(module, args):
            z = args[0].detach().cpu().clone()
            (rec["bags"][-1]["z"] if module.training else rec["val"]).append(z)

        strategy.bag_step = bag_step
        strategy.aggregator.register_forward_pre_hook(hook)
        return strategy

    monkeypatch.setattr(loop, "build_strategy", build)
    return records


@pytest.mark.slow
def test_frozen_with_augmentation_embeds_augmented_tiles(tmp_path, store_cohort, monkeypatch, caplog):
    agg = {"name": "abmil", "options": {"dropout": 0.0}}  # no dropout: augmentation is the only difference
    methods = [
        {"name": "aug", "strategy": "frozen", "chunk_size": 3, "aggregator": agg, "train": {"augment": AUG},
         "features_dir": str(tmp_path / "features_aug")},
        {"name": "plain", "strategy": "frozen", "chunk_size": 3, "aggregator": agg},
    ]
    cfg = load_config(write_config(tmp_path, store_cohort, methods))
    records = spy_on_strategies(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="wsi_pipeline"):
        loop.train_pipeline(cfg, progress=False)
    assert not any("not applied" in r.getMessage() for r in caplog.records)  # no warning, no silent fallback
    rec = {r["method"]: r for r in records}
    assert (rec["aug"]["input"], rec["aug"]["val_input"]) == ("tiles", "features")
    assert (rec["plain"]["input"], rec["plain"]["val_input"]) == ("features", "features")

    plan = loop.preflight(cfg, cfg.methods, [0])
    assert len(rec["aug"]["bags"]) == len(rec["plain"]["bags"]) == len(plan.train)
    # the augmented method extracts features for validation only: its training bags never read them
    assert sorted(p.name for p in (tmp_path / "features_aug").glob("*.h5")) == sorted(f"{s.slide_id}.h5" for s in plan.val)
    plain_dir = tmp_path / "features" / "resnet18"

    enc = reference_encoder()
    aug = SlideAugment(AugmentConfig(**AUG))
    moved = []
    for item in rec["aug"]["bags"]:
        bag: Bag = item["bag"]
        assert len(item["z"]) == 1 and len(bag.indices) == 8  # chunk 3 does not divide the bag
        tiles = open_store(bag.slide.store).read(bag.indices)
        torch.set_rng_state(item["rng"])
        params = aug.draw()  # the bag's one draw, from where its step started
        with torch.no_grad():
            expected = enc(reference_input(tiles, params, aug.cfg.blur_kernel))
        # float32, the same ResNet-18 on the same input in other batches (chunks of 3 vs 8): each of
        # its ~20 layers sums up to 4608 products, whose rounding errors (2**-24 each, random signs)
        # grow like sqrt(4608) * 2**-24 ~ 4e-6 relative per layer, ~1e-4 over the network
        torch.testing.assert_close(item["z"][0], expected, rtol=1e-4, atol=1e-4)
        unaugmented = torch.from_numpy(read_features(features_path(plain_dir, bag.slide.slide_id))[0][bag.indices])
        moved.append(float((item["z"][0] - unaugmented).abs().max()))
    assert min(moved) > 1e-2, moved  # the inputs really are augmented embeddings, not the h5 rows

    # without augmentation: the aggregator reads the h5 rows of the bag, exactly
    for item in rec["plain"]["bags"]:
        bag = item["bag"]
        h5 = read_features(features_path(plain_dir, bag.slide.slide_id))[0][bag.indices]
        assert len(item["z"]) == 1 and torch.equal(item["z"][0], torch.from_numpy(h5))

    # validation reads the unaugmented features of every validation slide, in both methods
    val = [torch.from_numpy(read_features(features_path(plain_dir, s.slide_id))[0]) for s in plan.val]
    for name in ("aug", "plain"):
        assert len(rec[name]["val"]) == len(val)
        for z, ref in zip(rec[name]["val"], val):
            torch.testing.assert_close(z, ref, rtol=0, atol=0)

    # the encoder is frozen: its saved state is the initial one (weights and BatchNorm statistics)
    runs = tmp_path / "runs" / "t"
    saved = load_run_checkpoint(runs / "aug" / "seed0" / "last.pt").models
    for k, v in enc.state_dict().items():
        assert torch.equal(saved["encoder"][k], v), k
    # the aggregators start from the same weights and see the same bags: augmentation changes the result
    other = load_run_checkpoint(runs / "plain" / "seed0" / "last.pt").models["aggregator"]
    diff = max(float((saved["aggregator"][k] - other[k]).abs().max()) for k in other)
    assert diff > 1e-6


def test_frozen_strategy_keeps_its_encoder_frozen(tmp_path, store_cohort):
    """Even when something put the encoder in train mode, the augmented step embeds in eval mode
    without gradient: BatchNorm statistics and weights stay, no gradient reaches the encoder."""
    from wsi_pipeline.data.bags import slides_for_split
    from wsi_pipeline.manifests.schema import read_manifest

    cfg = load_config(write_config(tmp_path, store_cohort, [{"name": "m", "strategy": "frozen", "chunk_size": 5}]))
    aug = SlideAugment(AugmentConfig(**AUG))
    torch.manual_seed(0)
    strategy = build_strategy(cfg.methods[0], 2, "cpu", aug)
    assert strategy.input == "tiles" and strategy.trainable() == [strategy.aggregator]
    before = {k: v.clone() for k, v in strategy.encoder.state_dict().items()}
    strategy.train()
    strategy.encoder.train()
    slide: Slide = slides_for_split(read_manifest(store_cohort), "train", store_cohort.parent / "tiles")[0]
    store = open_store(slide.store)
    idx = np.arange(min(len(store), 12))
    bag = Bag(slide, idx, store.read(idx))
    torch.manual_seed(7)
    loss = strategy.bag_step(bag, 0.5)
    assert math.isfinite(loss)
    for k, v in strategy.encoder.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in strategy.encoder.parameters())
    assert all(p.grad is not None for p in strategy.aggregator.parameters() if p.requires_grad)
    # embed: one draw for the bag, chunks of 5 tiles, equal to one eval-mode call on the reference input
    torch.manual_seed(7)
    z = strategy.embed(bag.data)
    torch.manual_seed(7)
    params = aug.draw()
    with torch.no_grad():
        expected = reference_encoder()(reference_input(bag.data, params, aug.cfg.blur_kernel))
    assert z.shape == (len(idx), 512) and z.dtype == torch.float32 and not z.requires_grad
    torch.testing.assert_close(z, expected, rtol=1e-4, atol=1e-4)  # float32 rounding, as above

    # without augmentation the strategy reads features: the bag's rows go to the aggregator as they are
    plain = build_strategy(cfg.methods[0], 2, "cpu", None)
    assert (plain.input, plain.val_input) == ("features", "features")
    seen = []
    plain.aggregator.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    feats = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    plain.bag_step(Bag(slide, np.arange(6), feats), 1.0)
    assert len(seen) == 1 and torch.equal(seen[0], torch.from_numpy(feats))
