"""PatchGD: Z block layout, inner-iteration sampling, exact gradients, memory, heads, learning.

References are computed here by plain autograd (every tile embedded with gradient, the
non-sampled ones detached by hand), by brute-force loops and by scikit-learn.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.models.heads import HEADS, CNNHead, PaperCNNHead, build_head, grid_layout, tiles_to_z
from wsi_pipeline.data.store import StoreWriter, open_store
from wsi_pipeline.config.patchgd import PatchGDConfig
from wsi_pipeline.training.patchgd import PatchGDTrainer
from wsi_pipeline.training.patchgd_plan import accumulation_windows, plan_inner_iterations


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """These tests run many small ops, one after the other: see ``one_thread`` in conftest."""


class TinyEncoder(nn.Module):
    """A small CNN with a BatchNorm whose running statistics are not the identity."""

    def __init__(self, d: int = 12, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, d, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        bn = self.net[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        self.num_features = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[0].weight.dtype))


def make_store(path: Path, grid: np.ndarray, tile: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    grid = np.asarray(grid, np.int32)
    n = len(grid)
    tiles = rng.integers(0, 256, (n, tile, tile, 3), dtype=np.uint8)
    w = StoreWriter(path, tile_size=tile, capacity=n, attrs={"slide_id": path.stem})
    w.append(tiles, grid.astype(np.int64) * tile, grid, np.ones(n, np.float32))
    w.commit()
    return open_store(path)


def block_grid(rows: int, cols: int, row0: int = 0, col0: int = 0, drop: int = 0, seed: int = 0) -> np.ndarray:
    """(col, row) cells of a rows x cols block at (row0, col0), minus ``drop`` random cells (keeping corners)."""
    r, c = np.mgrid[0:rows, 0:cols]
    g = np.stack([c.ravel() + col0, r.ravel() + row0], 1)
    if drop:
        rng = np.random.default_rng(seed)
        corners = {0, cols - 1, (rows - 1) * cols, rows * cols - 1}
        cand = [i for i in range(len(g)) if i not in corners]
        g = np.delete(g, rng.choice(cand, drop, replace=False), axis=0)
    return np.random.default_rng(seed + 1).permutation(g)  # store order is not raster order


def models(d: int = 12, n_classes: int = 2, dtype=torch.float64, **head_kw):
    enc = TinyEncoder(d).to(dtype)
    head = build_head("cnn", d, n_classes, **{"width": 8, "dropout": 0.0, **head_kw}).to(dtype)
    return enc, head


def grads(modules) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for m in modules for p in m.parameters()]


def flat_params(modules) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for m in modules for p in m.parameters()])


# ----------------------------------------------------------------------------------------------
# Z block
# ----------------------------------------------------------------------------------------------


def test_z_cell_is_encoder_of_tile_at_grid_position_in_spatial_layout(tmp_path):
    grid = block_grid(3, 7, row0=5, col0=2, drop=4)  # 3 rows (y) x 7 cols (x): a transpose has another shape
    store = make_store(tmp_path / "s.zarr", grid)
    enc, head = models()
    enc.train()  # the loop trains in train mode; the fill must still use the frozen statistics
    strat = PatchGDTrainer({"patchgd": {}}, enc, head, 2)
    z, mask, layout = strat.fill_z(store)
    assert z.shape == (1, 12, 3, 7) and mask.shape == (1, 3, 7)
    assert layout.origin == (5, 2) and layout.factor == 1
    tiles = store.read()
    enc.eval()
    with torch.no_grad():
        for i, (col, row) in enumerate(store.grid):
            expect = enc(tiles_to_tensor(tiles[i : i + 1]))[0]
            torch.testing.assert_close(z[0, :, row - 5, col - 2], expect, rtol=1e-12, atol=1e-12)
    brute = np.zeros((3, 7), bool)
    brute[store.grid[:, 1] - 5, store.grid[:, 0] - 2] = True
    assert np.array_equal(mask[0].numpy(), brute)
    assert torch.count_nonzero(z[0][:, ~mask[0]]) == 0


def test_grid_cap_pools_neighbouring_cells_by_mean():
    g = block_grid(10, 23, row0=3, col0=40, drop=30)
    lay = grid_layout(g, max_grid=8)  # longer side 23 -> f = 3 -> 4 x 8 cells
    assert lay.factor == 3 and lay.shape == (4, 8)
    emb = torch.randn(len(g), 5, dtype=torch.float64)
    z = tiles_to_z(emb, lay)
    for r in range(4):
        for c in range(8):
            inside = [i for i, (col, row) in enumerate(g) if (row - 3) // 3 == r and (col - 40) // 3 == c]
            if inside:
                torch.testing.assert_close(z[0, :, r, c], emb[inside].mean(0))
                assert lay.mask[r, c]
            else:
                assert not lay.mask[r, c] and torch.all(z[0, :, r, c] == 0)


# ----------------------------------------------------------------------------------------------
# sampling and accumulation windows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k", "zeta"), [(12, 4, 9), (10, 3, 13), (7, 7, 3), (5, 1, 11)])
def test_every_tile_sampled_exactly_once_per_pass(n, k, zeta):
    plan = plan_inner_iterations(n, k, zeta, torch.Generator().manual_seed(3))
    assert len(plan) == zeta and all(len(p) == k for p in plan)
    assert all(len(set(p.tolist())) == k for p in plan), "a tile twice in one inner iteration"
    stream = torch.cat(plan).tolist()
    for start in range(0, len(stream) - n + 1, n):
        assert sorted(stream[start : start + n]) == list(range(n)), f"pass at draw {start} is not a permutation"
    tail = stream[len(stream) // n * n :]
    assert len(set(tail)) == len(tail)


def test_windows_and_config_errors():
    assert accumulation_windows(6, 6) == [6]
    assert accumulation_windows(5, 2) == [2, 2, 1]
    with pytest.raises(ValueError, match=r"unknown key 'zetta' in section 'patchgd'"):
        PatchGDConfig.from_mapping({"zetta": 3})
    with pytest.raises(ValueError, match="patchgd.fraction"):
        PatchGDConfig.from_mapping({"fraction": 1.5})
    with pytest.raises(ValueError, match="backbone_scale"):
        PatchGDConfig.from_mapping({"backbone_scale": "half"})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['depth'\]"):
        build_head("cnn", 4, 2, depth=3)
    with pytest.raises(ValueError, match="unknown patchgd head 'mlp'"):
        build_head("mlp", 4, 2)
    with pytest.raises(ValueError, match=r"grid must be an integer array \[n, 2\]"):
        grid_layout(np.zeros((3, 3), int))
    cfg = PatchGDConfig(fraction=0.3)
    assert cfg.tiles_per_iteration(10) == 3 and cfg.inner_iterations(10) == 4


# ----------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------


def run_bag(store, enc, head, seed=0, **options):
    """bag_step with gradients captured at each optimiser step (then zeroed)."""
    strat = PatchGDTrainer({"patchgd": options}, enc, head, head.n_classes)
    steps: list[list[torch.Tensor]] = []

    def step() -> None:
        steps.append(grads([enc, head]))
        for m in (enc, head):
            m.zero_grad(set_to_none=True)

    loss = strat.bag_step(store, 1, step, torch.Generator().manual_seed(seed))
    return strat, steps, loss


def reference_grads(store, enc, head, plan, label=1):
    """Plain autograd: every tile embedded with gradient; iteration j keeps rows plan[j] live, the rest detached."""
    enc.eval()
    x = tiles_to_tensor(store.read())
    emb = enc(x)
    lay = head.layout(store.grid)
    target = torch.tensor([label])
    losses = []
    for idx in plan:
        live = torch.zeros(len(emb), 1, dtype=torch.bool)
        live[idx] = True
        mixed = torch.where(live, emb, emb.detach())
        losses.append(F.cross_entropy(head(mixed, layout=lay).logits[None], target))
    mean_loss = torch.stack(losses).mean()
    params = [p for m in (enc, head) for p in m.parameters()]
    full_loss = F.cross_entropy(head(emb, layout=lay).logits[None], target)
    g_mean = torch.autograd.grad(mean_loss, params, allow_unused=True, retain_graph=True)
    g_full = torch.autograd.grad(full_loss, params, allow_unused=True)
    fix = lambda gs: [g if g is not None else torch.zeros_like(p) for g, p in zip(gs, params)]  # noqa: E731
    return fix(g_mean), fix(g_full), float(mean_loss.detach())


def split(gs, enc):
    n_enc = len(list(enc.parameters()))
    return gs[:n_enc], gs[n_enc:]


def assert_all_close(a, b, scale=1.0):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y * scale, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("n_rows", "k", "zeta"), [(3, 4, 3), (2, 3, 5)])
def test_epsilon_equals_zeta_gives_mean_loss_gradient(tmp_path, n_rows, k, zeta):
    """Head: gradient of the mean loss over the inner iterations; encoder: the same times n/k (full) or 1 (paper)."""
    store = make_store(tmp_path / "s.zarr", block_grid(n_rows, 4, row0=1, col0=2, drop=0))
    n = len(store)
    results = {}
    for scale_mode in ("full", "paper"):
        enc, head = models()
        enc.train()
        head.train()  # masked BatchNorm on batch statistics; dropout 0
        bn_before = enc.net[1].running_mean.clone()
        strat, steps, loss = run_bag(store, enc, head, k=k, zeta=zeta, epsilon=zeta, backbone_scale=scale_mode)
        assert len(steps) == 1
        assert torch.equal(enc.net[1].running_mean, bn_before), "frozen BatchNorm statistics changed"
        enc2, head2 = models()
        head2.load_state_dict(head.state_dict())  # same init (seeded), running stats irrelevant to grads
        head2.train()
        g_mean, g_full, ref_loss = reference_grads(store, enc2, head2, strat.last_plan)
        got_enc, got_head = split(steps[0], enc)
        ref_enc, ref_head = split(g_mean, enc2)
        assert_all_close(got_head, ref_head)
        assert_all_close(got_enc, ref_enc, scale=n / k if scale_mode == "full" else 1.0)
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        results[scale_mode] = (steps[0], g_full)
    if zeta * k == n:  # one exact pass: full mode gives the whole slide's gradient, paper mode 1/epsilon of it
        got, g_full = results["full"]
        assert_all_close(got, g_full)
        got_p, _ = results["paper"]
        enc_p, head_p = split(got_p, enc)
        enc_f, head_f = split(g_full, enc)
        assert_all_close(head_p, head_f)
        assert_all_close(enc_p, enc_f, scale=1.0 / zeta)


def test_gradient_flows_only_through_sampled_tiles(tmp_path):
    store = make_store(tmp_path / "s.zarr", block_grid(3, 4, drop=2))
    enc, head = models()
    live_batches: list[int] = []
    enc.register_forward_hook(lambda m, i, o: live_batches.append(len(i[0])) if torch.is_grad_enabled() else None)
    strat, steps, _ = run_bag(store, enc, head, k=3, zeta=1, backbone_scale="paper")
    assert live_batches == [3], "only the k sampled tiles may be embedded with gradient"
    enc2, head2 = models()
    head2.load_state_dict(head.state_dict())
    g_mean, g_full, _ = reference_grads(store, enc2, head2, strat.last_plan)
    got_enc, _ = split(steps[0], enc)
    assert_all_close(got_enc, split(g_mean, enc2)[0])
    # ... and that is not the gradient through all tiles
    full_enc = split(g_full, enc2)[0]
    assert max(float((a - b).abs().max()) for a, b in zip(got_enc, full_enc)) > 1e-6


def test_fresh_embeddings_stay_in_z_for_later_iterations(tmp_path):
    """Z at iteration j: tiles sampled before j hold their latest live embedding, the others the fill."""
    store = make_store(tmp_path / "s.zarr", block_grid(2, 3))
    enc, head = models(dtype=torch.float32)
    opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.05)
    live_out: list[torch.Tensor] = []
    head_in: list[torch.Tensor] = []
    enc.register_forward_hook(lambda m, i, o: live_out.append(o.detach().clone()) if torch.is_grad_enabled() else None)
    head.register_forward_pre_hook(lambda m, a: head_in.append(a[0].detach().clone()))
    strat = PatchGDTrainer({"patchgd": {"k": 2, "zeta": 3, "epsilon": 1}}, enc, head, 2)
    enc.eval()
    with torch.no_grad():
        fill = enc(tiles_to_tensor(store.read()))
    strat.bag_step(store, 1, lambda: (opt.step(), opt.zero_grad()), torch.Generator().manual_seed(0))
    plan = strat.last_plan
    for j in range(3):
        expect = fill.clone()
        for i in range(j + 1):
            expect[plan[i]] = live_out[i]
        torch.testing.assert_close(head_in[j], expect)
    assert not torch.allclose(live_out[2], fill[plan[2]]), "parameters changed, so must the fresh embeddings"


def test_parameters_change_only_at_optimizer_steps(tmp_path):
    store = make_store(tmp_path / "s.zarr", block_grid(3, 4))
    enc, head = models(dtype=torch.float32)
    opt = torch.optim.SGD([p for m in (enc, head) for p in m.parameters()], lr=0.01)
    seen: list[torch.Tensor] = []
    enc.register_forward_pre_hook(lambda m, i: seen.append(flat_params([enc, head])) if torch.is_grad_enabled() else None)
    n_steps = []

    def step() -> None:
        assert all(p.grad is not None for p in enc.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_steps.append(1)

    strat = PatchGDTrainer({"patchgd": {"k": 2, "zeta": 5, "epsilon": 2}}, enc, head, 2)
    strat.bag_step(store, 0, step, torch.Generator().manual_seed(0))
    assert len(n_steps) == 3 and len(seen) == 5  # windows 2, 2, 1
    same = [torch.equal(seen[i], seen[i + 1]) for i in range(4)]
    assert same == [True, False, True, False]


def test_method_config_plumbing(tmp_path):
    from types import SimpleNamespace

    from wsi_pipeline.models.heads import TransformerHead

    enc = TinyEncoder(6)
    method = SimpleNamespace(
        encoder=SimpleNamespace(bn="train"),
        aggregator=SimpleNamespace(name="cnn", options={"width": 4}),
        patchgd={"k": 2, "max_grid": 3},
    )
    strat = PatchGDTrainer(method, enc, None, 2)
    assert isinstance(strat.head, CNNHead) and strat.head.convs[0].out_channels == 4
    assert strat.cfg.freeze_bn is False and strat.head.max_grid == 3
    # a head built elsewhere takes the strategy's grid cap; the projection must match
    head = build_head("transformer", 6, 2, dim=8, max_grid=50)
    PatchGDTrainer({"patchgd": {"max_grid": 7}}, enc, head, 2)
    assert head.max_grid == 7
    with pytest.raises(ValueError, match="patchgd.proj_dim=4 but the head was built with proj_dim=6"):
        PatchGDTrainer({"patchgd": {"proj_dim": 4}}, enc, head, 2)
    with pytest.raises(ValueError, match="n_classes=3 but the head was built for 2 classes"):
        PatchGDTrainer({}, enc, head, 3)
    with pytest.raises(TypeError, match="PatchGD needs a grid head"):
        PatchGDTrainer({}, enc, nn.Linear(6, 2), 2)
    assert isinstance(PatchGDTrainer({"aggregator": {"name": "abmil"}}, enc, None, 2).head, CNNHead)
    method = {"aggregator": {"name": "transformer", "options": {"dim": 8}}, "patchgd": {}}
    assert isinstance(PatchGDTrainer(method, enc, None, 2).head, TransformerHead)
    store = make_store(tmp_path / "s.zarr", block_grid(2, 3))
    with pytest.raises(ValueError, match=r"label=2 outside \[0, n_classes=2\)"):
        strat.bag_step(store, 2, lambda: None)


@pytest.mark.parametrize("freeze", [True, False])
def test_encoder_batchnorm_frozen_or_live(tmp_path, freeze):
    store = make_store(tmp_path / "s.zarr", block_grid(3, 3))
    enc, head = models(dtype=torch.float32)
    enc.train()
    before = enc.net[1].running_mean.clone()
    strat = PatchGDTrainer({"patchgd": {"k": 3, "freeze_bn": freeze}}, enc, head, 2)
    strat.bag_step(store, 1, lambda: None, torch.Generator().manual_seed(0))
    assert torch.equal(enc.net[1].running_mean, before) == freeze
    assert enc.training and enc.net[1].training  # modes restored


# ----------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------


def saved_bytes(enc, fn) -> tuple[int, int]:
    """(bytes saved for backward while ``enc`` runs, bytes saved elsewhere) during ``fn()``."""
    state = {"in_enc": False, "enc": 0, "other": 0, "seen": set()}
    h1 = enc.register_forward_pre_hook(lambda m, i: state.update(in_enc=True))
    h2 = enc.register_forward_hook(lambda m, i, o: state.update(in_enc=False))

    def pack(t: torch.Tensor):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in state["seen"]:
            state["seen"].add(key)
            state["enc" if state["in_enc"] else "other"] += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        h1.remove()
        h2.remove()
    return state["enc"], state["other"]


def test_saved_activations_bounded_by_k_tiles_not_slide_size(tmp_path):
    small = make_store(tmp_path / "small.zarr", block_grid(4, 4), tile=32)
    big = make_store(tmp_path / "big.zarr", block_grid(20, 20), tile=32)
    k = 4
    enc, head = models(d=8, dtype=torch.float32)
    noop = lambda: None  # noqa: E731
    measured = {}
    for name, store in (("small", small), ("big", big)):
        strat = PatchGDTrainer({"patchgd": {"k": k, "zeta": 1}}, enc, head, 2)
        measured[name] = saved_bytes(enc, lambda s=store, st=strat: st.bag_step(s, 1, noop, torch.Generator().manual_seed(0)))
        enc.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
    # reference: what a plain encoder forward of k tiles with gradient saves
    enc.eval()
    ref_k, _ = saved_bytes(enc, lambda: enc(tiles_to_tensor(big.read(np.arange(k)))).sum())
    ref_all, _ = saved_bytes(enc, lambda: enc(tiles_to_tensor(big.read())).sum())
    (enc_small, other_small), (enc_big, other_big) = measured["small"], measured["big"]
    assert enc_small == enc_big == ref_k
    # the rest (Z, head) grows with the grid, far below the encoder activations of the extra tiles
    per_tile_encoder = ref_all / len(big)
    growth_per_tile = (other_big - other_small) / (len(big) - len(small))
    assert growth_per_tile < 0.1 * per_tile_encoder
    assert enc_big + other_big < 0.2 * ref_all


# ----------------------------------------------------------------------------------------------
# heads
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HEADS.names())
@pytest.mark.parametrize(("rows", "cols", "cap"), [(1, 1, None), (1, 9, None), (6, 2, None), (5, 7, None), (40, 3, 8)])
def test_heads_take_any_grid_size(name, rows, cols, cap):
    torch.manual_seed(0)
    opts = {"dim": 16} if name == "transformer" else {"width": 8}
    if name == "cnn_paper":
        # its Z has a fixed side (grids up to it are padded, larger ones pooled); at least 9 cells,
        # so that its last BatchNorm sees more than one value of a single slide in training mode
        cap = max(cap or 9, 9)
    head = build_head(name, 6, 3, max_grid=cap, proj_dim=4, **opts)
    g = block_grid(rows, cols, row0=2, col0=1)
    z = torch.randn(len(g), 6, requires_grad=True)
    out = head(z, g)
    assert out.logits.shape == (3,) and torch.isfinite(out.logits).all() and out.attention.shape == (len(g),)
    out.logits.sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    head.eval()
    perm = torch.randperm(len(g))  # tile order does not matter, only grid positions
    torch.testing.assert_close(head(z[perm], g[perm.numpy()]).logits, head(z, g).logits, rtol=1e-5, atol=1e-6)


HEAD_VARIANTS = [
    ("cnn", {"width": 8, "dropout": 0.0}),
    ("cnn", {"width": 8, "dropout": 0.0, "norm": "layer", "pool": "meanmax"}),
    ("cnn", {"width": 8, "dropout": 0.0, "norm": "none", "partial": False, "pool": "max"}),
    ("transformer", {"dim": 16, "dropout": 0.0}),
]
#: The paper's head is not mask-aware (plain convolutions and BatchNorm over every cell, as on
#: whole images): background cells are zero in its Z, tested in test_paper_cnn_head_by_hand.
UNMASKED_HEADS = ["cnn_paper"]


def test_head_variants_cover_the_registry():
    assert sorted({name for name, _ in HEAD_VARIANTS} | set(UNMASKED_HEADS)) == HEADS.names()


@pytest.mark.parametrize(("name", "opts"), HEAD_VARIANTS)
@pytest.mark.parametrize("train", [False, True])
def test_masked_cells_do_not_influence_heads(name, opts, train):
    torch.manual_seed(1)
    head = build_head(name, 5, 2, **opts).train(train)
    z = torch.randn(2, 5, 9, 6)
    mask = torch.rand(2, 9, 6) > 0.5
    mask[:, 0, 0] = True
    other = torch.where(mask[:, None], z, 100 * torch.randn_like(z))
    torch.testing.assert_close(head.forward_z(z, mask), head.forward_z(other, mask))
    if not train:  # a batch of two slides equals the slides one at a time
        each = torch.cat([head.forward_z(z[i : i + 1], mask[i : i + 1]) for i in range(2)])
        torch.testing.assert_close(head.forward_z(z, mask), each, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", HEADS.names())
def test_attention_is_gradient_times_activation(name):
    torch.manual_seed(2)
    opts = {"dim": 16} if name == "transformer" else {"width": 8}
    head = build_head(name, 6, 2, max_grid=3, **opts).eval()
    g = block_grid(5, 4, drop=3)
    z = torch.randn(len(g), 6)
    with torch.inference_mode():  # evaluation may run in inference mode
        out = head(z, g)
    zz = z.clone().requires_grad_(True)
    logits = head(zz, g).logits
    (grad,) = torch.autograd.grad(logits[1] - logits[0], zz)
    torch.testing.assert_close(out.attention, (grad * z).sum(1))
    assert all(p.grad is None for p in head.parameters())


def test_cnn_head_architecture_follows_the_paper():
    head = CNNHead(16, 2)
    assert [c.stride[0] for c in head.convs] == [1, 2, 2, 2]
    assert all(c.out_channels == 256 and c.kernel_size == (3, 3) for c in head.convs)
    assert head.drop.p == pytest.approx(0.2) and isinstance(head.drop, nn.Dropout2d)
    assert head.needs_grid


# ----------------------------------------------------------------------------------------------
# learning
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_patchgd_learns_planted_lesions(tmp_path):
    """End to end on the synthetic cohort: ResNet-18 + transformer head, half the tiles per inner iteration."""
    from sklearn.metrics import roc_auc_score

    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.data.store import store_path

    try:
        from wsi_pipeline.models import build_encoder

        torch.manual_seed(0)
        enc = build_encoder("resnet18")
    except (ImportError, AttributeError):
        enc = TinyEncoder(32).float()
    manifest = make_store_cohort(tmp_path, n_slides=32, tile_size=32, splits={"train": 0.375, "val": 0.625}, seed=1)
    df = read_manifest(manifest)
    stores = {s: open_store(store_path(tmp_path / "tiles", s)) for s in df.slide_id}
    train, val = df[df.split == "train"], df[df.split == "val"]
    torch.manual_seed(0)
    method = {"encoder": {"bn": "frozen"}, "aggregator": {"name": "transformer"}, "patchgd": {"fraction": 0.5}}
    strat = PatchGDTrainer(method, enc, None, 2)
    head = strat.head
    assert type(head).__name__ == "TransformerHead"
    enc_before = flat_params([enc])
    opt = torch.optim.Adam(
        [{"params": enc.parameters(), "lr": 2e-5}, {"params": head.parameters(), "lr": 1e-3}], weight_decay=1e-4
    )
    n_steps = []

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_steps.append(1)

    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(5):
        enc.train()
        head.train()
        for i in torch.randperm(len(train), generator=gen).tolist():
            row = train.iloc[i]
            strat.bag_step(stores[row.slide_id], int(row.label), step, gen)
    assert len(n_steps) == 5 * len(train)  # epsilon = zeta: one optimiser step per slide
    probs = [float(torch.softmax(strat.predict(stores[s]).logits, 0)[1]) for s in val.slide_id]
    auc = roc_auc_score(val.label.astype(int), probs)
    assert auc >= 0.85, f"validation AUC {auc:.3f} after {time.perf_counter() - t0:.1f} s"
    assert float((flat_params([enc]) - enc_before).abs().max()) > 1e-5, "the encoder did not change"


# ----------------------------------------------------------------------------------------------
# exactness: when the step's gradient is the all-tiles gradient, and when it is not
# ----------------------------------------------------------------------------------------------


def all_tiles_grads(store, enc, head, label=1):
    """Plain autograd: the slide's loss with every tile embedded with gradient (frozen encoder BatchNorm)."""
    enc.eval()
    emb = enc(tiles_to_tensor(store.read()))
    loss = F.cross_entropy(head(emb, store.grid).logits[None], torch.tensor([label]))
    params = [p for m in (enc, head) for p in m.parameters()]
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


