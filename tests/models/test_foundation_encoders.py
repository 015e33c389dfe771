"""Foundation-model presets load checkpoints written by timm itself, in each preset's published layout, and
give the embedding the model card's own recipe gives (torchvision transforms on PIL tiles, then the timm
model); wrong files are refused naming the preset, the keys and the file expected; features on the CLI.

The reference of each test is built here from the model card's words (architecture, keyword arguments,
transform, which output is the embedding), not from our preset table, so a preset that drifts from its
card fails. ``uni_v1`` runs at full size (ViT-L/16, 303 M parameters); the others at 2 blocks of their
real width (every other keyword as on the card), with the preset patched to the same depth.

float32 bound: ours and the reference see the same pixels and differ only in how the normalisation
is rounded (ours maps ImageNet-normalised input to the preset's: a few float32 ulps, relative ~1e-7
of the input), far inside cosine >= 0.9999 (a relative error e of the embedding moves the cosine by
about e**2 / 2). Where the card resizes (256 px tiles for UNI2-h and Virchow2), the card's PIL resize
rounds the resized tile to uint8 and ours does not, so the two are compared in two steps: our model
input against the card's transform output, pixel by pixel, within that rounding (PIL resamples in
two 8-bit passes: at most 1.5 grey levels); and our embedding of the card's resized uint8 tiles
against the card's embedding (the same pixels: the bound above). End to end, the random-weight
models amplify the 0.3 % rounding noise (their LayerNorm-ed class token carries a signal of the
size of its 1e-6 initialisation), which says nothing about the preprocessing.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm  # a core dependency: imported, never skipped
import torch
from PIL import Image
from torchvision import transforms  # timm's dependency; the model cards' transforms

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.models import build_encoder
from wsi_pipeline.models import foundation as fm

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HOPTIMUS = ((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))
BICUBIC = transforms.InterpolationMode.BICUBIC

#: The model cards, as the test reads them: (architecture, create_model kwargs, transform given the
#: tile side, embedding, published file name). Reduced tests add depth=2.
CARDS = {
    "uni_v1": ("vit_large_patch16_224", dict(img_size=224, patch_size=16, init_values=1e-5, num_classes=0, dynamic_img_size=True),
               lambda: [transforms.Resize(224)], IMAGENET, "pooled", "pytorch_model.bin"),
    "uni_v2": ("vit_giant_patch14_224", dict(img_size=224, patch_size=14, depth=24, num_heads=24, init_values=1e-5, embed_dim=1536,
                                             mlp_ratio=2.66667 * 2, num_classes=0, no_embed_class=True,
                                             mlp_layer=timm.layers.SwiGLUPacked, act_layer=torch.nn.SiLU, reg_tokens=8,
                                             dynamic_img_size=True),
               lambda: [transforms.Resize(224)], IMAGENET, "pooled", "pytorch_model.bin"),
    "virchow2": ("vit_huge_patch14_224", dict(img_size=224, init_values=1e-5, num_classes=0, mlp_ratio=5.3375, reg_tokens=4,
                                              global_pool="", dynamic_img_size=True, mlp_layer=timm.layers.SwiGLUPacked,
                                              act_layer=torch.nn.SiLU),
                 lambda: [transforms.Resize(224, interpolation=BICUBIC), transforms.CenterCrop(224)], IMAGENET, "cls_mean",
                 "model.safetensors"),
    "hoptimus0": ("vit_giant_patch14_reg4_dinov2", dict(init_values=1e-5, dynamic_img_size=False, img_size=224, num_classes=0),
                  list, HOPTIMUS, "pooled", "pytorch_model.bin"),
    "hoptimus1": ("vit_giant_patch14_reg4_dinov2", dict(init_values=1e-5, dynamic_img_size=False, img_size=224, num_classes=0),
                  list, HOPTIMUS, "pooled", "model.safetensors"),
    "gigapath": ("vit_giant_patch14_dinov2", dict(img_size=224, in_chans=3, patch_size=16, embed_dim=1536, depth=40, num_heads=24,
                                                  init_values=1e-5, mlp_ratio=5.33334, num_classes=0),
                 lambda: [transforms.Resize(256, interpolation=BICUBIC), transforms.CenterCrop(224)], IMAGENET, "pooled",
                 "pytorch_model.bin"),
}
#: The tile side each preset is tested at: 224 px (untouched) or 256 px (the card's resize / crop).
TILE = {"uni_v1": 224, "uni_v2": 256, "virchow2": 256, "hoptimus0": 224, "hoptimus1": 224, "gigapath": 256}
COSINE = 0.9999


def _tiles(n: int, side: int, seed: int = 0) -> np.ndarray:
    """Smooth random RGB tiles (a coarse random field upsampled, plus noise): uint8 (n, side, side, 3)."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(40, 220, (n, 8, 8, 3))
    x = np.linspace(0, 7, side)
    i0 = np.floor(x).astype(int).clip(0, 6)
    f = (x - i0)[None, :, None, None]
    rows = coarse[:, i0] * (1 - f) + coarse[:, i0 + 1] * f
    fc = (x - i0)[None, None, :, None]
    img = rows[:, :, i0] * (1 - fc) + rows[:, :, i0 + 1] * fc
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def _card_embedding(name: str, model: torch.nn.Module, tiles: np.ndarray) -> torch.Tensor:
    """The embedding as the model card computes it: PIL tile -> card transform -> timm model -> card output."""
    _, _, resize, (mean, std), embedding, _ = CARDS[name]
    tf = transforms.Compose([*resize(), transforms.ToTensor(), transforms.Normalize(mean, std)])
    x = torch.stack([tf(Image.fromarray(t)) for t in tiles])
    with torch.no_grad():
        out = model.eval()(x)
    if embedding == "cls_mean":  # Virchow2's card: class token ++ mean of the patch tokens (registers 1-4 left out)
        return torch.cat([out[:, 0], out[:, 5:].mean(1)], dim=-1)
    return out


