"""MIL aggregators: ABMIL, DTFD-MIL, TransMIL (+ Nystrom attention) against plain reference computations."""

from __future__ import annotations

import math

import pytest
import torch

from wsi_pipeline.models import AGGREGATORS, build_aggregator
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.models.aggregators.dtfd import DISTILL_MODES, pseudo_bags
from wsi_pipeline.models.aggregators.nystrom import NYSTROM_MODES, NystromAttention
from wsi_pipeline.models.aggregators.transmil import TransMIL

D = 24


# ---------------------------------------------------------------- contract (every registered aggregator)
@pytest.mark.parametrize("name", AGGREGATORS.names())
@pytest.mark.parametrize("n", [1, 5, 40])
def test_contract_forward_backward(name: str, n: int) -> None:
    torch.manual_seed(0)
    model = build_aggregator(name, D, 3)
    z = torch.randn(n, D, requires_grad=True)
    out = model(z, label=2)
    assert isinstance(out, MILOutput)
    assert out.logits.shape == (3,)
    assert out.attention.shape == (n,)
    loss = torch.nn.functional.cross_entropy(out.logits[None], torch.tensor([2]))
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.attention).all()
    assert z.grad is not None and torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    # eval mode is deterministic (DTFD seeds its pseudo-bags, dropout is off)
    model.eval()
    with torch.no_grad():
        a, b = model(z), model(z)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.attention, b.attention)


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match="unknown aggregator 'nope'"):
        build_aggregator("nope", D, 2)
    with pytest.raises(TypeError, match="bad option"):
        build_aggregator("abmil", D, 2, hiddn=3)
    with pytest.raises(ValueError, match=r"shape \[n, 24\]"):
        build_aggregator("abmil", D, 2)(torch.randn(3, 5))


# ---------------------------------------------------------------- ABMIL
@pytest.mark.parametrize("gated", [True, False])
def test_abmil_matches_formula_and_is_permutation_invariant(gated: bool) -> None:
    torch.manual_seed(1)
    model = build_aggregator("abmil", D, 3, gated=gated).double().eval()
    z = torch.randn(30, D, dtype=torch.float64)
    out = model(z)
    # plain reference: h = relu(W z), s = w^T(tanh(V h) [* sigmoid(U h)]), a = softmax(s), logits = C (a^T h)
    h = torch.relu(z @ model.project[0].weight.T + model.project[0].bias)
    t = torch.tanh(h @ model.attn_tanh[0].weight.T + model.attn_tanh[0].bias)
    if gated:
        t = t * torch.sigmoid(h @ model.attn_gate[0].weight.T + model.attn_gate[0].bias)
    s = (t @ model.attn_score.weight.T + model.attn_score.bias).squeeze(1)
    a = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
    torch.testing.assert_close(out.attention_raw, s)
    torch.testing.assert_close(out.attention, a)
    torch.testing.assert_close(out.logits, model.classifier(a @ h))
    assert abs(float(out.attention.detach().sum()) - 1.0) < 1e-12
    perm = torch.randperm(30)
    out_p = model(z[perm])
    torch.testing.assert_close(out_p.logits, out.logits)
    torch.testing.assert_close(out_p.attention, out.attention[perm])


def test_abmil_single_instance_pools_to_itself() -> None:
    torch.manual_seed(2)
    model = build_aggregator("abmil", D, 2).double().eval()
    z = torch.randn(1, D, dtype=torch.float64)
    pooled, weights, _ = model.pool(z)
    torch.testing.assert_close(pooled, model.project(z)[0])
    assert float(weights.detach()) == 1.0


# ---------------------------------------------------------------- DTFD
@pytest.mark.parametrize("n,g", [(10, 4), (3, 4), (17, 5), (1, 4), (8, 1)])
def test_dtfd_pseudo_bags_partition(n: int, g: int) -> None:
    bags = pseudo_bags(n, g, torch.Generator().manual_seed(n))
    assert len(bags) == min(n, g)
    allidx = torch.cat(bags).sort().values
    assert torch.equal(allidx, torch.arange(n))  # each instance exactly once
    sizes = [len(b) for b in bags]
    assert max(sizes) - min(sizes) <= 1