def rel_err(got, ref) -> float:
    a = torch.cat([g.reshape(-1) for g in got])
    b = torch.cat([g.reshape(-1) for g in ref])
    return float((a - b).norm() / b.norm())


# float64 throughout: both sides compute the same sums in different orders, a few thousand
# operations per gradient entry at unit round-off 1.1e-16, so an exact method stays far below
# 1e-10; an inexact one is off by far more than 1e-3.
EXACT_BOUND, INEXACT_BOUND = 1e-10, 1e-3


@pytest.mark.parametrize(
    ("rows", "cols", "k", "dropout", "exact"),
    [
        (3, 4, 4, 0.0, True),    # n = 12, k = 4 divides it: one pass, every tile live once
        (1, 13, 4, 0.0, False),  # n = 13, k = 4: zeta = 4, the last iteration wraps, 3 tiles live twice
        (3, 4, 4, 0.2, False),   # exact setting but head dropout 0.2: a fresh mask per inner iteration
    ],
)
def test_step_gradient_equals_all_tiles_autograd_exactly_when_k_divides_n_without_dropout(tmp_path, rows, cols, k, dropout, exact):
    store = make_store(tmp_path / "s.zarr", block_grid(rows, cols))
    enc, head = models(dropout=dropout)
    enc.train()
    head.train()
    torch.manual_seed(5)  # the first inner iteration draws the reference's dropout mask
    strat, steps, _ = run_bag(store, enc, head, k=k)  # defaults: backbone_scale full, epsilon = zeta
    assert len(steps) == 1
    enc2, head2 = models(dropout=dropout)
    head2.load_state_dict(head.state_dict())
    head2.train()
    torch.manual_seed(5)
    ref = all_tiles_grads(store, enc2, head2)
    (got_enc, got_head), (ref_enc, ref_head) = split(steps[0], enc), split(ref, enc2)
    err_enc, err_head = rel_err(got_enc, ref_enc), rel_err(got_head, ref_head)
    if exact:
        assert err_enc < EXACT_BOUND and err_head < EXACT_BOUND
    else:
        assert err_enc > INEXACT_BOUND, f"encoder gradient unexpectedly exact ({err_enc:.2e})"


