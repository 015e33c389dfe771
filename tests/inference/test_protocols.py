import numpy as np
import pytest
import torch
from torch import nn

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.tasks.metrics import compute_metrics
from wsi_pipeline.config.evaluation import ALL, EvalProtocol, parse_protocol, parse_protocols
from wsi_pipeline.inference.protocols import embed_slide, predict_protocols, predict_slide, protocol_rng, repeat_probs, subset_indices
from wsi_pipeline.inference.protocol_metrics import validate_model
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.data.store import StoreWriter, open_store

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
    assert parse_protocol("sub2048x10") == EvalProtocol(2048, 10) and parse_protocol("sub256x100").name == "sub256x100"
    assert parse_protocols(["all", "sub4x3", "all"]) == [ALL, EvalProtocol(4, 3)]  # duplicates dropped, order kept
    assert parse_protocols(None) == [ALL] and parse_protocol(EvalProtocol(4, 3)) == EvalProtocol(4, 3)
    # the mean-probability ensemble has its own name, never the papers' sub<k>x<R>
    ens = parse_protocol("ens256x100")
    assert ens == EvalProtocol(256, 100, ensemble=True) and ens.name == "ens256x100" and not ens.per_repeat
    assert parse_protocol("sub256x100").per_repeat and not parse_protocol("sub256x100").ensemble
    assert parse_protocols(["sub4x3", "ens4x3"]) == [EvalProtocol(4, 3), EvalProtocol(4, 3, ensemble=True)]
    # one spelling: every other form is refused, naming the field, the value and the spelling
    for bad in ("256x100", "sub256X100", " sub4x3", "subsample4x3", "ensemble4x3", "sub4x", {"subsample": {"k": 4, "repeats": 3}},
                {"k": 4, "repeats": 3}, None, 4):
        with pytest.raises(ValueError, match=r"--protocol=.*; expected all, sub<k>x<R> .*ens<k>x<R>"):
            parse_protocol(bad, "--protocol")
    with pytest.raises(ValueError, match=r"protocols\[1\]='most'"):
        parse_protocols(["all", "most"])
    # the config's protocol is this one class
    from wsi_pipeline.config.pipeline import EvalProtocol as CfgProtocol

    assert CfgProtocol is EvalProtocol


def test_sub_and_ens_draw_the_same_subsets():
    a, b = EvalProtocol(5, 4), EvalProtocol(5, 4, ensemble=True)
    sa = subset_indices(40, a, protocol_rng(0, "s1", a))
    sb = subset_indices(40, b, protocol_rng(0, "s1", "ens5x4"))
    assert all(np.array_equal(x, y) for x, y in zip(sa, sb))


def test_embed_once_equals_per_subset_recomputation(store):
    enc, agg = _models()
    enc.train(), agg.train()  # predict_slide/embed_slide must switch to eval themselves
    prot = EvalProtocol(k=7, repeats=5)
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
    prot = EvalProtocol(k=5, repeats=6)
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
    big = predict_slide(agg, z, None, EvalProtocol(100, 10), protocol_rng(0, "s1", "x"))
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
    out = predict_protocols(enc, head, store, [ALL, EvalProtocol(5, 4), EvalProtocol(5, 4, ensemble=True)], slide_id="s1", batch_size=16)
    assert sum(calls) == len(store)  # every tile embedded exactly once for every protocol
    assert set(out) == {"all", "sub5x4", "ens5x4"}
    assert out["sub5x4"].attention is out["all"].attention
    assert out["ens5x4"].protocol == "ens5x4" and out["ens5x4"].repeat_probs.shape == (4, 2)
    np.testing.assert_array_equal(out["ens5x4"].repeat_probs, out["sub5x4"].repeat_probs)
    np.testing.assert_allclose(out["sub5x4"].probs, out["sub5x4"].repeat_probs.mean(0), rtol=1e-12)
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


def test_validation_under_a_subsample_protocol_embeds_only_its_subsets(store):
    """Validation's slide predictions read the tiles of the subsets only, and score them as when every
    tile was embedded (the reference: all tiles embedded, the same seeded subsets aggregated)."""
    from wsi_pipeline.inference.protocol_metrics import slide_predictions

    enc, agg = _models()
    prot = EvalProtocol(k=6, repeats=3)
    seen: list[int] = []
    orig = enc.forward
    enc.forward = lambda x: (seen.append(len(x)), orig(x))[1]
    got = slide_predictions(enc, agg, [store], prot, n_classes=2, batch_size=5, seed=4)[0]
    needed = np.unique(np.concatenate(subset_indices(len(store), prot, protocol_rng(4, "s1", prot))))
    assert len(needed) < len(store) and sum(seen) == len(needed)  # 3 subsets of 6 of 40 tiles
    enc.forward = orig
    ref = predict_slide(agg, embed_slide(enc, store), store.grid, prot, protocol_rng(4, "s1", prot), with_attention=False)
    # the same tiles through the same eval-mode encoder, in other batches: float32 rounding of the
    # convolution's sums (24 terms of size ~1 per output) bounds the difference well below 1e-5
    np.testing.assert_allclose(got.repeat_probs, ref.repeat_probs, rtol=0, atol=1e-5)
    assert got.n_tiles == len(store) and got.n_repeats == 3
    whole = slide_predictions(enc, agg, [store], ALL, n_classes=2, batch_size=5, seed=4)[0]
    np.testing.assert_allclose(whole.probs, predict_slide(agg, embed_slide(enc, store), None, ALL).probs, rtol=0, atol=1e-5)


