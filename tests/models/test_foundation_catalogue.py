"""The catalogue presets (Virchow, H0-mini, Kaiko, Lunit, GPFM, Phikon, Phikon-v2, Midnight) against their cards.

timm-layout presets: a random-weight model built by timm (the cards' own library) with the card's
keyword arguments, saved under the file name the card publishes, must give through our preset
the embedding the card's recipe gives (PIL tile -> the card's torchvision transform -> the timm
model -> the card's output). transformers- and DINOv2-hub-layout presets: transformers is not a
dependency, so the file is a random state dict written directly in the card's key layout (shapes
from the card's config), and the reference is a forward pass written here from the transformers
/ DINOv2 definitions (pre-norm blocks, separate query/key/value, LayerScale, SwiGLU as
``silu(x1) * x2``, the position grid resampled as the library does), reading that file's keys
itself: neither our key map nor timm is used by the reference. Every model runs at 2 blocks of
its real width (the preset patched to the same depth); cosine >= 0.9999.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import timm  # a core dependency: never skipped
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from torchvision import transforms

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.models import build_encoder
from wsi_pipeline.models import foundation as fm

COSINE = 0.9999
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
HOPTIMUS = ((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))
LUNIT = ((0.70322989, 0.53606487, 0.66096631), (0.21716536, 0.26081574, 0.20723464))
SWIGLU = dict(mlp_layer=timm.layers.SwiGLUPacked, act_layer=torch.nn.SiLU)
BICUBIC = transforms.InterpolationMode.BICUBIC
KAIKO_TF = [transforms.Resize(224), transforms.CenterCrop(224)]

#: The cards as this test reads them: architecture, create_model kwargs, transform, (mean, std),
#: embedding ("cls" or "cls_mean" with the number of prefix tokens), file name, tile side tested.
CARDS = {
    "virchow": ("vit_huge_patch14_224", dict(img_size=224, init_values=1e-5, num_classes=0, mlp_ratio=5.3375, global_pool="",
                                             dynamic_img_size=True, **SWIGLU),
                [transforms.Resize(224, interpolation=BICUBIC), transforms.CenterCrop(224)], IMAGENET, ("cls_mean", 1),
                "pytorch_model.bin", 224),
    "h0_mini": ("vit_base_patch14_reg4_dinov2", dict(img_size=224, init_values=1e-5, num_classes=0, mlp_ratio=5.33334, global_pool="",
                                                     dynamic_img_size=True, **SWIGLU),
                [], HOPTIMUS, ("cls_mean", 5), "model.safetensors", 224),
    "kaiko_vits8": ("vit_small_patch8_224", dict(num_classes=0, dynamic_img_size=True), KAIKO_TF, HALF, ("cls", 0),
                    "model.safetensors", 256),
    "kaiko_vits16": ("vit_small_patch16_224", dict(num_classes=0, dynamic_img_size=True), KAIKO_TF, HALF, ("cls", 0),
                     "model.safetensors", 224),
    "kaiko_vitb8": ("vit_base_patch8_224", dict(num_classes=0, dynamic_img_size=True), KAIKO_TF, HALF, ("cls", 0),
                    "model.safetensors", 224),
    "kaiko_vitb16": ("vit_base_patch16_224", dict(num_classes=0, dynamic_img_size=True), KAIKO_TF, HALF, ("cls", 0),
                     "model.safetensors", 224),
    "kaiko_vitl14": ("vit_large_patch14_reg4_dinov2", dict(img_size=518, num_classes=0, dynamic_img_size=True), KAIKO_TF, HALF,
                     ("cls", 0), "model.safetensors", 224),
    "lunit_vits8": ("vit_small_patch8_224", dict(img_size=224, num_classes=0, dynamic_img_size=True), [], LUNIT, ("cls", 0),
                    "model.safetensors", 224),
    "lunit_vits16": ("vit_small_patch16_224", dict(img_size=224, num_classes=0, dynamic_img_size=True), [], LUNIT, ("cls", 0),
                     "model.safetensors", 224),
    "gpfm": ("vit_large_patch14_dinov2", dict(img_size=224, init_values=1e-5, dynamic_img_size=True, num_classes=0), [], IMAGENET,
             ("cls", 0), "GPFM.pth", 224),
}


def _tiles(n: int, side: int, seed: int = 0) -> np.ndarray:
    """Smooth random RGB tiles plus noise: uint8 (n, side, side, 3)."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(40, 220, (n, 6, 6, 3)).astype(np.uint8)
    img = np.stack([np.asarray(Image.fromarray(s).resize((side, side), Image.BILINEAR)) for s in small]).astype(float)
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=1)