def test_batch_of_slides_gives_the_batch_mean_loss_gradient_with_the_paper_head(tmp_path):
    """Two slides per inner loop, the paper's head (BatchNorm over the batch): against plain autograd on a Z built by hand."""
    grids = [block_grid(2, 4, row0=3, col0=1), block_grid(3, 2, row0=0, col0=5, seed=1)]  # n = 8 and 6
    stores = [make_store(tmp_path / f"s{i}.zarr", g, seed=i) for i, g in enumerate(grids)]
    labels = [1, 0]
    enc = TinyEncoder(12).double()
    torch.manual_seed(0)
    head = build_head("cnn_paper", 12, 2, width=8, dropout=0.0, max_grid=5).double()
    init = {k: v.clone() for k, v in head.state_dict().items()}
    enc.train()
    head.train()
    strat = PatchGDTrainer({"patchgd": {"fraction": 0.5, "slides_per_batch": 2}}, enc, head, 2)  # k = 4 and 3, zeta = 2
    steps: list[list[torch.Tensor]] = []
    strat.batch_step(stores, labels, lambda: steps.append(grads([enc, head])), torch.Generator().manual_seed(0))
    assert len(steps) == 1 and [len(p) for p in strat.last_plans] == [2, 2]

    enc2 = TinyEncoder(12).double().eval()
    head2 = build_head("cnn_paper", 12, 2, width=8, dropout=0.0, max_grid=5).double().train()
    head2.load_state_dict(init)
    zs = []
    for store, g in zip(stores, grids):
        emb = enc2(tiles_to_tensor(store.read()))
        z = torch.zeros(12, 5, 5, dtype=torch.float64)
        for i, (col, row) in enumerate(store.grid):  # spatial layout from the tissue bounding box
            z[:, row - g[:, 1].min(), col - g[:, 0].min()] = emb[i]
        zs.append(z)
    logits = head2.forward_z(torch.stack(zs), torch.ones(2, 5, 5, dtype=torch.bool))
    loss = F.cross_entropy(logits, torch.tensor(labels))  # the batch mean, as the reference's criterion
    params = [p for m in (enc2, head2) for p in m.parameters()]
    ref = torch.autograd.grad(loss, params)
    assert rel_err(steps[0], ref) < EXACT_BOUND