def _write_card_checkpoint(name: str, path, depth: int | None, seed: int = 0) -> torch.nn.Module:
    """A random-weight timm model in the card's architecture, saved as the card publishes it (state dict).

    timm's initialisation leaves the class, register and position tokens near 0 and the LayerScale
    factors at 1e-5, so every block is nearly the identity and the register tokens nearly alike:
    an embedding that wrongly averaged the register tokens in would still pass. They are redrawn
    at the scale of a trained model's, so each token and block changes the embedding."""
    arch, kwargs, *_ = CARDS[name]
    kw = dict(kwargs, **({"depth": depth} if depth else {}))
    torch.manual_seed(seed)
    model = timm.create_model(arch, pretrained=False, **kw)
    with torch.no_grad():  # like a trained model, every token and every block matters (timm starts them near 0)
        for name_, p in model.named_parameters():
            if name_ in ("cls_token", "reg_token", "pos_embed"):
                p.normal_(0.0, 1.0)
            elif name_.endswith(".gamma"):  # LayerScale, initialised at 1e-5
                p.uniform_(0.2, 0.5)
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(model.state_dict(), str(path))
    else:
        torch.save(model.state_dict(), path)
    return model


def _at_depth(monkeypatch, name: str, depth: int) -> None:
    monkeypatch.setitem(fm.PRESETS, name, fm.replace_preset(fm.PRESETS[name], timm_kwargs={"depth": depth}))


def _cosines(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=1)


@pytest.mark.slow
def test_uni_v1_full_size_matches_timm(tmp_path) -> None:
    """ViT-L/16 at full size (303 M parameters): a timm-written pytorch_model.bin, 224 px tiles untouched."""
    path = tmp_path / "pytorch_model.bin"
    ref = _write_card_checkpoint("uni_v1", path, depth=None)
    tiles = _tiles(2, 224)
    expect = _card_embedding("uni_v1", ref, tiles)
    del ref
    enc = build_encoder("uni_v1", weights=path).eval()
    assert sum(p.numel() for p in enc.parameters()) == 303_350_784 and enc.num_features == 1024
    with torch.no_grad():
        got = enc(tiles_to_tensor(tiles))
    assert got.shape == (2, 1024)
    assert _cosines(got, expect).min() >= COSINE
    assert enc.base_weights["sha256"] == fm.file_sha256(path)
    assert enc.preprocessing(224)["resize"] == "none"


