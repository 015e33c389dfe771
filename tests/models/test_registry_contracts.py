"""Contract tests over every registered encoder, aggregator and training strategy.

The parameters come from the registries themselves (``ENCODERS``, ``AGGREGATORS``, ``STRATEGIES``), so a
component registered later is tested without editing this file. Everything is built offline with random
weights. Foundation presets are built at one transformer block of their real width (the preset's other
keywords as published; :func:`~wsi_pipeline.models.foundation.replace_preset`), which keeps the 1.1 B-parameter
giants to a fraction of a second while the embedding width D, the tokens and the pooling are the card's.

What each contract says, and the independent reference it is checked against:
- encoder: ``[B, 3, H, W]`` at the smallest side it accepts -> ``[B, D]`` with D its ``num_features``, which is
  the preset's ``embed_dim`` for a foundation model and torchvision's width for the ResNets; finite, and its
  parameters get a gradient from the output (it can be trained end to end).
- aggregator: a bag ``[n, D]`` -> logits ``[C]`` and attention ``[n]`` that is a distribution (>= 0, sums to 1),
  except where the aggregator documents a partial row (``PARTIAL_ATTENTION``).
- strategy: builds from a minimal pipeline config through :func:`~wsi_pipeline.training.strategies.build_strategy`,
  names itself, has parameters to train, and trains the encoder unless it is the frozen one.
"""

from __future__ import annotations

import pytest
import torch

from wsi_pipeline.models import AGGREGATORS, ENCODERS, build_aggregator, build_encoder
from wsi_pipeline.models import foundation as fm
from wsi_pipeline.models.encoders import PRECOMPUTED
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.models.small_cnn import MIN_INPUT_PX
from wsi_pipeline.training.strategies import STRATEGIES, build_strategy

#: torchvision's widths (its ResNet's ``fc.in_features``): the reference for our ResNets' D.
TORCHVISION_WIDTH = {"resnet18": 512, "resnet34": 512, "resnet50": 2048}
#: Smallest side a ResNet takes and still has a 1 x 1 map after its stride-32 trunk (px).
RESNET_MIN_PX = 32
#: Aggregators whose ``attention`` is one row of a larger softmax (TransMIL: the class token's row over the class
#: token, the instances and the padding), so it sums to less than 1; every other aggregator's sums to 1.
PARTIAL_ATTENTION = {"transmil"}


def _smallest_side(name: str) -> int:
    if name in fm.PRESETS:
        return fm.PRESETS[name].input_size
    if name == "ilse_cnn":
        return MIN_INPUT_PX
    return RESNET_MIN_PX


@pytest.mark.parametrize("name", [n for n in ENCODERS.names() if n != PRECOMPUTED])
def test_every_encoder_builds_and_yields_its_declared_width(name: str, monkeypatch) -> None:
    if name in fm.PRESETS:  # one block of the real width: D, tokens and pooling as published
        monkeypatch.setitem(fm.PRESETS, name, fm.replace_preset(fm.PRESETS[name], timm_kwargs={"depth": 1}))
    torch.manual_seed(0)
    enc = build_encoder(name)
    declared = int(enc.num_features)
    if name in fm.PRESETS:
        assert declared == fm.PRESETS[name].embed_dim, name
    elif name in TORCHVISION_WIDTH:
        assert declared == TORCHVISION_WIDTH[name], name
    side = _smallest_side(name)
    x = torch.rand(2, 3, side, side)
    out = enc.eval()(x)
    assert out.shape == (2, declared), (name, tuple(out.shape))
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters()), f"{name}: nothing to train"


def test_the_precomputed_encoder_passes_features_through_and_refuses_images() -> None:
    """``precomputed`` embeds nothing: width D from the feature files, features unchanged, tiles refused."""
    with pytest.raises(ValueError, match=r"needs its feature width D \(encoder.dim\)"):
        build_encoder(PRECOMPUTED)
    enc = build_encoder(PRECOMPUTED, dim=8)
    z = torch.rand(5, 8)
    assert int(enc.num_features) == 8 and enc(z) is z and not list(enc.parameters())
    with pytest.raises(ValueError, match=r"takes features \[B, 8\], got a tensor of shape \[2, 3, 32, 32\]"):
        enc(torch.rand(2, 3, 32, 32))


def test_every_foundation_preset_is_a_registered_encoder() -> None:
    assert set(fm.PRESETS) <= set(ENCODERS.names())
    assert {"resnet18", "resnet34", "resnet50", "ilse_cnn"} <= set(ENCODERS.names())


@pytest.mark.parametrize("name", AGGREGATORS.names())
@pytest.mark.parametrize("n_classes", [1, 4])
def test_every_aggregator_maps_a_bag_to_its_declared_shapes(name: str, n_classes: int) -> None:
    torch.manual_seed(0)
    d, n = 16, 9
    agg = build_aggregator(name, d, n_classes).eval()
    with torch.no_grad():
        out = agg(torch.randn(n, d))
    assert isinstance(out, MILOutput)
    assert out.logits.shape == (n_classes,) and out.attention.shape == (n,)
    assert torch.isfinite(out.logits).all() and (out.attention >= 0).all()
    total = float(out.attention.double().sum())
    if name in PARTIAL_ATTENTION:
        assert 0.0 < total < 1.0, (name, total)
    else:
        assert total == pytest.approx(1.0, abs=1e-5), (name, total)
    for extra in (out.instance_scores, out.attention_raw):
        assert extra is None or extra.shape[0] == n


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_strategy_constructs_from_a_minimal_config(name: str) -> None:
    from wsi_pipeline.config.pipeline import config_from_dict

    config = config_from_dict({"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
                               "methods": [{"name": "m", "strategy": name, "encoder": {"name": "resnet18"}}]})
    torch.manual_seed(0)
    strategy = build_strategy(config.methods[0], 2, "cpu")
    assert strategy.name == name and type(strategy) is STRATEGIES.get(name)
    assert strategy.parameters(), name
    encoder_params = {id(p) for p in strategy.encoder.parameters()}
    trained = {id(p) for p in strategy.parameters()}
    assert bool(encoder_params & trained) == (name != "frozen"), name
    assert set(strategy.state_modules()) >= {"encoder", "aggregator"}