def _at_depth(monkeypatch, name: str, depth: int) -> None:
    monkeypatch.setitem(fm.PRESETS, name, fm.replace_preset(fm.PRESETS[name], timm_kwargs={"depth": depth}))


def _card_input(name: str, tiles: np.ndarray) -> torch.Tensor:
    _, _, tf, (mean, std), *_ = CARDS[name]
    full = transforms.Compose([*tf, transforms.ToTensor(), transforms.Normalize(mean, std)])
    return torch.stack([full(Image.fromarray(t)) for t in tiles])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CARDS))
def test_timm_layout_preset_matches_its_card(tmp_path, monkeypatch, name: str) -> None:
    arch, kwargs, tf, _, (embedding, n_prefix), filename, side = CARDS[name]
    torch.manual_seed(0)
    ref = timm.create_model(arch, pretrained=False, **{**kwargs, "depth": 2}).eval()
    with torch.no_grad():  # like a trained model: tokens and blocks matter (timm starts them near 0)
        for key, p in ref.named_parameters():
            if key in ("cls_token", "reg_token", "pos_embed"):
                p.normal_(0.0, 1.0)
            elif key.endswith(".gamma"):
                p.uniform_(0.2, 0.5)
    path = tmp_path / filename
    if filename.endswith(".safetensors"):
        save_file(ref.state_dict(), str(path))
    else:
        torch.save(ref.state_dict(), path)
    _at_depth(monkeypatch, name, 2)
    tiles = _tiles(2, side, seed=3)
    with torch.no_grad():
        out = ref(_card_input(name, tiles))
    expect = torch.cat([out[:, 0], out[:, n_prefix:].mean(1)], dim=-1) if embedding == "cls_mean" else out
    enc = build_encoder(name, weights=path).eval()
    resizes = any(isinstance(t, transforms.Resize) for t in tf) and side != 224
    if resizes:  # the card's PIL resize rounds to uint8: compare on the card's resized tiles (the same pixels)
        tiles = np.stack([np.asarray(transforms.Compose(tf)(Image.fromarray(t))) for t in tiles])
    with torch.no_grad():
        got = enc(tiles_to_tensor(tiles))
    assert got.shape == expect.shape == (2, fm.PRESETS[name].embed_dim)
    assert _cos(got, expect).min() >= COSINE, f"{name}: {_cos(got, expect).tolist()}"
    assert (fm.PRESETS[name].mean, fm.PRESETS[name].std) == CARDS[name][3]
    assert filename in fm.PRESETS[name].weights_files


# ------------------------------------------------------------------------------------------------
# transformers and DINOv2-hub layouts: files written in the card's keys, a reference forward read from them

#: (width, heads, mlp: "gelu" (4x) or "swiglu" (hidden = 2/3 of 4x, rounded up to 8), patch, position grid
#: stored in the file, layer-norm epsilon, LayerScale, registers) of each card's config.
NETS = {
    "phikon": (768, 12, "gelu", 16, 14, 1e-12, False, 0),
    "phikon_v2": (1024, 16, "gelu", 16, 14, 1e-6, True, 0),
    "midnight": (1536, 24, "swiglu", 14, 37, 1e-6, True, 0),  # DINOv2-trained: the 518 px grid
}
LAYOUT = {"phikon": "transformers_vit", "phikon_v2": "transformers_dinov2", "midnight": "transformers_dinov2"}


def _hidden(d: int, mlp: str) -> int:
    return 4 * d if mlp == "gelu" else (int(4 * d * 2 / 3) + 7) // 8 * 8