def test_dtfd_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="ipg=0"):
        build_aggregator("dtfd", D, 2, ipg=0)
    with pytest.raises(ValueError, match="distill='top'"):
        build_aggregator("dtfd", D, 2, distill="top")


def _dtfd_reference(model, z: torch.Tensor, groups: list[torch.Tensor], label: int):
    """DTFD forward written out step by step from the paper (independent of the module's loop)."""
    W1, b1 = model.cls1.weight, model.cls1.bias
    m = torch.relu(z @ model.reduce[0].weight.T)

    def gated(att, x):
        v = torch.tanh(att.v[0](x))
        u = torch.sigmoid(att.u[0](x))
        return att.w(v * u).squeeze(-1)

    tier1, tier2 = [], []
    for idx in groups:
        mg = m[idx]
        a = torch.softmax(gated(model.attn1, mg), 0)
        pooled = (a[:, None] * mg).sum(0)
        lg = pooled @ W1.T + b1
        tier1.append(lg)
        cam = torch.softmax((a[:, None] * mg) @ W1.T, 1)
        pred = int(lg.argmax())
        order = torch.argsort(cam[:, pred], descending=True)
        k = model.ipg
        if model.distill == "afs":
            tier2.append(pooled[None])
        elif model.distill == "maxs":
            tier2.append(mg[order[:k]])
        else:
            sel = order if len(order) <= 2 * k else torch.cat([order[:k], order[-k:]])
            tier2.append(mg[sel])
    t2 = torch.cat(tier2).detach()
    a2 = torch.softmax(gated(model.attn2, t2), 0)
    logits = (a2 @ t2) @ model.cls2.weight.T + model.cls2.bias
    aux = torch.stack([torch.nn.functional.cross_entropy(t1[None], torch.tensor([label])) for t1 in tier1]).mean()
    return logits, aux


@pytest.mark.parametrize("distill", DISTILL_MODES)
@pytest.mark.parametrize("ipg", [1, 2])
def test_dtfd_matches_step_by_step_reference(distill: str, ipg: int) -> None:
    torch.manual_seed(3)
    model = build_aggregator("dtfd", D, 4, distill=distill, ipg=ipg, n_groups=3).double()
    z = torch.randn(23, D, dtype=torch.float64)
    out = model(z, label=1, generator=torch.Generator().manual_seed(7))
    groups = pseudo_bags(23, 3, torch.Generator().manual_seed(7))
    logits, aux = _dtfd_reference(model, z, groups, 1)
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.aux_loss, aux)
    assert out.instance_scores.shape == (23, 4)
    torch.testing.assert_close(out.instance_scores.sum(1), torch.ones(23, dtype=torch.float64))
    # exported attention: tier-1 scores softmaxed over the whole bag, independent of the split
    out2 = model(z, label=1, generator=torch.Generator().manual_seed(99))
    torch.testing.assert_close(out2.attention, out.attention)
    assert abs(float(out.attention.detach().sum()) - 1) < 1e-12


def test_dtfd_ranks_by_predicted_class_not_label() -> None:
    torch.manual_seed(4)
    model = build_aggregator("dtfd", D, 3, distill="maxs", ipg=1, n_groups=2).double()
    z = torch.randn(12, D, dtype=torch.float64)
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    # the tier-2 bag (hence logits) must not depend on the label given
    outs = [model(z, label=c, generator=g()).logits for c in range(3)]
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2])


@pytest.mark.parametrize("distill", DISTILL_MODES)
def test_dtfd_trains_a_step(distill: str) -> None:
    torch.manual_seed(5)
    model = build_aggregator("dtfd", D, 2, distill=distill)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    z = torch.randn(50, D)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        out = model(z, label=1)
        loss = torch.nn.functional.cross_entropy(out.logits[None], torch.tensor([1])) + out.aux_loss
        loss.backward()
        opt.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert all(changed), "every DTFD parameter (tier 1 via aux_loss, tier 2 via the loss) must move"


def test_dtfd_without_label_has_no_aux_loss() -> None:
    model = build_aggregator("dtfd", D, 2)
    assert model(torch.randn(9, D)).aux_loss is None


