"""Encoders: torchvision-compatible names, shapes, weight loading and its error messages."""

from __future__ import annotations

import pytest
import torch

from wsi_pipeline.models import ENCODERS, build_encoder


def torchvision_resnet_shapes(kind: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of torchvision's ResNet state dict, written from its published layout.

    Independent of our model code: stem ``conv1``/``bn1``; stages ``layer1..4`` of blocks
    ``conv1/bn1, conv2/bn2[, conv3/bn3]``; the first block of stages 2-4 (and of stage 1 for
    bottlenecks) has ``downsample.0`` (1x1 conv) and ``downsample.1`` (BN); classifier ``fc``.
    """
    shapes: dict[str, tuple[int, ...]] = {}

    def bn(prefix: str, c: int) -> None:
        for name in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{prefix}.{name}"] = (c,)
        shapes[f"{prefix}.num_batches_tracked"] = ()

    shapes["conv1.weight"] = (64, 3, 7, 7)
    bn("bn1", 64)
    if kind == "resnet18":
        blocks, expansion = (2, 2, 2, 2), 1
    else:
        blocks, expansion = (3, 4, 6, 3), 4
    c_in = 64
    for stage, (width, n) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        for b in range(n):
            p = f"layer{stage}.{b}"
            c_out = width * expansion
            if expansion == 1:
                shapes[f"{p}.conv1.weight"] = (width, c_in, 3, 3)
                bn(f"{p}.bn1", width)
                shapes[f"{p}.conv2.weight"] = (width, width, 3, 3)
                bn(f"{p}.bn2", width)
            else:
                shapes[f"{p}.conv1.weight"] = (width, c_in, 1, 1)
                bn(f"{p}.bn1", width)
                shapes[f"{p}.conv2.weight"] = (width, width, 3, 3)
                bn(f"{p}.bn2", width)
                shapes[f"{p}.conv3.weight"] = (c_out, width, 1, 1)
                bn(f"{p}.bn3", c_out)
            if b == 0 and (stage > 1 or c_in != c_out):
                shapes[f"{p}.downsample.0.weight"] = (c_out, c_in, 1, 1)
                bn(f"{p}.downsample.1", c_out)
            c_in = c_out
    shapes["fc.weight"] = (1000, c_in)
    shapes["fc.bias"] = (1000,)
    return shapes


def fake_checkpoint(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in torchvision_resnet_shapes(kind).items():
        if k.endswith("num_batches_tracked"):
            out[k] = torch.tensor(7)
        elif k.endswith("running_var"):
            out[k] = torch.rand(shape, generator=g) + 0.5
        else:
            out[k] = torch.randn(shape, generator=g)
    return out


def test_registry_lists_resnets():
    assert {"resnet18", "resnet50"} <= set(ENCODERS.names())
    with pytest.raises(ValueError, match="unknown encoder 'resnet7'"):
        build_encoder("resnet7")


@pytest.mark.parametrize(("name", "dim", "n_params"), [("resnet18", 512, 11_689_512), ("resnet50", 2048, 25_557_032)])
def test_shapes_names_and_parameter_count(name, dim, n_params):
    model = build_encoder(name)
    assert model.num_features == dim
    expected = torchvision_resnet_shapes(name)
    fc = {k for k in expected if k.startswith("fc.")}
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert own == {k: v for k, v in expected.items() if k not in fc}
    # torchvision's published parameter counts include the 1000-way classifier
    fc_params = dim * 1000 + 1000
    assert sum(p.numel() for p in model.parameters()) == n_params - fc_params
    model.eval()
    with torch.no_grad():
        z = model(torch.randn(2, 3, 67, 45))
    assert z.shape == (2, dim)
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_loads_torchvision_checkpoint(tmp_path, name):
    ckpt = fake_checkpoint(name)
    path = tmp_path / f"{name}.pth"
    torch.save(ckpt, path)
    model = build_encoder(name, weights=path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt[k]), k
    # the loaded encoder computes conv1 with the file's kernel
    x = torch.randn(1, 3, 16, 16)
    ref = torch.nn.functional.conv2d(x, ckpt["conv1.weight"], stride=2, padding=3)
    assert torch.allclose(model.conv1(x), ref, atol=1e-5)


def test_old_checkpoint_without_num_batches_tracked_loads(tmp_path):
    ckpt = {k: v for k, v in fake_checkpoint("resnet18").items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "old.pth"
    torch.save(ckpt, path)
    model = build_encoder("resnet18", weights=path)
    assert torch.equal(model.bn1.running_var, ckpt["bn1.running_var"])


def test_mismatch_names_missing_and_unexpected_keys(tmp_path):
    ckpt = fake_checkpoint("resnet18")
    del ckpt["layer1.0.conv1.weight"]
    ckpt["layer5.0.conv1.weight"] = torch.zeros(1)
    path = tmp_path / "bad.pth"
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=r"missing keys \['layer1\.0\.conv1\.weight'\].*unexpected keys \['layer5\.0\.conv1\.weight'\]"):
        build_encoder("resnet18", weights=path)


def test_wrong_architecture_reports_shapes(tmp_path):
    path = tmp_path / "r50.pth"
    torch.save(fake_checkpoint("resnet50"), path)
    with pytest.raises(ValueError, match=r"shape mismatches \['layer1\.0\.conv1\.weight: file \(64, 64, 1, 1\) vs model \(64, 64, 3, 3\)'"):
        build_encoder("resnet18", weights=path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth not found"):
        build_encoder("resnet18", weights=tmp_path / "nope.pth")