def test_paper_head_by_hand():
    """cnn_paper: Z padded to max_grid, Conv3x3 -> ReLU -> BatchNorm -> Dropout2d blocks (stride 1, 2, 2, 2), flatten, Linear."""
    torch.manual_seed(3)
    head = build_head("cnn_paper", 6, 3, max_grid=11).double().eval()
    assert isinstance(head, PaperCNNHead) and head.strides == [1, 2, 2, 2]
    convs = [m for m in head.modules() if isinstance(m, nn.Conv2d)]
    assert all(c.out_channels == 256 and c.kernel_size == (3, 3) for c in convs)
    assert [m.p for m in head.modules() if isinstance(m, nn.Dropout2d)] == [0.2] * 4
    assert head.fc.in_features == 256 * 2 * 2  # 11 -> 11 -> 6 -> 3 -> 2 cells
    for m in head.modules():  # running statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    g = block_grid(4, 7, row0=2, col0=3, drop=5)
    z = torch.randn(len(g), 6, dtype=torch.float64)
    x = torch.zeros(1, 6, 11, 11, dtype=torch.float64)
    for i, (col, row) in enumerate(g):
        x[0, :, row - 2, col - 3] = z[i]
    for conv, bn in zip(convs, [m for m in head.modules() if isinstance(m, nn.BatchNorm2d)]):
        x = torch.relu(F.conv2d(x, conv.weight, conv.bias, conv.stride, 1))
        x = (x - bn.running_mean[:, None, None]) / torch.sqrt(bn.running_var[:, None, None] + bn.eps)
        x = x * bn.weight[:, None, None] + bn.bias[:, None, None]
    expect = head.fc.weight @ x.reshape(-1) + head.fc.bias
    torch.testing.assert_close(head(z, g).logits, expect, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="max_grid must be a number of cells"):
        build_head("cnn_paper", 6, 3, max_grid=None)


