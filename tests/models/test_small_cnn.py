"""The small instance encoder (Ilse et al. 2018's two-convolution network): its function against a
reference written with torch.nn.functional from the paper's layer list, sizes, weights files,
exact gradient accumulation, and Big-Layers' refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from wsi_pipeline.config.model import EncoderConfig
from wsi_pipeline.config.schema import build
from wsi_pipeline.models import ENCODERS, build_aggregator, build_encoder
from wsi_pipeline.models.small_cnn import IlseCNN
from wsi_pipeline.training.accumulate import accumulate_step, classification_loss


def paper_reference(model, x: torch.Tensor) -> torch.Tensor:
    """The paper's network at 27 px, layer by layer: conv4-36, ReLU, maxpool 2; conv3-48, ReLU,
    maxpool 2; fc-512, ReLU; fc-512, ReLU (dropout off: eval mode)."""
    c1, c2 = model.features[0], model.features[3]
    f1, f2 = model.fc[0], model.fc[3]
    h = F.max_pool2d(F.relu(F.conv2d(x, c1.weight, c1.bias)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, c2.weight, c2.bias)), 2)
    assert h.shape[1:] == (48, 5, 5)
    h = F.relu(F.linear(h.flatten(1), f1.weight, f1.bias))
    return F.relu(F.linear(h, f2.weight, f2.bias))


def test_registered_with_the_papers_sizes() -> None:
    assert "ilse_cnn" in ENCODERS.names()
    model = build_encoder("ilse_cnn")
    assert model.num_features == 512
    # parameters of the layer list: conv 3->36 (4x4), conv 36->48 (3x3), fc 1200->512, fc 512->512
    expect = (36 * 3 * 16 + 36) + (48 * 36 * 9 + 48) + (1200 * 512 + 512) + (512 * 512 + 512)
    assert sum(p.numel() for p in model.parameters()) == expect
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("size", [27, 28])
def test_equals_the_papers_network_where_its_pooling_gives_5x5(size: int) -> None:
    torch.manual_seed(0)
    model = build_encoder("ilse_cnn").double().eval()
    x = torch.randn(6, 3, size, size, dtype=torch.float64)
    torch.testing.assert_close(model(x), paper_reference(model, x))


@pytest.mark.parametrize("size", [16, 32, 40])
def test_other_sizes_embed_and_too_small_is_refused(size: int) -> None:
    model = build_encoder("ilse_cnn").eval()
    with torch.no_grad():
        z = model(torch.randn(3, 3, size, size))
    assert z.shape == (3, 512) and torch.isfinite(z).all() and (z >= 0).all()
    with pytest.raises(ValueError, match=r"too small; the network needs at least 16 x 16 px"):
        model(torch.randn(1, 3, 15, 27))


def test_weights_file_round_trip_and_mismatch(tmp_path) -> None:
    torch.manual_seed(1)
    a = build_encoder("ilse_cnn").eval()
    path = tmp_path / "ilse.pt"
    torch.save(a.state_dict(), path)
    b = build_encoder("ilse_cnn", weights=path).eval()
    x = torch.randn(2, 3, 27, 27)
    assert torch.equal(a(x), b(x))
    torch.save(build_encoder("ilse_cnn", embed_dim=64).state_dict(), tmp_path / "small.pt")
    with pytest.raises(ValueError, match=r"shape mismatches \['fc.0.weight: file \(64, 1200\) vs model \(512, 1200\)'"):
        build_encoder("ilse_cnn", weights=tmp_path / "small.pt")
    with pytest.raises(FileNotFoundError, match="nope.pt not found"):
        build_encoder("ilse_cnn", weights=tmp_path / "nope.pt")


@pytest.mark.parametrize("agg_name", ["abmil", "mean", "max"])
def test_accumulation_with_ilse_cnn_is_exact(float64, agg_name: str) -> None:
    """accumulate_step's gradient == autograd through the whole bag at once (dropout off in both)."""
    torch.manual_seed(2)
    enc = build_encoder("ilse_cnn", dropout=0.0).train()
    agg = build_aggregator(agg_name, 512, 2, dropout=0.0).train()
    tiles = torch.randn(10, 3, 27, 27)
    ref_loss = classification_loss(agg(enc(tiles)), 1)
    ref_loss.backward()
    ref = [p.grad.clone() for m in (enc, agg) for p in m.parameters()]
    for chunk in (1, 3):
        for m in (enc, agg):
            m.zero_grad(set_to_none=True)
        loss = accumulate_step(enc, agg, tiles, 1, chunk)
        assert abs(loss - float(ref_loss.detach())) < 1e-12
        got = [p.grad for m in (enc, agg) for p in m.parameters()]
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert any(float(p.grad.abs().sum()) > 0 for p in enc.parameters())