def _write_layout(layout: str, net: tuple, depth: int, seed: int) -> dict[str, torch.Tensor]:
    """A random state dict in the card's own key layout (transformers 4.x / DINOv2 hub names)."""
    d, _, mlp, p, grid, _, scale, regs = net
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, s: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    h = _hidden(d, mlp)
    hub = layout == "dinov2_hub"
    st: dict[str, torch.Tensor] = {}
    pre = "" if hub else "embeddings."
    st[pre + "cls_token"] = r(1, 1, d, s=1.0)
    st[pre + ("pos_embed" if hub else "position_embeddings")] = r(1, 1 + grid * grid, d, s=1.0)
    st[pre + ("patch_embed.proj" if hub else "patch_embeddings.projection") + ".weight"] = r(d, 3, p, p)
    st[pre + ("patch_embed.proj" if hub else "patch_embeddings.projection") + ".bias"] = r(d)
    if layout != "transformers_vit":
        st["mask_token" if hub else "embeddings.mask_token"] = r(1, d)
    if regs:
        st["register_tokens" if hub else "embeddings.register_tokens"] = r(1, regs, d, s=1.0)
    for i in range(depth):
        b = f"blocks.{i}." if hub else f"encoder.layer.{i}."
        norms = ("norm1", "norm2") if layout != "transformers_vit" else ("layernorm_before", "layernorm_after")
        for n in norms:
            st[b + n + ".weight"], st[b + n + ".bias"] = 1 + r(d, s=0.2), r(d)
        if hub:
            st[b + "attn.qkv.weight"], st[b + "attn.qkv.bias"] = r(3 * d, d), r(3 * d)
            st[b + "attn.proj.weight"], st[b + "attn.proj.bias"] = r(d, d), r(d)
        else:
            for q in ("query", "key", "value"):
                st[b + f"attention.attention.{q}.weight"], st[b + f"attention.attention.{q}.bias"] = r(d, d), r(d)
            st[b + "attention.output.dense.weight"], st[b + "attention.output.dense.bias"] = r(d, d), r(d)
        if scale:
            for k in (1, 2):
                st[b + (f"ls{k}.gamma" if hub else f"layer_scale{k}.lambda1")] = 0.2 + r(d, s=0.1).abs()
        fc_in, fc_out = {"transformers_vit": ("intermediate.dense", "output.dense"), "transformers_dinov2": ("mlp.fc1", "mlp.fc2"),
                         "dinov2_hub": ("mlp.fc1", "mlp.fc2")}[layout]
        if mlp == "swiglu":
            fc_in, fc_out = ("mlp.w12", "mlp.w3") if hub else ("mlp.weights_in", "mlp.weights_out")
        st[b + fc_in + ".weight"] = r(2 * h if mlp == "swiglu" else h, d)
        st[b + fc_in + ".bias"] = r(2 * h if mlp == "swiglu" else h)
        st[b + fc_out + ".weight"], st[b + fc_out + ".bias"] = r(d, h), r(d)
    last = "norm" if hub else "layernorm"
    st[last + ".weight"], st[last + ".bias"] = 1 + r(d, s=0.2), r(d)
    if layout == "transformers_vit":  # ViTModel saves its pooler (the card's add_pooling_layer=False ignores it)
        st["pooler.dense.weight"], st["pooler.dense.bias"] = r(d, d), r(d)
    return st