# ---------------------------------------------------------------- Nystrom attention
def _record_input(module: torch.nn.Module, seen: dict) -> None:
    """Keep the first positional input of ``module``'s next call in ``seen["x"]``."""

    def hook(mod, args):
        seen.setdefault("x", args[0].detach())

    module.register_forward_pre_hook(hook)


def _exact_out(attn: NystromAttention, x: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention with the module's projections (and its V convolution)."""
    q, k, v = attn._qkv(x)
    a = torch.softmax(q @ k.transpose(-1, -2), -1)
    o = a @ v
    if attn.res_conv is not None:
        o = o + attn.res_conv(v)
    return attn.to_out(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


@pytest.mark.parametrize("n", [1, 7, 64, 100])
def test_nystrom_equals_exact_attention_when_n_at_most_landmarks(n: int) -> None:
    torch.manual_seed(6)
    # the landmarks are then the tokens themselves: exact up to the iterative pseudo-inverse,
    # which converges to float64 precision with enough iterations (6, the default, is ~1e-2)
    attn = NystromAttention(32, heads=4, dim_head=8, num_landmarks=100, pinv_iterations=40, mode="masked").double()
    x = torch.randn(2, n, 32, dtype=torch.float64)
    out, row = attn(x, return_row=0)
    torch.testing.assert_close(out, _exact_out(attn, x), atol=1e-9, rtol=0)
    exact_row = attn.exact_attention(x)[:, :, 0].mean(1)
    torch.testing.assert_close(row, exact_row, atol=1e-9, rtol=0)


@pytest.mark.parametrize("mode", NYSTROM_MODES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("i", [0, 3, 150, 299])
def test_nystrom_output_token_i_belongs_to_input_token_i(mode: str, residual: bool, i: int) -> None:
    # 300 tokens, 32 landmarks: left padding of 20; perturbing input i must change output i most
    # (the nystrom-attention 0.0.9 slicing bug would move the change to another position)
    torch.manual_seed(7)
    attn = NystromAttention(64, heads=4, dim_head=16, num_landmarks=32, residual=residual, mode=mode).double()
    centres = torch.randn(8, 64, dtype=torch.float64) * 2
    x = (centres[torch.randint(0, 8, (300,))] + 0.05 * torch.randn(300, 64, dtype=torch.float64))[None]
    x2 = x.clone()
    x2[0, i] += 0.5 * torch.randn(64, dtype=torch.float64)
    with torch.no_grad():
        change = (attn(x2) - attn(x)).norm(dim=-1)[0]
    assert int(change.argmax()) == i
    assert change[i] > 1.5 * change[torch.arange(300) != i].max()


def test_nystrom_padding_is_masked() -> None:
    # masked mode: adding zero tokens at the front must not change the other outputs when n <= landmarks
    torch.manual_seed(8)
    attn = NystromAttention(16, heads=2, dim_head=8, num_landmarks=16, pinv_iterations=40, residual=False, mode="masked").double()
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    exact = _exact_out(attn, x)
    torch.testing.assert_close(attn(x), exact, atol=1e-9, rtol=0)  # 6 pads inside, invisible


# ---------------------------------------------------------------- TransMIL
@pytest.mark.parametrize("n", [1, 2, 255, 256, 257])
def test_transmil_padded_length_and_runs(n: int) -> None:
    torch.manual_seed(9)
    model = build_aggregator("transmil", D, 2)
    seen: dict = {}
    _record_input(model.layer1, seen)
    out = model(torch.randn(n, D))
    assert seen["x"].shape[1] == math.ceil(math.sqrt(n)) ** 2 + 1
    assert out.logits.shape == (2,) and out.attention.shape == (n,)
    out.logits.sum().backward()
    assert torch.isfinite(out.attention).all()


def test_transmil_pads_with_duplicates_of_the_first_tokens() -> None:
    torch.manual_seed(10)
    model = build_aggregator("transmil", D, 2, dropout=0.0).double()
    z = torch.randn(6, D, dtype=torch.float64)
    seen: dict = {}
    _record_input(model.layer1, seen)
    model(z)
    h = model.embed(z)
    expected = torch.cat([model.cls_token[0], h, h[:3]])  # 6 -> 9 tokens, then CLS
    torch.testing.assert_close(seen["x"][0], expected)


def test_transmil_cls_attention_equals_exact_row() -> None:
    torch.manual_seed(11)
    n = 30  # 36 + 1 tokens <= 64 landmarks: masked Nystrom is exact
    model = TransMIL(D, 2, dim=64, num_landmarks=64, pinv_iterations=40, dropout=0.0, nystrom="masked").double().eval()
    z = torch.randn(n, D, dtype=torch.float64)
    seen: dict = {}
    _record_input(model.layer2, seen)
    out = model(z)
    layer = model.layer2
    full = layer.attn.exact_attention(layer.norm(seen["x"]))  # [1, heads, 37, 37]
    cls_row = full[0, :, 0, 1:].mean(0)  # CLS -> the 36 padded tokens
    index = torch.arange(36) % n
    expected = torch.zeros(n, dtype=torch.float64).index_add(0, index, cls_row)
    torch.testing.assert_close(out.attention, expected, atol=1e-9, rtol=0)
    # and the exact row sums to one with the CLS self-weight
    assert abs(float((expected.sum() + full[0, :, 0, 0].mean()).detach()) - 1) < 1e-9


# ---------------------------------------------------------------- mean and max pooling
def _projected(model, z: torch.Tensor) -> torch.Tensor:
    """h = relu(W z + b), written out (eval mode: dropout is the identity)."""
    return torch.relu(z @ model.project[0].weight.T + model.project[0].bias)


def test_mean_pool_matches_formula_uniform_attention_and_permutation() -> None:
    torch.manual_seed(6)
    model = build_aggregator("mean", D, 3, hidden=16).double().eval()
    z = torch.randn(13, D, dtype=torch.float64)
    out = model(z)
    h = _projected(model, z)
    expect = h.sum(0) / 13 @ model.classifier.weight.T + model.classifier.bias
    torch.testing.assert_close(out.logits, expect)
    torch.testing.assert_close(out.attention, torch.full((13,), 1 / 13, dtype=torch.float64))
    assert out.attention_raw is None
    perm = torch.randperm(13)
    torch.testing.assert_close(model(z[perm]).logits, out.logits)


def test_max_pool_matches_formula_and_scores_the_winning_instances() -> None:
    torch.manual_seed(7)
    model = build_aggregator("max", D, 2, hidden=32).double().eval()
    z = torch.randn(9, D, dtype=torch.float64, requires_grad=True)
    out = model(z)
    h = _projected(model, z).detach().numpy()
    # reference with numpy: elementwise max over instances, each instance's share of the argmaxes
    import numpy as np

    pooled = h.max(axis=0)
    winners = h.argmax(axis=0)
    share = np.array([(winners == i).sum() for i in range(9)]) / 32
    expect = pooled @ model.classifier.weight.detach().numpy().T + model.classifier.bias.detach().numpy()
    np.testing.assert_allclose(out.logits.detach().numpy(), expect, rtol=1e-12)
    np.testing.assert_allclose(out.attention.detach().numpy(), share, rtol=1e-12)
    assert abs(float(out.attention.sum()) - 1) < 1e-12
    # only the instances that win a dimension receive gradient
    out.logits[1].backward()
    grad_rows = z.grad.abs().sum(1).numpy()
    assert np.all(grad_rows[share == 0] == 0)
    perm = torch.randperm(9)
    out_p = model(z.detach()[perm])
    torch.testing.assert_close(out_p.logits, out.logits.detach())
    torch.testing.assert_close(out_p.attention, out.attention.detach()[perm])


@pytest.mark.parametrize("name", ["mean", "max"])
def test_pooling_single_instance_and_bad_options(name: str) -> None:
    model = build_aggregator(name, D, 2).double().eval()
    z = torch.randn(1, D, dtype=torch.float64)
    out = model(z)
    torch.testing.assert_close(out.logits, model.classifier(model.project(z)[0]))
    assert float(out.attention) == 1.0
    with pytest.raises(ValueError, match="dropout=1.5"):
        build_aggregator(name, D, 2, dropout=1.5)
    with pytest.raises(TypeError, match="bad option"):
        build_aggregator(name, D, 2, gated=True)