def _slide_embeddings(n_slides=12, seed=0):
    """Per slide random embeddings [n, D] (some slides smaller than k) and a label that shifts them."""
    rng = np.random.default_rng(seed)
    labels = [i % 2 for i in range(n_slides)]
    zs = []
    for i, lab in enumerate(labels):
        n = 4 if i == 3 else int(rng.integers(10, 30))  # slide 3 has fewer tiles than k: one pass
        z = rng.normal(size=(n, D)) + 0.6 * lab * (rng.random((n, 1)) < 0.3)
        zs.append(torch.tensor(z, dtype=torch.float32))
    return zs, labels


def test_validate_model_per_repeat_and_ensemble_protocols_vs_sklearn():
    from sklearn.metrics import accuracy_score, cohen_kappa_score, roc_auc_score

    _, agg = _models()
    zs, labels = _slide_embeddings()
    ids = [f"slide{i}" for i in range(len(zs))]
    k, R = 6, 5
    y = np.asarray(labels)
    # reference: draw each slide's subsets, run the aggregator on each subset directly
    ref = np.zeros((R, len(zs)))  # P(class 1) of each slide in each repeat
    agg.eval()
    with torch.no_grad():
        for i, (z, sid) in enumerate(zip(zs, ids)):
            subsets = subset_indices(len(z), EvalProtocol(k, R), protocol_rng(0, sid, "sub6x5"))
            ps = [torch.softmax(agg(z[torch.as_tensor(idx)]).logits, 0)[1].item() for idx in subsets]
            ref[:, i] = ps if len(ps) == R else ps * R  # a one-pass slide counts in every repeat
    per_auc = [roc_auc_score(y, ref[r]) for r in range(R)]
    per_acc = [accuracy_score(y, ref[r] > 0.5) for r in range(R)]
    per_qwk = [cohen_kappa_score(y, (ref[r] > 0.5).astype(int), weights="quadratic") for r in range(R)]
    agg.train()
    sub = validate_model(None, agg, zs, labels, f"sub{k}x{R}", n_classes=2, slide_ids=ids)
    assert sub["auc"] == pytest.approx(np.mean(per_auc), abs=1e-6)
    assert sub["accuracy"] == pytest.approx(np.mean(per_acc))
    assert sub["qwk"] == pytest.approx(np.mean(per_qwk), abs=1e-6)
    assert sub["auc_repeat_std"] == pytest.approx(np.std(per_auc, ddof=1), abs=1e-6)
    ce = -np.log(np.where(y == 1, ref, 1 - ref))
    assert sub["loss"] == pytest.approx(ce.mean(), rel=1e-5)
    assert agg.training  # mode restored
    # the ensemble protocol: the metric of the probabilities averaged over repeats
    ens = validate_model(None, agg, zs, labels, f"ens{k}x{R}", n_classes=2, slide_ids=ids)
    assert ens["auc"] == pytest.approx(roc_auc_score(y, ref.mean(0)), abs=1e-6)
    assert ens["accuracy"] == pytest.approx(accuracy_score(y, ref.mean(0) > 0.5))
    assert "auc_repeat_std" not in ens
    # the two statistics of the same subsets are different numbers
    print(f"per-repeat AUC {sub['auc']:.4f} +- {sub['auc_repeat_std']:.4f}; ensemble AUC {ens['auc']:.4f}")
    assert not np.isclose(sub["auc"], ens["auc"])


def test_repeat_probs_broadcasts_one_pass_slides(store):
    _, agg = _models()
    z = torch.randn(40, D)
    many = predict_slide(agg, z, None, EvalProtocol(5, 3), protocol_rng(0, "a", "sub5x3"), with_attention=False)
    one = predict_slide(agg, z[:4], None, EvalProtocol(5, 3), protocol_rng(0, "b", "sub5x3"), with_attention=False)
    P = repeat_probs([many, one], 3)
    assert P.shape == (3, 2, 2)
    np.testing.assert_array_equal(P[:, 0], many.repeat_probs)
    np.testing.assert_array_equal(P[:, 1], np.repeat(one.repeat_probs, 3, axis=0))
    with pytest.raises(ValueError, match="has 3 repeats; expected 1 or 4"):
        repeat_probs([many], 4)