@pytest.mark.parametrize("name", ["uni_v2", "virchow2", "hoptimus0", "hoptimus1", "gigapath"])
def test_preset_matches_its_model_card_at_reduced_depth(tmp_path, monkeypatch, name: str) -> None:
    """Real width and every card keyword, 2 blocks: the preset loads timm's file and gives the card's embedding."""
    *_, filename = CARDS[name]
    path = tmp_path / filename
    ref = _write_card_checkpoint(name, path, depth=2)
    _at_depth(monkeypatch, name, 2)
    tiles = _tiles(2, TILE[name], seed=1)
    expect = _card_embedding(name, ref, tiles)
    enc = build_encoder(name, weights=path).eval()
    _, _, resize, (mean, std), _, _ = CARDS[name]
    card_input = transforms.Compose([*resize(), transforms.ToTensor(), transforms.Normalize(mean, std)])
    card_x = torch.stack([card_input(Image.fromarray(t)) for t in tiles])
    with torch.no_grad():
        ours_x = enc.prepare(tiles_to_tensor(tiles))
    assert ours_x.shape == card_x.shape == (2, 3, 224, 224)
    grey = (ours_x - card_x).abs() * torch.tensor(std).view(1, 3, 1, 1) * 255  # in grey levels
    pil_resizes = any(isinstance(t, transforms.Resize) and t.size != TILE[name] for t in resize())
    assert float(grey.max()) <= (1.5 if pil_resizes else 1e-3), f"{name}: model input differs by {float(grey.max())} grey levels"
    if pil_resizes:  # the same pixels as the card's model saw: the card's resized uint8 tiles
        tiles = np.stack([np.asarray(transforms.Compose(resize())(Image.fromarray(t))) for t in tiles])
    else:
        assert enc.preprocessing(TILE[name])["resize"] in ("none", "central 224 px crop")
    with torch.no_grad():
        got = enc(tiles_to_tensor(tiles))
    assert got.shape == expect.shape == (2, fm.PRESETS[name].embed_dim)
    cos = _cosines(got, expect)
    assert cos.min() >= COSINE, f"{name}: cosine {cos.tolist()}"
    if CARDS[name][4] == "cls_mean":  # each half on its own: the class token, and the mean of the patch tokens
        half = got.shape[1] // 2
        for part in (slice(0, half), slice(half, None)):
            assert _cosines(got[:, part], expect[:, part]).min() >= COSINE, f"{name}: cosine of {part}"


def test_a_wrong_file_is_refused_naming_preset_keys_and_expected_file(tmp_path, monkeypatch) -> None:
    _at_depth(monkeypatch, "virchow2", 2)
    uni = tmp_path / "uni.bin"
    _write_card_checkpoint("uni_v1", uni, depth=2)
    with pytest.raises(ValueError) as err:
        build_encoder("virchow2", weights=uni)
    msg = str(err.value)
    for part in ("uni.bin", "virchow2", "vit_huge_patch14_224", "missing keys: reg_token", "unexpected keys:",
                 "shape mismatches: ", "pytorch_model.bin or model.safetensors", "huggingface.co/paige-ai/Virchow2"):
        assert part in msg, f"{part!r} not in {msg!r}"

    resnet = tmp_path / "resnet18.pth"
    torch.save(build_encoder("resnet18").state_dict(), resnet)
    with pytest.raises(ValueError, match=r"is not a checkpoint of hoptimus0 .*missing keys: cls_token.*unexpected keys: conv1.weight"):
        build_encoder("hoptimus0", weights=resnet)

    odd = tmp_path / "weights.ckpt"
    odd.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights of encoder 'uni_v1': .*weights.ckpt has extension '.ckpt'; expected one of"):
        build_encoder("uni_v1", weights=odd)
    broken = tmp_path / "pytorch_model.bin"
    broken.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"cannot read .*pytorch_model.bin"):
        build_encoder("uni_v1", weights=broken)
    pickled = tmp_path / "pickled.pth"
    torch.save({"model": torch.nn.Linear(2, 2)}, pickled)  # a pickled module: weights_only refuses to unpickle it
    with pytest.raises(ValueError, match=r"cannot read .*pickled.pth"):
        build_encoder("uni_v1", weights=pickled)
    with pytest.raises(FileNotFoundError, match=r"nope.safetensors not found; the preset expects pytorch_model.bin from huggingface.co/MahmoodLab/UNI"):
        build_encoder("uni_v1", weights=tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="timm has no architecture 'not_a_model'"):
        build_encoder("timm:not_a_model")