def test_paper_windows_drop_the_trailing_partial_window(tmp_path):
    assert accumulation_windows(5, 2, "drop") == [2, 2] and accumulation_windows(5, 2) == [2, 2, 1]
    with pytest.raises(ValueError, match="epsilon=4 exceeds zeta=3"):
        accumulation_windows(3, 4, "drop")
    store = make_store(tmp_path / "s.zarr", block_grid(3, 4))
    enc, head = models(dtype=torch.float32)
    live = []
    enc.register_forward_hook(lambda m, i, o: live.append(len(i[0])) if torch.is_grad_enabled() else None)
    strat, steps, _ = run_bag(store, enc, head, k=2, zeta=5, epsilon=2, partial_window="drop")
    assert len(steps) == 2 and live == [2] * 4 and len(strat.last_plan) == 4


def test_train_mode_fill_embeds_random_k_groups_of_the_batch_together(tmp_path):
    """freeze_bn false (the paper's): Z filled in train mode, the g-th group of k tiles of every slide in one call."""
    import copy

    stores = [make_store(tmp_path / "a.zarr", block_grid(2, 3)), make_store(tmp_path / "b.zarr", block_grid(1, 5), seed=1)]
    enc, head = models()
    ref = copy.deepcopy(enc).train()
    enc.train()
    strat = PatchGDTrainer({"patchgd": {"k": 2, "freeze_bn": False, "slides_per_batch": 2}}, enc, head, 2)
    caches = strat._fill(stores, [2, 2], torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    perms = [torch.randperm(6, generator=gen), torch.randperm(5, generator=gen)]
    expect = [torch.zeros(6, 12, dtype=torch.float64), torch.zeros(5, 12, dtype=torch.float64)]
    sizes = [[2, 2, 2], [2, 2, 1]]  # 3 groups (ceil(6 / 2)), nearly equal
    with torch.no_grad():
        for g in range(3):
            groups = [(b, perms[b][sum(sizes[b][:g]) : sum(sizes[b][: g + 1])]) for b in range(2)]
            out = ref(torch.cat([tiles_to_tensor(stores[b].read(idx.numpy())) for b, idx in groups]))
            for (b, idx), e in zip(groups, out.split([len(i) for _, i in groups])):
                expect[b][idx] = e
    for got, exp in zip(caches, expect):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(enc.net[1].running_mean, ref.net[1].running_mean)  # updated by each call, as the reference


# ----------------------------------------------------------------------------------------------
# preset: paper
# ----------------------------------------------------------------------------------------------


def _raw_pipeline(methods):
    return {"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 6},
            "train": {"lr": 1e-4, "epochs": 10, "weight_decay": 1e-4, "schedule": "cosine"}, "methods": methods}


def test_paper_preset_fills_in_the_papers_settings_and_explicit_keys_win():
    from wsi_pipeline.config.pipeline import config_from_dict, config_to_dict
    from wsi_pipeline.methods.models import patchgd_method

    cfg = config_from_dict(_raw_pipeline([
        {"name": "paper", "strategy": "patchgd", "patchgd": {"preset": "paper"}},
        {"name": "mine", "strategy": "patchgd", "encoder": {"bn": "frozen"}, "aggregator": {"name": "transformer"},
         "patchgd": {"preset": "paper", "fraction": 0.25}, "train": {"lr": 5e-4}},
        {"name": "plain", "strategy": "patchgd", "aggregator": {"name": "transformer"}},
    ]))
    paper, mine, plain = cfg.methods
    assert (paper.encoder.bn, paper.aggregator.name) == ("train", "cnn_paper")
    t = paper.train
    assert (t.schedule, t.warmup_epochs, t.lr, t.min_lr, t.weight_decay, t.epochs) == ("linear", 2, 1e-3, 5e-4, 0.0, 10)
    strat = PatchGDTrainer(patchgd_method(paper), TinyEncoder(12), None, 6)
    c = strat.cfg
    assert (c.backbone_scale, c.freeze_bn, c.slides_per_batch, c.fraction, c.epsilon, c.partial_window) == (
        "paper", False, 14, 0.1, None, "drop")
    assert isinstance(strat.head, PaperCNNHead) and strat.head.grid_side == 128
    # the method's own keys win over the preset's; the rest still comes from the preset
    assert (mine.encoder.bn, mine.aggregator.name, mine.patchgd["fraction"]) == ("frozen", "transformer", 0.25)
    assert (mine.train.lr, mine.train.min_lr, mine.train.schedule, mine.patchgd["backbone_scale"]) == (5e-4, 2.5e-4, "linear", "paper")
    assert PatchGDTrainer(patchgd_method(mine), TinyEncoder(12), None, 6).cfg.freeze_bn is True
    # no preset: nothing changes
    assert (plain.train.lr, plain.train.schedule, plain.encoder.bn, plain.patchgd) == (1e-4, "cosine", "frozen", {})
    assert PatchGDConfig.from_mapping({}).slides_per_batch == 1
    # the saved config (all values resolved) loads back to the same config
    assert config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match=r"methods.paper.patchgd.preset='papr'; expected one of \['default', 'paper'\]"):
        config_from_dict(_raw_pipeline([{"name": "paper", "strategy": "patchgd", "patchgd": {"preset": "papr"}}]))
    with pytest.raises(ValueError, match="applies to strategy 'patchgd'; got strategy 'accumulate'"):
        config_from_dict(_raw_pipeline([{"name": "a", "strategy": "accumulate", "patchgd": {"preset": "paper"}}]))
    with pytest.raises(ValueError, match="patchgd.partial_window='keep'"):
        PatchGDConfig.from_mapping({"partial_window": "keep"})


