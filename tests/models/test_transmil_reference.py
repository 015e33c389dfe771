"""TransMIL's ``nystrom: reference`` against the ``nystrom-attention`` package (0.0.14) it reproduces.

The package is a test dependency only (the ``test`` extra); the library never imports it. Every
comparison shares weights (the package's parameter names are ours: ``to_qkv``, ``to_out.0``,
``res_conv``) and runs in float64.

Bound: ours and the package compute the same formulas in a different order (ours pads q, k, v
after the bias-free projection instead of x before it, skips the pad queries, and cuts the
output before its row-wise projection), so they differ by round-off only. Each stage is a sum
of at most K = 2304 terms (padded length; 512 features) with relative error <= K * eps =
2304 * 1.1e-16 = 2.6e-13 of the sum of absolute terms; about 25 stages (projections,
softmaxes, the 18 products of the 6 cubic pseudo-inverse steps, two layers for TransMIL)
give ~1e-11 worst case before any cancellation. We allow 1e-10 relative to the largest
output (gradients: to the largest gradient entry); masked attention differs from the package by
more than 1e-3 at every tested n, so the comparison can tell the two apart. (That output token i
belongs to input token i in both modes is tested in test_aggregators.py.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

nystrom_attention = pytest.importorskip("nystrom_attention", reason="test dependency nystrom-attention==0.0.14 (pip install -e .[test])")
PackageNystrom = nystrom_attention.NystromAttention

from wsi_pipeline.models import build_aggregator  # noqa: E402
from wsi_pipeline.models.aggregators.nystrom import NYSTROM_MODES, NystromAttention  # noqa: E402
from wsi_pipeline.models.aggregators.transmil import TransMIL  # noqa: E402
from wsi_pipeline.config.pipeline import load_config  # noqa: E402

REL = 1e-10  # see the module docstring
DIM, HEADS, LANDMARKS, ITERS = 512, 8, 256, 6  # TransMIL's settings
D = 24
PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def _package_copy(attn: NystromAttention) -> torch.nn.Module:
    """The package's NystromAttention with ``attn``'s settings and weights, float64, eval mode."""
    pkg = PackageNystrom(
        dim=attn.to_out[0].out_features,
        dim_head=attn.dim_head,
        heads=attn.heads,
        num_landmarks=attn.num_landmarks,
        pinv_iterations=attn.pinv_iterations,
        residual=attn.res_conv is not None,
        residual_conv_kernel=attn.res_conv.kernel_size[0],
        dropout=0.0,
    )
    pkg.load_state_dict(attn.state_dict())  # strict: same names and shapes
    return pkg.double().eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().max() / b.abs().max()).detach())


@pytest.mark.parametrize("n", [1, 50, 257, 2050])
def test_attention_reference_equals_package(n: int) -> None:
    torch.manual_seed(n)
    ours = NystromAttention(DIM, heads=HEADS, dim_head=DIM // HEADS, num_landmarks=LANDMARKS, pinv_iterations=ITERS, mode="reference")
    ours = ours.double().eval()
    pkg = _package_copy(ours)
    masked = NystromAttention(DIM, heads=HEADS, dim_head=DIM // HEADS, num_landmarks=LANDMARKS, pinv_iterations=ITERS, mode="masked")
    masked.load_state_dict(ours.state_dict())
    masked = masked.double().eval()
    x = torch.nn.functional.layer_norm(torch.randn(1, n, DIM, dtype=torch.float64), (DIM,))  # as TransLayer feeds it
    with torch.no_grad():
        expected = pkg(x)
        assert _rel(ours(x), expected) <= REL
        assert _rel(masked(x), expected) > 1e-3  # the masked variant is a different model


@pytest.mark.parametrize("n", [50, 300])
def test_attention_row_reference_equals_package_factors(n: int) -> None:
    # row r over the real keys = attn1[r] @ pinv(attn2) @ attn3, from the package's own factors
    torch.manual_seed(100 + n)
    ours = NystromAttention(64, heads=4, dim_head=16, num_landmarks=32, pinv_iterations=ITERS).double().eval()
    pkg = _package_copy(ours)
    x = torch.randn(1, n, 64, dtype=torch.float64)
    r = 7
    with torch.no_grad():
        _, row = ours(x, return_row=r)
        _, (a1, a2inv, a3) = pkg(x, return_attn_matrices=True)
    pad = a1.shape[-2] - n  # the package's left padding
    expected = (a1[:, :, pad + r : pad + r + 1] @ a2inv @ a3)[:, :, 0, pad:].mean(1)
    assert _rel(row, expected) <= REL


def _transmil_with_package(model: TransMIL, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """TransMIL's forward written out as the paper's code composes it, with the package's attention.

    Returns the logits [C], the CLS row of the last layer over the n instances (copies summed)
    and the parameters used, by the names of ``model``'s parameters.
    """
    pkgs = [_package_copy(layer.attn) for layer in (model.layer1, model.layer2)]
    n = z.shape[0]
    h = model.embed(z)[None]  # Linear + ReLU
    side = math.ceil(math.sqrt(n))
    add = side * side - n
    h = torch.cat([h, h[:, :add]], dim=1)  # the paper's code repeats the first tokens
    x = torch.cat([model.cls_token, h], dim=1)
    x = x + pkgs[0](model.layer1.norm(x))
    cls, tokens = x[:, :1], x[:, 1:]
    grid = tokens.transpose(1, 2).reshape(1, -1, side, side)
    c7, c5, c3 = model.ppeg.convs
    grid = c7(grid) + grid + c5(grid) + c3(grid)
    x = torch.cat([cls, grid.flatten(2).transpose(1, 2)], dim=1)
    out, (a1, a2inv, a3) = pkgs[1](model.layer2.norm(x), return_attn_matrices=True)
    x = x + out
    logits = model.classifier(model.norm(x[:, 0]))[0]
    pad = a1.shape[-2] - x.shape[1]
    row = (a1[:, :, pad : pad + 1] @ a2inv @ a3)[0, :, 0, pad + 1 :].mean(0)  # CLS -> the side^2 tokens
    attention = row[:n].clone()
    attention[:add] += row[n:]
    params = {k: p for k, p in model.named_parameters() if ".attn." not in k}
    for name, pkg in zip(("layer1", "layer2"), pkgs):
        params.update({f"{name}.attn.{k}": p for k, p in pkg.named_parameters()})
    return logits, attention, params


# width 64 with 64 landmarks keeps the pseudo-inverse cheap and still pads every case (n = 1, 50, 257,
# 2050: 2, 65, 290, 2117 tokens, padded by 62, 63, 30, 59); the paper's 512 / 256 once, marked slow
@pytest.mark.parametrize(
    ("n", "dim", "landmarks"),
    [(1, 64, 64), (50, 64, 64), (257, 64, 64), (2050, 64, 64), pytest.param(257, DIM, LANDMARKS, marks=pytest.mark.slow)],
)
def test_transmil_reference_equals_package_composition(n: int, dim: int, landmarks: int) -> None:
    torch.manual_seed(200 + n)
    model = TransMIL(D, 3, dim=dim, num_landmarks=landmarks, nystrom="reference").double().eval()
    z = torch.randn(n, D, dtype=torch.float64, requires_grad=True)
    ours = model(z)
    logits, attention, params = _transmil_with_package(model, z)
    assert _rel(ours.logits, logits) <= REL
    assert _rel(ours.attention, attention) <= REL
    # gradients of one logit: to the instances and to every parameter, attention weights included
    names = sorted(params)
    g_ours = torch.autograd.grad(ours.logits[1], [z] + [dict(model.named_parameters())[k] for k in names])
    g_ref = torch.autograd.grad(logits[1], [z] + [params[k] for k in names])
    for name, a, b in zip(["z"] + names, g_ours, g_ref):
        assert _rel(a, b) <= REL, name


def test_nystrom_option_is_validated_and_defaults_to_reference() -> None:
    with pytest.raises(ValueError, match=r"transmil: nystrom='exact'; expected one of \('reference', 'masked'\)"):
        build_aggregator("transmil", D, 2, nystrom="exact")
    with pytest.raises(ValueError, match=r"mode='Reference'"):
        NystromAttention(16, heads=2, dim_head=8, mode="Reference")  # type: ignore[arg-type]
    assert NYSTROM_MODES == ("reference", "masked")
    model = build_aggregator("transmil", D, 2)
    assert {layer.attn.mode for layer in (model.layer1, model.layer2)} == {"reference"}
    masked = build_aggregator("transmil", D, 2, nystrom="masked")
    assert {layer.attn.mode for layer in (masked.layer1, masked.layer2)} == {"masked"}
    masked.load_state_dict(model.state_dict())  # same parameters in both modes


def test_paper_pipelines_use_reference_attention() -> None:
    paths = [PIPELINES / f"{name}.yaml" for name in ("panda_cosine", "panda_exp", "camelyon")]
    methods = [(path.name, m) for path in paths for m in load_config(path).methods if m.name.startswith("transmil")]
    # TransMIL x (Baseline, + Ours) x (plain, -Aug) per file: Big-Layers paper, Tables 1, 2 and 3
    assert len(methods) == 12, [(f, m.name) for f, m in methods]
    for file, m in methods:
        assert m.aggregator.name == "transmil" and m.aggregator.options.get("nystrom") == "reference", (file, m.name)
        model = build_aggregator(m.aggregator.name, D, 6, **m.aggregator.options)
        assert {layer.attn.mode for layer in (model.layer1, model.layer2)} == {"reference"}, (file, m.name)