def _reference(st: dict[str, torch.Tensor], layout: str, net: tuple, depth: int, x: torch.Tensor) -> torch.Tensor:
    """last_hidden_state of the card's library, written from its definition, reading the file's keys: [B, 1+R+N, D]."""
    d, heads, mlp, p, grid, eps, scale, regs = net
    hub = layout == "dinov2_hub"
    pre = "" if hub else "embeddings."
    w = st[pre + ("patch_embed.proj" if hub else "patch_embeddings.projection") + ".weight"]
    b = st[pre + ("patch_embed.proj" if hub else "patch_embeddings.projection") + ".bias"]
    t = F.conv2d(x, w, b, stride=p).flatten(2).transpose(1, 2)
    n_side = x.shape[-1] // p
    pos = st[pre + ("pos_embed" if hub else "position_embeddings")]
    if n_side != grid:  # transformers 5.x: bicubic to the size, no antialiasing; DINOv2 hub: by (grid + 0.1) / M
        pp = pos[:, 1:].reshape(1, grid, grid, d).permute(0, 3, 1, 2)
        if hub:
            pp = F.interpolate(pp, scale_factor=((n_side + 0.1) / grid,) * 2, mode="bicubic", antialias=False)
        else:
            pp = F.interpolate(pp, size=(n_side, n_side), mode="bicubic", align_corners=False)
        pos = torch.cat([pos[:, :1], pp.permute(0, 2, 3, 1).reshape(1, -1, d)], dim=1)
    t = torch.cat([st[pre + "cls_token"].expand(len(x), -1, -1), t], dim=1) + pos
    if regs:
        t = torch.cat([t[:, :1], st["register_tokens" if hub else "embeddings.register_tokens"].expand(len(x), -1, -1), t[:, 1:]], 1)
    for i in range(depth):
        bk = f"blocks.{i}." if hub else f"encoder.layer.{i}."
        n1, n2 = ("norm1", "norm2") if layout != "transformers_vit" else ("layernorm_before", "layernorm_after")
        y = F.layer_norm(t, (d,), st[bk + n1 + ".weight"], st[bk + n1 + ".bias"], eps)
        if hub:
            q, k, v = F.linear(y, st[bk + "attn.qkv.weight"], st[bk + "attn.qkv.bias"]).chunk(3, dim=-1)
            proj = (st[bk + "attn.proj.weight"], st[bk + "attn.proj.bias"])
        else:
            q, k, v = (F.linear(y, st[bk + f"attention.attention.{n}.weight"], st[bk + f"attention.attention.{n}.bias"])
                       for n in ("query", "key", "value"))
            proj = (st[bk + "attention.output.dense.weight"], st[bk + "attention.output.dense.bias"])
        sh = lambda z: z.reshape(len(x), -1, heads, d // heads).transpose(1, 2)  # noqa: E731
        a = torch.softmax(sh(q) @ sh(k).transpose(-1, -2) / math.sqrt(d // heads), dim=-1) @ sh(v)
        y = F.linear(a.transpose(1, 2).reshape(len(x), -1, d), *proj)
        if scale:
            y = y * st[bk + ("ls1.gamma" if hub else "layer_scale1.lambda1")]
        t = t + y
        y = F.layer_norm(t, (d,), st[bk + n2 + ".weight"], st[bk + n2 + ".bias"], eps)
        if mlp == "swiglu":
            fi, fo = ("mlp.w12", "mlp.w3") if hub else ("mlp.weights_in", "mlp.weights_out")
            x1, x2 = F.linear(y, st[bk + fi + ".weight"], st[bk + fi + ".bias"]).chunk(2, dim=-1)
            y = F.linear(F.silu(x1) * x2, st[bk + fo + ".weight"], st[bk + fo + ".bias"])
        else:
            fi, fo = ("intermediate.dense", "output.dense") if layout == "transformers_vit" else ("mlp.fc1", "mlp.fc2")
            y = F.linear(F.gelu(F.linear(y, st[bk + fi + ".weight"], st[bk + fi + ".bias"])), st[bk + fo + ".weight"],
                         st[bk + fo + ".bias"])
        if scale:
            y = y * st[bk + ("ls2.gamma" if hub else "layer_scale2.lambda1")]
        t = t + y
    last = "norm" if hub else "layernorm"
    return F.layer_norm(t, (d,), st[last + ".weight"], st[last + ".bias"], eps)


def _check_layout_preset(tmp_path, monkeypatch, name: str, layout: str, net: tuple, filename: str) -> None:
    st = _write_layout(layout, net, depth=2, seed=1)
    path = tmp_path / filename
    if filename.endswith(".safetensors"):
        save_file(st, str(path))
    else:
        torch.save(st, path)
    _at_depth(monkeypatch, name, 2)
    preset = fm.PRESETS[name]
    tiles = _tiles(2, 224, seed=4)
    x = torch.stack([transforms.Compose([transforms.ToTensor(), transforms.Normalize(preset.mean, preset.std)])(Image.fromarray(t))
                     for t in tiles])
    with torch.no_grad():
        hidden = _reference(st, layout, net, 2, x)
        n_prefix = 1 + net[7]
        expect = torch.cat([hidden[:, 0], hidden[:, n_prefix:].mean(1)], -1) if preset.embedding == "cls_mean" else hidden[:, 0]
        got = build_encoder(name, weights=path).eval()(tiles_to_tensor(tiles))
    assert got.shape == expect.shape == (2, preset.embed_dim)
    assert _cos(got, expect).min() >= COSINE, f"{name} ({layout}): {_cos(got, expect).tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NETS))
def test_transformers_layout_preset_matches_the_library_definition(tmp_path, monkeypatch, name: str) -> None:
    """Phikon (ViTModel keys, LayerNorm eps 1e-12, pooler in the file), Phikon-v2 and Midnight (Dinov2Model keys;
    Midnight's SwiGLU and its 518 px position grid resampled as transformers does)."""
    _check_layout_preset(tmp_path, monkeypatch, name, LAYOUT[name], NETS[name], fm.PRESETS[name].weights_files[0])


@pytest.mark.slow
def test_dinov2_hub_layout_with_registers_and_chunked_blocks(tmp_path, monkeypatch) -> None:
    """A DINOv2-trained checkpoint (hub keys, 4 registers, the 518 px grid resampled by the hub's offset rule) of a
    Midnight-shaped network loads into the midnight preset's timm model with registers and gives the hub's output."""
    net = (1536, 24, "swiglu", 14, 37, 1e-6, True, 4)
    name = "midnight"
    monkeypatch.setitem(fm.PRESETS, name, fm.replace_preset(fm.PRESETS[name], architecture="vit_giant_patch14_reg4_dinov2"))
    _check_layout_preset(tmp_path, monkeypatch, name, "dinov2_hub", net, "teacher_checkpoint.pth")
    # block-chunked training checkpoints (blocks.<chunk>.<i>.) name the same blocks
    st = _write_layout("dinov2_hub", net, depth=2, seed=1)
    chunked = {(k.replace("blocks.", "blocks.0.", 1) if k.startswith("blocks.") else k): v for k, v in st.items()}
    from wsi_pipeline.models.layouts import to_timm_layout

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in fm.build_foundation_encoder(name).model.state_dict().items()}
    a, b = to_timm_layout(st, "dinov2_hub", shapes, what="x"), to_timm_layout(chunked, "dinov2_hub", shapes, what="x")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_keys_are_refused_per_layout(tmp_path, monkeypatch) -> None:
    _at_depth(monkeypatch, "phikon", 2)
    st = _write_layout("transformers_vit", NETS["phikon"], depth=2, seed=0)
    st["encoder.layer.0.attention.attention.rotary.weight"] = torch.zeros(3)
    path = tmp_path / "pytorch_model.bin"
    torch.save(st, path)
    with pytest.raises(ValueError, match=r"pytorch_model.bin: keys unknown to the transformers_vit layout: "
                                         r"encoder.layer.0.attention.attention.rotary.weight"):
        build_encoder("phikon", weights=path)
    del st["encoder.layer.0.attention.attention.rotary.weight"], st["encoder.layer.1.attention.attention.key.bias"]
    torch.save(st, path)
    with pytest.raises(ValueError, match=r"block 1 has \['query', 'value'\] of attention bias"):
        build_encoder("phikon", weights=path)
    # a Phikon file given to a DINOv2 preset: refused naming the preset's layout
    _at_depth(monkeypatch, "phikon_v2", 2)
    torch.save(_write_layout("transformers_vit", NETS["phikon"], depth=2, seed=0), path)
    with pytest.raises(ValueError, match=r"keys unknown to the transformers_dinov2 layout: .*layernorm_before"):
        build_encoder("phikon_v2", weights=path)


def test_catalogue_presets_follow_the_design_names_and_cards() -> None:
    """Every preset the design names exists, with the parameter count of its card's network (meta device)."""
    counts = {"virchow": 631_229_184, "h0_mini": 85_739_520, "kaiko_vits8": 21_670_272, "kaiko_vits16": 21_665_664,
              "kaiko_vitb8": 85_807_872, "kaiko_vitb16": 85_798_656, "kaiko_vitl14": 304_370_688, "lunit_vits8": 21_670_272,
              "lunit_vits16": 21_665_664, "gpfm": 303_227_904, "phikon": 85_798_656, "phikon_v2": 303_350_784,
              "midnight": 1_134_769_664}
    for name, n in counts.items():
        with torch.device("meta"):
            enc = fm.build_foundation_encoder(name)
        assert sum(p.numel() for p in enc.parameters()) == n, name
        assert fm.PRESETS[name].resize_policy in ("card", "ours") and fm.PRESETS[name].licence


def test_docs_table_is_the_registry() -> None:
    """The foundation table of docs/foundation-models.md is generated from PRESETS: it names every preset, with its D,
    and equals the generator's output (run ``python -m wsi_pipeline.models.preset_table --write
    docs/foundation-models.md`` after changing a preset)."""
    from pathlib import Path

    from wsi_pipeline.models.preset_table import BEGIN, END, preset_table, replace_block

    readme = (Path(__file__).resolve().parents[2] / "docs" / "foundation-models.md").read_text()
    block = readme[readme.index(BEGIN) + len(BEGIN) + 1 : readme.index(END)]
    assert block == preset_table()
    rows = {line.split("|")[1].strip(" `"): line for line in block.splitlines()[2:]}
    assert set(rows) == set(fm.PRESETS)
    for name, p in fm.PRESETS.items():
        assert f"| {p.embed_dim} (" in rows[name] and p.architecture in rows[name] and p.weights_files[0] in rows[name]
    with pytest.raises(ValueError, match="markers are missing"):
        replace_block("no markers here", "x")


@pytest.mark.slow
def test_features_cluster_with_a_foundation_preset_equals_the_local_run(store_cohort, tmp_path, monkeypatch) -> None:
    """``features --encoder phikon --weights FILE --cluster local:2`` (a transformers-layout file, 2 blocks of the real
    width): the Dask workers write the same feature files, bit for bit, as one process does."""
    import h5py

    from wsi_pipeline.cli.main import main
    from wsi_pipeline.inference.features import features_path
    from wsi_pipeline.manifests.schema import read_manifest

    _at_depth(monkeypatch, "phikon", 2)
    weights = tmp_path / "pytorch_model.bin"
    torch.save(_write_layout("transformers_vit", NETS["phikon"], depth=2, seed=5), weights)
    manifest = tmp_path / "m.csv"
    read_manifest(store_cohort).head(2).to_csv(manifest, index=False)
    base = ["features", "--manifest", str(manifest), "--tiles", str(store_cohort.parent / "tiles"), "--encoder", "phikon",
            "--weights", str(weights), "--batch-size", "16", "--no-progress"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Dask's workers run torch with one thread: the same reduction order
    try:
        assert main([*base, "--out", str(tmp_path / "local")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert main([*base, "--out", str(tmp_path / "dask"), "--cluster", "local:2"]) == 0
    for sid in read_manifest(manifest)["slide_id"]:
        with h5py.File(features_path(tmp_path / "local", sid), "r") as a, h5py.File(features_path(tmp_path / "dask", sid), "r") as b:
            assert a.keys() == b.keys() and a["features"].shape[1] == 768 and len(a["features"]) > 0
            for k in a:
                assert (a[k][()] == b[k][()]).all(), (sid, k)
            assert a.attrs["encoder"] == b.attrs["encoder"] == "phikon"
            assert a.attrs["weights_file_sha256"] == b.attrs["weights_file_sha256"]


def test_a_timm_that_cannot_build_on_the_meta_device_still_loads(tmp_path, monkeypatch) -> None:
    """timm 0.9.16 reads tensor values while building a ViT, which fails on torch's meta device: the loader then
    builds normally and loads the same weights (the same embedding as the fast path)."""
    _at_depth(monkeypatch, "kaiko_vits16", 1)
    torch.manual_seed(0)
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, depth=1, dynamic_img_size=True)
    path = tmp_path / "model.safetensors"
    save_file(ref.state_dict(), str(path))
    x = tiles_to_tensor(_tiles(2, 224))
    with torch.no_grad():
        fast = build_encoder("kaiko_vits16", weights=path).eval()(x)
    create = fm._create

    def old_timm(name, spec):
        if torch.empty(0).device.type == "meta":
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")
        return create(name, spec)

    monkeypatch.setattr(fm, "_create", old_timm)
    with torch.no_grad():
        slow = build_encoder("kaiko_vits16", weights=path).eval()(x)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("name", list(NETS))
def test_against_transformers_itself_where_installed(tmp_path, monkeypatch, name: str) -> None:
    """Where transformers is installed (not a dependency: skipped in CI), a random ViTModel / Dinov2Model of the
    card's shape at 2 blocks, saved with ``save_pretrained``, gives through the preset what the card reads from
    transformers (``last_hidden_state``). Measured with transformers 5.24.0: cosine 1.0, relative difference <= 2.1e-7."""
    transformers = pytest.importorskip("transformers")
    d, heads, mlp, p, grid, eps, scale, _ = NETS[name]
    if LAYOUT[name] == "transformers_vit":
        cfg = transformers.ViTConfig(hidden_size=d, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=4 * d,
                                     image_size=grid * p, patch_size=p, layer_norm_eps=eps)
        model = transformers.ViTModel(cfg)
    else:
        cfg = transformers.Dinov2Config(hidden_size=d, num_hidden_layers=2, num_attention_heads=heads, mlp_ratio=4,
                                        image_size=grid * p, patch_size=p, use_swiglu_ffn=mlp == "swiglu", layer_norm_eps=eps)
        model = transformers.Dinov2Model(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for key, prm in model.named_parameters():
            if "lambda1" in key:
                prm.uniform_(0.2, 0.5)
            elif key.endswith(("cls_token", "position_embeddings")):
                prm.normal_(0.0, 1.0)
    model.eval().save_pretrained(tmp_path / name)
    _at_depth(monkeypatch, name, 2)
    preset = fm.PRESETS[name]
    tiles = _tiles(2, 224, seed=6)
    x = torch.stack([transforms.Compose([transforms.ToTensor(), transforms.Normalize(preset.mean, preset.std)])(Image.fromarray(t))
                     for t in tiles])
    with torch.no_grad():
        h = model(pixel_values=x).last_hidden_state
        expect = torch.cat([h[:, 0], h[:, 1:].mean(1)], -1) if preset.embedding == "cls_mean" else h[:, 0]
        got = build_encoder(name, weights=tmp_path / name / "model.safetensors").eval()(tiles_to_tensor(tiles))
    assert _cos(got, expect).min() >= COSINE


def test_hoptimus_facts_and_both_published_files_named(tmp_path) -> None:
    """H-optimus-0 publishes pytorch_model.bin on its main branch and model.safetensors in an open pull request: a
    refusal names both; the H-optimus resize is ours (their cards resize nothing), H-optimus-1 is CC-BY-NC-ND-4.0."""
    with pytest.raises(FileNotFoundError, match=r"expects pytorch_model.bin or model.safetensors from huggingface.co/bioptimus/H-optimus-0"):
        build_encoder("hoptimus0", weights=tmp_path / "missing.bin")
    h0, h1 = fm.PRESETS["hoptimus0"], fm.PRESETS["hoptimus1"]
    assert h0.resize_policy == h1.resize_policy == "ours" and "TRIDENT" in h0.resize_note
    assert h1.licence.startswith("CC-BY-NC-ND-4.0") and "not gated" in h0.licence
    assert fm.PRESETS["uni_v1"].resize_policy == fm.PRESETS["gigapath"].resize_policy == "card"