@pytest.mark.slow
def test_paper_preset_trains_through_the_loop(tmp_path, store_cohort):
    """preset: paper end to end (small head and grid for speed): batches of slides, linear schedule after warm-up."""
    import pandas as pd

    from wsi_pipeline.config.pipeline import BagStatisticsWarning, load_config
    from wsi_pipeline.training.loop import train_pipeline

    root = store_cohort.parent
    raw = {
        "name": "pp", "seeds": [0], "runs_dir": str(tmp_path / "runs"),
        "data": {"manifest": str(store_cohort), "tiles_dir": str(root / "tiles"), "n_classes": 2, "tiling": {"tile_size": 32}},
        "train": {"epochs": 3},
        "methods": [{
            "name": "paper", "strategy": "patchgd", "chunk_size": 16,
            "aggregator": {"name": "cnn_paper", "options": {"width": 8}},
            "patchgd": {"preset": "paper", "max_grid": 9, "slides_per_batch": 4, "fraction": 0.5},  # zeta = 2 for speed
        }],
    }
    import yaml

    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    calls: list[int] = []
    from wsi_pipeline.training import strategies

    orig = strategies.PatchGDStrategy.run_batch

    def spy(self, stores, labels, step, gen):
        calls.append(len(stores))
        return orig(self, stores, labels, step, gen)

    strategies.PatchGDStrategy.run_batch = spy
    try:  # the paper's BatchNorm in train mode: the risk is said, as it must be (test_bn_shortcut)
        with pytest.warns(BagStatisticsWarning, match="method 'paper': encoder.bn='train'"):
            train_pipeline(cfg, progress=False)
    finally:
        strategies.PatchGDStrategy.run_batch = orig
    assert calls == [4, 2] * 3  # 6 training slides in batches of 4 per epoch
    hist = pd.read_csv(tmp_path / "runs" / "pp" / "paper" / "seed0" / "history.csv")
    # the preset's lr 1e-3 and warm-up: lr/3, 2 lr/3, then the linear decay starts at lr (test_optim has the decay)
    assert hist["lr"].tolist() == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-9)
    saved = load_config(tmp_path / "runs" / "pp" / "paper" / "seed0" / "config.yaml").methods[0]
    assert (saved.train.schedule, saved.train.min_lr, saved.encoder.bn) == ("linear", 5e-4, "train")
    assert np.isfinite(hist["train_loss"]).all() and np.isfinite(hist["val_loss"]).all()


