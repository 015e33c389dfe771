"""`weights: imagenet`: torchvision's ImageNet checkpoint from its cache, hash-checked, never downloaded in a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wsi_pipeline.models import build_encoder
from wsi_pipeline.models import imagenet as imagenet_mod

from pipeline_helpers import published_copy


def test_imagenet_loads_the_cached_file_into_the_encoder(tmp_path, monkeypatch):
    path, state = published_copy(tmp_path, "resnet18")
    monkeypatch.setattr(imagenet_mod, "imagenet_file", lambda name: path)
    enc = build_encoder("resnet18", weights="imagenet")
    own = enc.state_dict()
    for k, v in state.items():
        if not k.startswith("fc."):
            assert torch.equal(own[k], v), k


def test_the_real_cache_path_is_torchvisions_file_name_in_torch_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    import torchvision

    want = Path(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url).name
    assert imagenet_mod.imagenet_file("resnet18") == tmp_path / "hub" / "checkpoints" / want


def test_a_missing_file_says_how_to_fetch_it_and_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    import torch.hub

    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda *a, **k: pytest.fail("a run must not download"))
    with pytest.raises(FileNotFoundError, match=r"wsi-pipeline weights fetch resnet34"):
        build_encoder("resnet34", weights="imagenet")


def test_a_damaged_file_is_refused_by_its_published_hash(tmp_path, monkeypatch):
    path, _ = published_copy(tmp_path, "resnet18")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    monkeypatch.setattr(imagenet_mod, "imagenet_file", lambda name: path)
    with pytest.raises(ValueError, match="does not begin with"):
        build_encoder("resnet18", weights="imagenet")


def test_imagenet_is_refused_for_an_encoder_without_an_imagenet_checkpoint():
    with pytest.raises(ValueError, match=r"weights: imagenet is offered for .*resnet18"):
        build_encoder("uni_v1", weights="imagenet")


def test_weights_cli_where_names_the_path_and_exits_1_when_missing(tmp_path, monkeypatch, capsys):
    from wsi_pipeline.cli.main import main

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    assert main(["weights", "where", "resnet18"]) == 1
    assert "missing: `wsi-pipeline weights fetch resnet18`" in capsys.readouterr().out


def test_random_init_note_names_the_method_and_the_fix_and_is_silent_with_weights():
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.methods.models import random_encoder_note

    raw = {"name": "t", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
           "methods": [{"name": "base", "strategy": "frozen", "encoder": {"name": "resnet18"}},
                       {"name": "pre", "strategy": "frozen", "encoder": {"name": "resnet18", "weights": "imagenet"}},
                       {"name": "vit", "strategy": "frozen", "encoder": {"name": "uni_v1"}}]}
    base, pre, vit = config_from_dict(raw).methods
    note = random_encoder_note(base)
    assert note and note.startswith("base: encoder randomly initialised") and "weights: imagenet" in note
    assert random_encoder_note(pre) is None
    vit_note = random_encoder_note(vit)
    assert vit_note and "model card" in vit_note and "imagenet" not in vit_note


def test_weights_cli_checks_a_file_downloaded_by_hand(tmp_path, monkeypatch, capsys):
    from wsi_pipeline.cli.main import main

    path, _ = published_copy(tmp_path, "resnet18")
    monkeypatch.setattr(imagenet_mod, "imagenet_file", lambda name: tmp_path / "cache" / path.name)
    assert main(["weights", "where", "resnet18", "--file", str(path)]) == 0
    assert "is the published checkpoint (sha256 checked)" in capsys.readouterr().out
    other = tmp_path / "resnet18-00000000.pth"
    path.rename(other)
    assert main(["weights", "where", "resnet18", "--file", str(other)]) == 2
    assert "is named" in capsys.readouterr().err