def test_bigl_refuses_ilse_cnn_and_other_strategies_accept_it() -> None:
    from wsi_pipeline.training.strategies import check_strategy

    enc = build(EncoderConfig, {"name": "ilse_cnn"}, "encoder")
    with pytest.raises(ValueError, match="strategy 'bigl' converts ResNets .* encoder 'ilse_cnn' is not one .* 'full' or 'accumulate'"):
        check_strategy(SimpleNamespace(name="m", strategy="bigl", encoder=enc))


def test_encoder_dropout_option_sets_the_rate_of_ilse_cnn_only() -> None:
    from wsi_pipeline.methods.models import build_method_encoder

    def rates(enc: dict) -> list[float]:
        cfg = build(EncoderConfig, enc, "encoder")
        model = build_method_encoder(SimpleNamespace(name="m", strategy="full", encoder=cfg))
        return [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]

    assert rates({"name": "ilse_cnn"}) == [0.5, 0.5]
    assert rates({"name": "ilse_cnn", "dropout": 0.0}) == [0.0, 0.0]
    assert rates({"name": "ilse_cnn", "dropout": 0.25}) == [0.25, 0.25]
    # no dropout: training mode computes what evaluation mode does
    cfg = build(EncoderConfig, {"name": "ilse_cnn", "dropout": 0.0}, "encoder")
    model = build_method_encoder(SimpleNamespace(name="m", strategy="full", encoder=cfg))
    x = torch.rand(4, 3, 27, 27)
    assert torch.equal(model.train()(x), model.eval()(x))
    with pytest.raises(ValueError, match="encoder.dropout is set for encoder 'resnet18'; it is the rate of 'ilse_cnn' only"):
        build(EncoderConfig, {"name": "resnet18", "dropout": 0.1}, "encoder")
    with pytest.raises(ValueError, match="encoder.dropout"):
        build(EncoderConfig, {"name": "ilse_cnn", "dropout": 1.0}, "encoder")