def test_batch_with_different_k_scales_each_slides_live_rows_by_its_own_n_over_k(tmp_path):
    """n = 8 and 5 at fraction 0.5: k = 4 and 3, zeta = 2, scales 2 and 5/3; against plain autograd of the mean loss
    over the inner iterations, the live rows' gradient scaled by hand (value unchanged: e.detach() + s (e - e.detach()))."""
    grids = [block_grid(2, 4), block_grid(1, 5, row0=2, seed=1)]
    stores = [make_store(tmp_path / f"s{i}.zarr", g, seed=i) for i, g in enumerate(grids)]
    labels = [0, 1]
    enc = TinyEncoder(12).double()
    torch.manual_seed(0)
    head = build_head("cnn_paper", 12, 2, width=8, dropout=0.0, max_grid=5).double()
    init = {k: v.clone() for k, v in head.state_dict().items()}
    enc.train()
    head.train()
    strat = PatchGDTrainer({"patchgd": {"fraction": 0.5, "slides_per_batch": 2}}, enc, head, 2)
    steps: list[list[torch.Tensor]] = []
    strat.batch_step(stores, labels, lambda: steps.append(grads([enc, head])), torch.Generator().manual_seed(3))
    plans = strat.last_plans
    assert [len(p) for p in plans] == [2, 2] and [len(p[0]) for p in plans] == [4, 3]

    enc2 = TinyEncoder(12).double().eval()
    head2 = build_head("cnn_paper", 12, 2, width=8, dropout=0.0, max_grid=5).double().train()
    head2.load_state_dict(init)
    embs = [enc2(tiles_to_tensor(st.read())) for st in stores]
    scales = [8 / 4, 5 / 3]
    losses = []
    for j in range(2):
        zs = []
        for b, (st, g, e) in enumerate(zip(stores, grids, embs)):
            live = torch.zeros(len(e), 1, dtype=torch.bool)
            live[plans[b][j]] = True
            mixed = torch.where(live, e.detach() + scales[b] * (e - e.detach()), e.detach())
            z = torch.zeros(12, 5, 5, dtype=torch.float64)
            for i, (col, row) in enumerate(st.grid):
                z[:, row - g[:, 1].min(), col - g[:, 0].min()] = mixed[i]
            zs.append(z)
        logits = head2.forward_z(torch.stack(zs), torch.ones(2, 5, 5, dtype=torch.bool))
        losses.append(F.cross_entropy(logits, torch.tensor(labels)))
    params = [p for m in (enc2, head2) for p in m.parameters()]
    ref = torch.autograd.grad(torch.stack(losses).mean(), params)
    assert rel_err(steps[0], ref) < EXACT_BOUND


