import numpy as np
import pytest
import torch
from torch import nn

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.evaluation.metrics import compute_metrics
from wsi_pipeline.evaluation.protocols import (
    ALL,
    Protocol,
    embed_slide,
    parse_protocol,
    parse_protocols,
    predict_protocols,
    predict_slide,
    protocol_rng,
    subset_indices,
    validate_model,
)
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.tiling.store import StoreWriter, open_store

D = 8


class TinyEncoder(nn.Module):
    """Conv + BatchNorm + Dropout: eval mode matters, so a forgotten .eval() would show."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, D, 3, padding=1), nn.BatchNorm2d(D), nn.ReLU(), nn.Dropout(0.5))
        self.body[1].running_mean.normal_()
        self.body[1].running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.body(x).mean((2, 3))


class TinyABMIL(nn.Module):
    """Stand-in aggregator with the MILOutput contract (attention softmax over instances)."""

    def __init__(self, n_classes=2):
        super().__init__()
        self.att = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 1))
        self.cls = nn.Linear(D, n_classes)
        self.drop = nn.Dropout(0.5)

    def forward(self, z):
        a = torch.softmax(self.att(z).squeeze(1), 0)
        return MILOutput(logits=self.cls(self.drop(a @ z)), attention=a)


class GridHead(TinyABMIL):
    needs_grid = True

    def forward(self, z, grid):
        out = super().forward(z + grid.float().sum(1, keepdim=True) * 0.01)
        return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 40
    tiles = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    grid = np.stack([np.arange(n) % 8, np.arange(n) // 8], 1)
    w = StoreWriter(tmp_path_factory.mktemp("st") / "s1.zarr", tile_size=8, capacity=n, attrs={"slide_id": "s1"})
    w.append(tiles, grid * 8, grid, np.ones(n))
    return open_store(w.commit())


def _models(n_classes=2):
    torch.manual_seed(0)
    return TinyEncoder(), TinyABMIL(n_classes)


def test_parse_protocols():
    assert parse_protocol("all") is ALL
    assert parse_protocol({"subsample": {"k": 256, "repeats": 100}}) == Protocol(256, 100)
    assert parse_protocol("256x100").name == "sub256x100"
    assert parse_protocol("sub2048x10") == Protocol(2048, 10)
    assert parse_protocols(["all", {"subsample": {"k": 4, "repeats": 3}}, "all"]) == [ALL, Protocol(4, 3)]
    with pytest.raises(ValueError, match="expected keys k and repeats"):
        parse_protocol({"subsample": {"kk": 3}})
    with pytest.raises(ValueError, match="protocol 'most' not understood"):
        parse_protocol("most")


def test_embed_once_equals_per_subset_recomputation(store):
    enc, agg = _models()
    enc.train(), agg.train()  # predict_slide/embed_slide must switch to eval themselves
    prot = Protocol(k=7, repeats=5)
    z = embed_slide(enc, store, batch_size=6)
    assert enc.training and agg.training  # modes restored
    pred = predict_slide(agg, z, store.grid, prot, protocol_rng(3, "s1", prot))
    # reference: draw the same subsets, read and re-embed only those tiles, aggregate each
    subsets = subset_indices(len(store), prot, protocol_rng(3, "s1", prot))
    enc.eval(), agg.eval()
    ref = []
    with torch.no_grad():
        for idx in subsets:
            zi = enc(tiles_to_tensor(store.read(idx)))
            ref.append(torch.softmax(agg(zi).logits, 0).double().numpy())
        att_ref = agg(enc(tiles_to_tensor(store.read()))).attention.numpy()
    ref = np.stack(ref)
    np.testing.assert_allclose(pred.probs, ref.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pred.prob_std, ref.std(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(pred.attention, att_ref, rtol=1e-5, atol=1e-7)
    assert pred.n_repeats == 5 and pred.n_tiles == 40 and pred.protocol == "sub7x5"


def test_repeats_reproducible_and_different(store):
    enc, agg = _models()
    z = embed_slide(enc, store)
    prot = Protocol(k=5, repeats=6)
    a = subset_indices(len(store), prot, protocol_rng(0, "s1", prot))
    b = subset_indices(len(store), prot, protocol_rng(0, "s1", prot))
    c = subset_indices(len(store), prot, protocol_rng(1, "s1", prot))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert len({tuple(x) for x in a}) == 6  # repeats differ from each other
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))  # another seed, other subsets
    assert all(len(set(x)) == 5 and np.all(np.diff(x) > 0) for x in a)  # distinct tiles, store order
    p1 = predict_slide(agg, z, None, prot, protocol_rng(0, "s1", prot))
    p2 = predict_slide(agg, z, None, prot, protocol_rng(0, "s1", prot))
    np.testing.assert_array_equal(p1.probs, p2.probs)
    assert p1.prob_std.max() > 0


def test_all_and_large_k_use_every_tile_once(store):
    enc, agg = _models()
    z = embed_slide(enc, store)
    full = predict_slide(agg, z, None, ALL)
    big = predict_slide(agg, z, None, Protocol(100, 10), protocol_rng(0, "s1", "x"))
    assert big.n_repeats == 1 and full.n_repeats == 1
    np.testing.assert_allclose(big.probs, full.probs)
    assert full.prob_std.tolist() == [0.0, 0.0]


def test_predict_protocols_embeds_once_and_passes_grid(store):
    enc, _ = _models()
    calls = []
    orig = enc.forward
    enc.forward = lambda x: (calls.append(len(x)), orig(x))[1]
    torch.manual_seed(1)
    head = GridHead()
    out = predict_protocols(enc, head, store, [ALL, Protocol(5, 4)], slide_id="s1", batch_size=16)
    assert sum(calls) == len(store)  # every tile embedded exactly once for both protocols
    assert set(out) == {"all", "sub5x4"}
    assert out["sub5x4"].attention is out["all"].attention
    with pytest.raises(ValueError, match="needs the tile grid"):
        predict_slide(head, torch.zeros(3, D), None, ALL)


def test_validate_model_matches_compute_metrics(store, tmp_path):
    enc, agg = _models()
    # three "slides": the store, its path, and precomputed embeddings of the same tiles
    z = embed_slide(enc, store)
    slides = [store, store.path, z]
    labels = [0, 1, 1]
    m = validate_model(enc, agg, slides, labels, "all", n_classes=2)
    probs = np.stack([predict_slide(agg, z, None, ALL).probs] * 3)
    ref = compute_metrics(labels, probs, 2)
    for k in ("accuracy", "auc", "qwk"):
        assert m[k] == pytest.approx(ref[k], nan_ok=True)
    assert m["loss"] == pytest.approx(-np.mean(np.log(probs[[0, 1, 2], labels])))
    with pytest.raises(ValueError, match="3 slides but 2 labels"):
        validate_model(enc, agg, slides, [0, 1], n_classes=2)
