"""pipelines/foundation.yaml trains one epoch of every method at reduced size (UNI's architecture at 2
blocks of width 32, 32 px tiles); the checkpoints keep only the trained tensors and the base weights'
sha256, the model comes back for prediction, and a base file whose hash differs is refused. PatchGD
trains with a ViT too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

from wsi_pipeline.config.pipeline import load_config
from wsi_pipeline.data.store import open_store, store_path
from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.checkpoints.files import load_checkpoint, load_run_checkpoint
from wsi_pipeline.inference.trained import load_trained_model
from wsi_pipeline.models import foundation as fm
from wsi_pipeline.training.loop import train_pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "foundation.yaml"
#: UNI's card keywords with depth, width and input size reduced (32 px tiles go in untouched).
SMALL = dict(depth=2, embed_dim=32, num_heads=2, img_size=32)


@pytest.fixture
def small_uni(monkeypatch, tmp_path) -> list[Path]:
    """The uni_v1 preset at reduced size, and two timm-written weights files of it (seeds 0 and 1)."""
    preset = fm.replace_preset(fm.PRESETS["uni_v1"], timm_kwargs=SMALL, embed_dim=32, input_size=32)
    monkeypatch.setitem(fm.PRESETS, "uni_v1", preset)
    files = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = timm.create_model("vit_large_patch16_224", pretrained=False, **preset.timm_kwargs)
        path = tmp_path / f"uni{seed}" / "pytorch_model.bin"
        path.parent.mkdir()
        torch.save(model.state_dict(), path)
        files.append(path)
    return files


@pytest.mark.slow
def test_foundation_pipeline_trains_one_epoch_and_predicts(tmp_path, small_uni) -> None:
    from wsi_pipeline.synthetic.stores import make_store_cohort

    manifest = make_store_cohort(tmp_path / "cohort", n_slides=6, tiles_per_slide=(6, 10), seed=3)
    base, other = small_uni
    methods = ("uni_frozen", "uni_full", "uni_last4", "uni_lora")
    cfg = load_config(PIPELINE, [
        f"data.manifest={manifest}", f"data.tiles_dir={manifest.parent / 'tiles'}", f"data.features_dir={tmp_path / 'feats'}",
        f"runs_dir={tmp_path / 'runs'}", f"results_dir={tmp_path / 'results'}",
        "train.epochs=1", "train.warmup_epochs=0", "train.bag_size=6", "train.accumulate_batches=1", "train.device=cpu",
        *[f"methods.{m}.encoder.weights={base}" for m in methods], "methods.uni_last4.encoder.freeze_blocks=1",
        *[f"methods.{m}.chunk_size=4" for m in methods],
    ])
    runs = {r.parent.name: r for r in train_pipeline(cfg, progress=False)}
    assert sorted(runs) == sorted(methods) and all((r / "done").is_file() for r in runs.values())

    sha = fm.file_sha256(base)
    stored = {}
    for name, run in runs.items():
        ckpt = load_checkpoint(run / "best.pt")
        info = ckpt["encoder_info"]
        assert info["stored"] == "trained" and info["weights_sha256"] == sha and info["name"] == "uni_v1"
        assert '"resize": "none"' in info["preprocessing"]
        stored[name] = set(ckpt["models"]["encoder"])
    n_params = len(dict(fm.build_foundation_encoder("uni_v1").named_parameters()))
    assert stored["uni_frozen"] == set()  # nothing trained: the file is the encoder
    assert len(stored["uni_full"]) == n_params
    assert stored["uni_last4"] and all(k.startswith(("model.blocks.1.", "model.norm.")) for k in stored["uni_last4"])
    assert stored["uni_lora"] == {f"model.blocks.{b}.attn.{t}.lora_{ab}" for b in (0, 1) for t in ("qkv", "proj")
                                  for ab in ("a", "b")}

    # the trained model comes back: base tensors from the file, trained tensors from the checkpoint
    x = tiles_to_tensor(open_store(store_path(manifest.parent / "tiles", _first_slide(manifest))).read())
    tm = load_trained_model(runs["uni_lora"])
    base_model = fm.build_foundation_encoder("uni_v1", base).eval()
    ckpt = load_run_checkpoint(runs["uni_lora"] / "best.pt").models["encoder"]
    for k, v in tm.encoder.state_dict().items():
        expect = ckpt[k] if k in ckpt else base_model.state_dict()[k]
        assert torch.equal(v, expect), k
    assert any(float(v.abs().max()) > 0 for k, v in ckpt.items() if k.endswith("lora_b"))  # the adapters trained
    with torch.no_grad():
        assert not torch.allclose(tm.encoder(x), base_model(x))

    # a base file whose hash differs is refused; a moved file is asked for
    with pytest.raises(ValueError, match=r"stores only the trained part of encoder 'uni_v1'.*sha256 " + sha + r".*which differs"):
        load_trained_model(runs["uni_last4"], encoder_weights=other)
    moved = base.with_name("moved.bin")
    base.rename(moved)
    with pytest.raises(FileNotFoundError, match=r"trained tensors only.*not found.*--encoder-weights FILE"):
        load_trained_model(runs["uni_frozen"])
    again = load_trained_model(runs["uni_last4"], encoder_weights=moved)
    with torch.no_grad():
        emb = again.encoder(x)
    assert emb.shape == (len(x), 32)

    # predict through the CLI with the moved file; the same file under another content is refused (exit 2)
    from wsi_pipeline.cli.main import main

    stores = tmp_path / "new"
    stores.mkdir()
    (stores / f"{_first_slide(manifest)}.zarr").symlink_to(store_path(manifest.parent / "tiles", _first_slide(manifest)))
    assert main(["predict", "--model", str(runs["uni_lora"]), "--slides", str(stores), "--out", str(tmp_path / "pred"),
                 "--encoder-weights", str(moved), "--no-heatmaps", "--no-progress", "--device", "cpu"]) == 0
    assert main(["predict", "--model", str(runs["uni_lora"]), "--slides", str(stores), "--out", str(tmp_path / "pred2"),
                 "--encoder-weights", str(other), "--no-heatmaps", "--no-progress", "--device", "cpu"]) == 2


def _first_slide(manifest: Path) -> str:
    import pandas as pd

    return str(pd.read_csv(manifest)["slide_id"].iloc[0])


@pytest.mark.slow
def test_patchgd_trains_a_vit(tmp_path, small_uni) -> None:
    """PatchGD with a ViT encoder: one epoch runs and the encoder's weights move (it has no BatchNorm to freeze)."""
    from wsi_pipeline.config.pipeline import MethodConfig
    from wsi_pipeline.config.model import EncoderConfig
    from wsi_pipeline.synthetic.stores import make_store_cohort

    manifest = make_store_cohort(tmp_path / "cohort", n_slides=4, tiles_per_slide=(6, 9), seed=4)
    cfg = load_config(PIPELINE, [
        f"data.manifest={manifest}", f"data.tiles_dir={manifest.parent / 'tiles'}", f"runs_dir={tmp_path / 'runs'}",
        "train.epochs=1", "train.warmup_epochs=0", "train.accumulate_batches=1", "train.device=cpu",
    ])
    method = MethodConfig(name="uni_patchgd", strategy="patchgd", encoder=EncoderConfig(name="uni_v1", weights=str(small_uni[0]),
                          freeze_blocks=1), chunk_size=16, patchgd={"fraction": 1.0, "head_options": {"width": 16}})
    cfg = dataclasses.replace(cfg, methods=(method,))
    run = train_pipeline(cfg, progress=False)[0]
    ckpt = load_checkpoint(run / "last.pt")
    trained = ckpt["models"]["encoder"]
    base = fm.build_foundation_encoder("uni_v1", small_uni[0]).state_dict()
    assert trained and all(k.startswith(("model.blocks.1.", "model.norm.")) for k in trained)
    assert any(not torch.equal(v, base[k]) for k, v in trained.items())
    assert np.isfinite(ckpt["history"][0]["train_loss"])
