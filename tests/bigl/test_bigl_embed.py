"""Where a Big-Layers encoder's input lives, and the plain-or-Big-Layers choice for inference.

- ``full_step`` hands a Big-Layers encoder the host tiles themselves (no whole-bag trip to the
  device and back): checked with an encoder whose parameters sit on the ``meta`` device, so
  any ``tiles.to(device)`` would reach it as a meta tensor.
- :class:`EmbeddingEncoder` runs the plain encoder when a call's estimated activations fit the
  budget, Big-Layers otherwise; both outputs equal the plain encoder's, computed in the test, in
  float64 (max abs difference <= 1e-9, the bound tests/test_bigl.py uses for exact claims).
- The activation estimate equals ``input + 3 x largest activation`` computed here from the
  ResNet geometry (the stem's conv1 halves the side and has 64 channels; it is the largest).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wsi_pipeline.bigl import EmbeddingEncoder, bigify, inference_activation_bytes, monitor_transfers
from wsi_pipeline.models import build_aggregator, build_encoder
from wsi_pipeline.training.accumulate import full_step


pytestmark = pytest.mark.usefixtures("one_thread")


class _HostOnlyEncoder(nn.Module):
    """Records what it receives; its first parameter is on ``meta`` (the "device")."""

    host_input = True

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1, device="meta"), requires_grad=False)
        self.proj = nn.Parameter(torch.randn(3, 4))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return x.mean(dim=(2, 3)) @ self.proj


def test_full_step_hands_host_tiles_to_a_host_input_encoder():
    torch.manual_seed(0)
    enc = _HostOnlyEncoder()
    agg = build_aggregator("abmil", 4, 2)
    tiles = torch.randn(5, 3, 8, 8)
    full_step(enc, agg, tiles, 1)
    (x,) = enc.seen
    assert x.device.type == "cpu" and x.data_ptr() == tiles.data_ptr(), "the bag was moved before the encoder"
    assert enc.proj.grad is not None
    # an ordinary encoder still receives its input on its own device
    enc.host_input = False
    enc.seen.clear()
    with pytest.raises(RuntimeError, match="not on the expected device meta"):  # the meta input cannot meet the CPU parameter
        full_step(enc, agg, tiles, 1)
    assert enc.seen and enc.seen[0].device.type == "meta"


def test_bigresnet_declares_host_input_and_keeps_its_plain_encoder():
    plain = build_encoder("resnet18")
    big = bigify(plain, stages=1, max_elements=100_000, device="cpu")
    assert big.host_input is True
    assert big.plain is plain
    assert "_plain" not in dict(big.named_modules())
    assert list(big.state_dict()) == list(plain.state_dict())


def _expected_bytes(n: int, c: int, h: int, w: int, itemsize: int) -> int:
    ho, wo = (h + 2 * 3 - 7) // 2 + 1, (w + 2 * 3 - 7) // 2 + 1  # conv1: 7x7, stride 2, padding 3
    return (n * c * h * w + 3 * n * 64 * ho * wo) * itemsize


@pytest.mark.parametrize(("name", "shape"), [("resnet18", (3, 3, 40, 40)), ("resnet50", (2, 3, 32, 48))])
def test_activation_estimate_matches_geometry(name, shape):
    model = build_encoder(name)
    # resnet50's layer1 output (256 channels at 1/4 side) has as many elements as conv1's when
    # the side divides by 4
    assert inference_activation_bytes(model, shape, torch.float64) == _expected_bytes(*shape, 8)
    assert inference_activation_bytes(model, shape) == _expected_bytes(*shape, 4)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_embedding_encoder_plain_when_it_fits_bigl_when_not_same_outputs():
    torch.manual_seed(0)
    plain = build_encoder("resnet18").double().eval()
    x = torch.randn(3, 3, 40, 40, dtype=torch.float64)
    with torch.no_grad():
        ref = plain(x)
    need = _expected_bytes(3, 3, 40, 40, 8)
    for budget, path in ((need, "plain"), (need - 1, "bigl"), (0, "bigl"), (None, "plain")):
        emb = EmbeddingEncoder(copy.deepcopy(plain), stages=2, max_elements=20_000, budget_bytes=budget).eval()
        assert emb.fits(x.shape, x.dtype) == (path == "plain")
        with monitor_transfers() as mon, torch.no_grad():
            z = emb(x)
        assert emb.last_path == path, budget
        # the plain path moves nothing in chunks; the Big-Layers path does, within its budget
        assert (mon.count("h2d") > 0) == (path == "bigl")
        assert mon.max_chunk <= 20_000
        diff = (z - ref).abs().max().item()
        assert diff <= 1e-9, f"budget {budget} ({path}): max abs diff {diff:.3g}"


def test_embedding_encoder_state_dict_is_the_plain_encoders_and_from_big_shares_training_weights():
    torch.manual_seed(0)
    plain = build_encoder("resnet18").double()
    big = bigify(plain, stages=1, max_elements=20_000, device="cpu")
    fresh = build_encoder("resnet18").double()
    emb = EmbeddingEncoder(fresh, stages=1, max_elements=20_000)
    assert list(emb.state_dict()) == list(fresh.state_dict())
    emb.load_state_dict(big.state_dict())  # strict: a bigl checkpoint loads into it
    # from_big: validation embeds with the training model's own weights, whichever path
    val = EmbeddingEncoder.from_big(big, budget_bytes=0).eval()
    x = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    with torch.no_grad():
        ref = copy.deepcopy(plain).eval()(x)
        z_big = val(x)
        val.budget_bytes = None
        z_plain = val(x)
    assert val.big_model() is big
    assert big.training, "validation must leave the training model's mode as it was"
    assert (z_big - ref).abs().max().item() <= 1e-9
    assert (z_plain - ref).abs().max().item() <= 1e-9


def test_embedding_encoder_rejects_bad_arguments():
    with pytest.raises(TypeError, match="expects a ResNet"):
        EmbeddingEncoder(nn.Linear(2, 2), stages=1, max_elements=10)
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        EmbeddingEncoder(build_encoder("resnet18"), stages=1, max_elements=10, budget_bytes=-1)


def test_bigl_strategy_validates_and_evaluates_through_the_embedding_encoder():
    from wsi_pipeline.config.pipeline import BiglConfig, EncoderConfig, MethodConfig
    from wsi_pipeline.methods.models import build_models
    from wsi_pipeline.training.strategies import build_strategy

    method = MethodConfig(name="m", strategy="bigl", encoder=EncoderConfig(name="resnet18"),
                          bigl=BiglConfig(stages=1, max_elements=50_000, embed_budget_mib=0.5))
    torch.manual_seed(0)
    strategy = build_strategy(method, 2, "cpu")
    assert strategy._prep_device().type == "cpu"  # tiles stay on the host, augmented or not
    emb = strategy.embedder()
    assert isinstance(emb, EmbeddingEncoder) and emb.big_model() is strategy.encoder
    assert emb.budget() == 2**19
    assert emb.fits((1, 3, 32, 32)) and not emb.fits((1, 3, 64, 64))  # 0.2 MiB and 0.8 MiB float32
    enc, _ = build_models(method, 2, for_training=False)
    assert isinstance(enc, EmbeddingEncoder)
    enc.load_state_dict(strategy.encoder.state_dict())