def test_a_methods_patchgd_options_are_parsed_once_and_stored_as_plain_versioned_state(tmp_path, monkeypatch):
    """``MethodConfig.patchgd_config`` is built when the config is (errors by path), then handed as the
    same object to the strategy check, the head builder and the trainer; its state round-trips through
    ``torch.load(weights_only=True)`` with a schema version."""
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.methods.models import build_patchgd_head
    from wsi_pipeline.training.strategies import check_strategy

    cfg = config_from_dict(_raw_pipeline([
        {"name": "pg", "strategy": "patchgd", "encoder": {"bn": "train"}, "aggregator": {"name": "transformer", "options": {"dim": 16}},
         "patchgd": {"k": 3, "head_options": {"depth": 1}}}]))
    m = cfg.methods[0]
    opts = m.patchgd_config
    assert m.patchgd == {"k": 3, "head_options": {"depth": 1}}  # the config keeps the section as written
    # resolved from the other sections: the head and its options, the BatchNorm mode
    assert (opts.k, opts.head, opts.head_options, opts.freeze_bn) == (3, "transformer", {"dim": 16, "depth": 1}, False)
    calls = []
    real = PatchGDConfig.from_mapping.__func__
    monkeypatch.setattr(PatchGDConfig, "from_mapping", classmethod(lambda cls, *a, **k: calls.append(a) or real(cls, *a, **k)))
    check_strategy(m)
    head = build_patchgd_head(m.patchgd_config, 12, 6)
    trainer = PatchGDTrainer(m.patchgd_config, TinyEncoder(12), head, 6)
    assert calls == [] and trainer.cfg is opts and m.patchgd_config is opts  # parsed once, shared
    # the stored form: plain values and a schema version, read back equal
    state = opts.to_state()
    assert state["schema_version"] == 1
    torch.save(state, tmp_path / "pg.pt")
    assert PatchGDConfig.from_state(torch.load(tmp_path / "pg.pt", weights_only=True)) == opts
    with pytest.raises(ValueError, match="schema version 2; this version reads 1"):
        PatchGDConfig.from_state({**state, "schema_version": 2})
    with pytest.raises(ValueError, match=r"methods.pg.patchgd.k=0; expected a value >= 1"):
        config_from_dict(_raw_pipeline([{"name": "pg", "strategy": "patchgd", "patchgd": {"k": 0}}]))