def test_timm_architecture_with_yaml_kwargs(tmp_path) -> None:
    """``timm:<architecture>``: timm's model with the YAML's kwargs, mean/std and input size; 32 px tiles resized."""
    from wsi_pipeline.config.model import EncoderConfig
    from wsi_pipeline.config.schema import build

    cfg = build(EncoderConfig, {"name": "timm:vit_small_patch16_224", "timm_kwargs": {"depth": 2, "img_size": 64},
                                "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}, "encoder")
    torch.manual_seed(0)
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, depth=2, img_size=64, num_classes=0)
    path = tmp_path / "small.safetensors"
    from safetensors.torch import save_file

    save_file(ref.state_dict(), str(path))
    enc = build_encoder(cfg.name, weights=path, **cfg.build_options()).eval()
    assert enc.preset.input_size == 64 and enc.num_features == 384
    tiles = _tiles(3, 32, seed=2)
    tf = transforms.Compose([transforms.Resize(64, interpolation=BICUBIC), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.25,) * 3)])
    with torch.no_grad():
        expect = ref.eval()(torch.stack([tf(Image.fromarray(t)) for t in tiles]))
        got = enc(tiles_to_tensor(tiles))
    assert _cosines(got, expect).min() >= COSINE
    assert enc.preprocessing(32)["resize"] == "bicubic antialiased resize 32 -> 64 px"


def test_presets_follow_their_cards() -> None:
    """The table of presets against the cards' facts (the parameter counts the cards state, on the meta device)."""
    counts = {"uni_v1": 303_350_784, "uni_v2": 681_394_176, "virchow2": 631_239_424, "hoptimus0": 1_134_774_272,
              "hoptimus1": 1_134_774_272, "gigapath": 1_134_953_984}
    for name, (arch, *_rest) in CARDS.items():
        preset = fm.PRESETS[name]
        assert preset.architecture == arch
        with torch.device("meta"):
            enc = fm.build_foundation_encoder(name)
        assert sum(p.numel() for p in enc.parameters()) == counts[name], name
        assert (preset.mean, preset.std) == CARDS[name][3]
        assert preset.embedding == CARDS[name][4] and CARDS[name][5] in preset.weights_files


def test_features_cli_with_a_preset_records_and_keys_the_cache(store_cohort, tmp_path, monkeypatch) -> None:
    """``features --encoder uni_v1 --weights FILE``: the features are the encoder's, the file records preset,
    weights sha256 and preprocessing, and another weights file re-extracts (the cache is keyed by them)."""
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.inference.features import features_path, read_features
    from wsi_pipeline.data.store import open_store, store_path
    from wsi_pipeline.manifests.schema import read_manifest

    small = dict(depth=1, embed_dim=32, num_heads=2)
    monkeypatch.setitem(fm.PRESETS, "uni_v1", fm.replace_preset(fm.PRESETS["uni_v1"], timm_kwargs=small, embed_dim=32))
    files = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = timm.create_model("vit_large_patch16_224", pretrained=False, **{**CARDS["uni_v1"][1], **small})
        files.append(tmp_path / f"w{seed}" / "pytorch_model.bin")
        files[-1].parent.mkdir()
        torch.save(model.state_dict(), files[-1])
    manifest = tmp_path / "m.csv"
    read_manifest(store_cohort).head(2).to_csv(manifest, index=False)
    tiles_dir, out = store_cohort.parent / "tiles", tmp_path / "feats"
    args = ["features", "--manifest", str(manifest), "--tiles", str(tiles_dir), "--out", str(out), "--encoder", "uni_v1",
            "--weights", str(files[0]), "--batch-size", "7", "--no-progress"]
    assert main(args) == 0
    enc = build_encoder("uni_v1", weights=files[0]).eval()
    sid = read_manifest(manifest)["slide_id"].iloc[0]
    feats, _, attrs = read_features(features_path(out, sid))
    store = open_store(store_path(tiles_dir, sid))
    with torch.no_grad():
        ref = enc(tiles_to_tensor(store.read())).numpy()
    np.testing.assert_allclose(feats, ref, rtol=1e-4, atol=1e-5)  # batches of 7 vs all at once: float32 reassociation
    assert attrs["encoder"] == "uni_v1" and attrs["weights_file_sha256"] == fm.file_sha256(files[0])
    assert '"resize": "bilinear antialiased resize 32 -> 224 px"' in attrs["preprocessing"]
    assert attrs["precision"] == "float32" and attrs["feature_dim"] == 32
    assert main(args) == 0  # up to date: skipped
    report = (out / "features_report.csv").read_text()
    assert report.count(",skipped,") == 2
    assert main([*args[:-4], str(files[1]), *args[-3:]]) == 0  # another file: re-extracted
    _, _, attrs2 = read_features(features_path(out, sid))
    assert attrs2["weights_file_sha256"] == fm.file_sha256(files[1]) != attrs["weights_file_sha256"]
    assert main(["features", "--manifest", str(manifest), "--tiles", str(tiles_dir), "--out", str(tmp_path / "timm"),
                 "--encoder", "timm:vit_tiny_patch16_224", "--no-progress"]) == 0  # random init, warns