def test_encoder_init_he_draws_variance_preserving_weights_for_ilse_cnn_only() -> None:
    """``encoder.init: he``: every layer's weights normal with variance 2 / fan-in (their sample
    standard deviation within 6 standard errors, 1 / sqrt(2 n) relative for n weights), zero
    biases, and an embedding of order 1 on unit-variance inputs; the default keeps PyTorch's
    uniform weights (bounded by 1 / sqrt(fan-in)) and shrinks the embedding by ~6x per layer."""
    from wsi_pipeline.methods.models import build_method_encoder

    def encoder(enc: dict) -> torch.nn.Module:
        cfg = build(EncoderConfig, enc, "encoder")
        return build_method_encoder(SimpleNamespace(name="m", strategy="full", encoder=cfg))

    torch.manual_seed(0)
    he = encoder({"name": "ilse_cnn", "init": "he", "dropout": 0.0}).eval()
    default = encoder({"name": "ilse_cnn", "dropout": 0.0}).eval()
    layers = lambda m: [x for x in m.modules() if isinstance(x, (torch.nn.Conv2d, torch.nn.Linear))]  # noqa: E731
    assert len(layers(he)) == 4
    for layer, ref in zip(layers(he), layers(default)):
        w = layer.weight.detach().double()
        fan_in = w[0].numel()
        want = (2.0 / fan_in) ** 0.5
        assert abs(w.std().item() / want - 1) < 6 / (2 * w.numel()) ** 0.5, (layer, w.std().item(), want)
        assert abs(w.mean().item()) < 6 * want / w.numel() ** 0.5
        assert torch.count_nonzero(layer.bias) == 0
        assert ref.weight.abs().max().item() <= 1 / fan_in ** 0.5  # PyTorch's kaiming_uniform(a=sqrt(5)) bound
    x = torch.randn(64, 3, 32, 32)
    with torch.no_grad():
        rms_he, rms_default = he(x).pow(2).mean().sqrt().item(), default(x).pow(2).mean().sqrt().item()
    # He keeps the second moment through conv/linear + ReLU (max-pooling can only raise it, at most to
    # the 9 values a pooling window reads); the default divides it by ~6 per layer (6^-4 over four)
    assert 0.5 < rms_he < 10, rms_he
    assert rms_default < 0.25, rms_default
    with pytest.raises(ValueError, match="encoder.init is set for encoder 'resnet18'; it is the initialisation of 'ilse_cnn' only"):
        build(EncoderConfig, {"name": "resnet18", "init": "he"}, "encoder")
    with pytest.raises(ValueError, match="init"):
        build(EncoderConfig, {"name": "ilse_cnn", "init": "xavier"}, "encoder")



@pytest.mark.parametrize("size", [27, 32])
def test_channels_last_is_the_same_function_within_float32_rounding(size: int) -> None:
    """The convolutions read channels-last memory by default (a speed setting), and in float32 every
    layer of both layouts is within its rounding bound: each convolution and fully connected layer,
    given the float32 input it received, is within gamma(n + 1) (|W| |h| + |b|) of the exact (float64)
    result (n terms and a bias summed in any order, with or without fused multiply-adds;
    gamma(n) = n u / (1 - n u), u = 2^-24), and what passes between them (ReLU, max-pooling,
    flattening: exact operations) equals the float64 reference applied to the layer before's output."""
    u = 2.0**-24
    torch.manual_seed(3)
    x = torch.randn(16, 3, size, size)
    for channels_last in (True, False):
        torch.manual_seed(4)
        model = IlseCNN(init="he", channels_last=channels_last).eval()
        layers = [model.features[0], model.features[3], model.fc[0], model.fc[3]]
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in layers:  # clone: the next ReLU works in place
            layer.register_forward_hook(lambda mod, args, out, seen=seen: seen.append((args[0].detach().clone(), out.detach().clone())))
        with torch.no_grad():
            got = model(x)
        assert got.dtype == torch.float32 and got.shape == (16, 512)
        assert seen[0][0].is_contiguous(memory_format=torch.channels_last) == channels_last
        assert torch.equal(seen[0][0], x)
        passes = [lambda h: F.max_pool2d(F.relu(h), 2), lambda h: F.adaptive_max_pool2d(F.relu(h), 5).flatten(1), F.relu, F.relu]
        for k, (layer, (h, out)) in enumerate(zip(layers, seen)):
            op = F.conv2d if isinstance(layer, torch.nn.Conv2d) else F.linear
            w, b = layer.weight.double(), layer.bias.double()
            n = w[0].numel() + 1  # products and the bias
            exact = op(h.double(), w, b)
            bound = n * u / (1 - n * u) * (op(h.double().abs(), w.abs(), None) + b.abs().view(1, -1, *[1] * (h.dim() - 2)))
            excess = (out.double() - exact).abs() - bound
            assert excess.max().item() <= 0, (channels_last, k, excess.max().item())
            following = seen[k + 1][0] if k + 1 < len(seen) else got
            assert torch.equal(following, passes[k](out)), (channels_last, k)
