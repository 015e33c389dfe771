"""The foundation-model presets beyond the first six: the peers' timm-compatible catalogue.

Each as its model card (or, where noted in ``unconfirmed``, the peers' loaders: TRIDENT, STAMP,
LazySlide) defines it. Plain data: :mod:`wsi_pipeline.models.foundation` merges these into
``PRESETS``. Cards that publish transformers (Phikon, Phikon-v2, Midnight) keys are read through
:mod:`wsi_pipeline.models.layouts`.

=================  =====================================  ====  ============================
preset             timm architecture                      D     embedding
=================  =====================================  ====  ============================
``virchow``        vit_huge_patch14_224 (SwiGLU)          2560  class token ++ patch mean
``h0_mini``        vit_base_patch14_reg4_dinov2 (SwiGLU)  1536  class token ++ patch mean
``kaiko_vits8``    vit_small_patch8_224                   384   class token
``kaiko_vits16``   vit_small_patch16_224                  384   class token
``kaiko_vitb8``    vit_base_patch8_224                    768   class token
``kaiko_vitb16``   vit_base_patch16_224                   768   class token
``kaiko_vitl14``   vit_large_patch14_reg4_dinov2 (518)    1024  class token
``lunit_vits8``    vit_small_patch8_224                   384   class token
``lunit_vits16``   vit_small_patch16_224                  384   class token
``gpfm``           vit_large_patch14_dinov2               1024  class token
``phikon``         vit_base_patch16_224 (transformers)    768   class token
``phikon_v2``      vit_large_patch14_dinov2 p=16 (trf.)   1024  class token
``midnight``       vit_giant_patch14_dinov2 (trf.)        3072  class token ++ patch mean
=================  =====================================  ====  ============================
"""

from __future__ import annotations

from wsi_pipeline.models.preset import Preset

__all__ = ["CATALOGUE"]

_SWIGLU = dict(mlp_layer="SwiGLUPacked", act_layer="silu")
_HOPTIMUS = ((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))
_HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
#: Lunit's DINO pretraining statistics (benchmark-ssl-pathology), which its timm configs carry.
_LUNIT = ((0.70322989, 0.53606487, 0.66096631), (0.21716536, 0.26081574, 0.20723464))
_KAIKO_NOTE = "card: Resize(224) (bilinear) + CenterCrop(224); TRIDENT the same"
_KAIKO_LICENCE = "kaiko non-commercial (other)"
#: kaiko.ai's weights converted to timm (the file TRIDENT and LazySlide load)
_KAIKO_SOURCE = "huggingface.co/1aurent/{}.kaiko_ai_towards_large_pathology_fms"


def _kaiko(name: str, arch: str, d: int, model: str, **extra: object) -> Preset:
    return Preset(
        name, arch, dict(img_size=224, num_classes=0, dynamic_img_size=True, **extra), embed_dim=d, mean=_HALF[0], std=_HALF[1],
        interpolation="bilinear", weights_files=("model.safetensors",), source=_KAIKO_SOURCE.format(arch),
        licence=_KAIKO_LICENCE, resize_note=_KAIKO_NOTE, model=f"Kaiko {model}",
    )


CATALOGUE: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "virchow", "vit_huge_patch14_224",
            dict(img_size=224, init_values=1e-5, num_classes=0, mlp_ratio=5.3375, global_pool="", dynamic_img_size=True,
                 **_SWIGLU),
            embed_dim=2560, embedding="cls_mean", weights_files=("pytorch_model.bin", "model.safetensors"),
            source="huggingface.co/paige-ai/Virchow", licence="Apache-2.0 (gated)",
            resize_note="card: Resize(224) bicubic + CenterCrop(224) (timm's data config); TRIDENT the same",
            model="Virchow (Paige)",
        ),
        Preset(
            "h0_mini", "vit_base_patch14_reg4_dinov2",
            dict(img_size=224, init_values=1e-5, num_classes=0, mlp_ratio=5.33334, global_pool="", dynamic_img_size=True,
                 **_SWIGLU),
            embed_dim=1536, embedding="cls_mean", mean=_HOPTIMUS[0], std=_HOPTIMUS[1],
            weights_files=("model.safetensors", "pytorch_model.bin"), source="huggingface.co/bioptimus/H0-mini",
            licence="CC-BY-NC-ND-4.0 (gated)", resize_policy="ours",
            resize_note="card: timm's data config of its hub file; ours: bicubic antialiased; LazySlide: Resize(224) bicubic "
                        "+ CenterCrop(224); TRIDENT: timm's data config",
            model="H0-mini (Bioptimus)",
            unconfirmed="mlp_ratio 5.33334 inferred from SwiGLUPacked and the 85.7 M parameters LazySlide lists; the "
                        "embedding (class token ++ patch mean, LazySlide's; TRIDENT's default is the class token)",
        ),
        _kaiko("kaiko_vits8", "vit_small_patch8_224", 384, "ViT-S/8"),
        _kaiko("kaiko_vits16", "vit_small_patch16_224", 384, "ViT-S/16"),
        _kaiko("kaiko_vitb8", "vit_base_patch8_224", 768, "ViT-B/8"),
        _kaiko("kaiko_vitb16", "vit_base_patch16_224", 768, "ViT-B/16"),
        # its file keeps DINOv2's 518 px position grid (37 x 37): timm resamples it to the tile's grid at every forward
        Preset(
            "kaiko_vitl14", "vit_large_patch14_reg4_dinov2", dict(img_size=518, num_classes=0, dynamic_img_size=True),
            embed_dim=1024, mean=_HALF[0], std=_HALF[1], interpolation="bilinear", weights_files=("model.safetensors",),
            source=_KAIKO_SOURCE.format("vit_large_patch14_reg4_dinov2"), licence=_KAIKO_LICENCE,
            resize_note=_KAIKO_NOTE + "; the 518 px position grid resampled by timm (bicubic, antialiased)",
            model="Kaiko ViT-L/14 (4 registers)",
        ),
        Preset(
            "lunit_vits8", "vit_small_patch8_224", dict(img_size=224, num_classes=0, dynamic_img_size=True), embed_dim=384,
            mean=_LUNIT[0], std=_LUNIT[1], weights_files=("model.safetensors",),
            source="huggingface.co/1aurent/vit_small_patch8_224.lunit_dino", licence="Lunit non-commercial",
            resize_policy="ours", resize_note="card: timm's data config of its hub file; ours: bicubic antialiased",
            model="Lunit DINO ViT-S/8", unconfirmed="mean/std as Lunit's repository states them; the hub config's crop",
        ),
        Preset(
            "lunit_vits16", "vit_small_patch16_224", dict(img_size=224, num_classes=0, dynamic_img_size=True), embed_dim=384,
            mean=_LUNIT[0], std=_LUNIT[1], weights_files=("model.safetensors",),
            source="huggingface.co/1aurent/vit_small_patch16_224.lunit_dino", licence="Lunit non-commercial",
            resize_policy="ours", resize_note="card: timm's data config of its hub file; ours: bicubic antialiased",
            model="Lunit DINO ViT-S/16", unconfirmed="mean/std as Lunit's repository states them; the hub config's crop",
        ),
        Preset(
            "gpfm", "vit_large_patch14_dinov2", dict(img_size=224, init_values=1e-5, num_classes=0, dynamic_img_size=True),
            embed_dim=1024, weights_files=("GPFM.pth",), source="huggingface.co/majiabo/GPFM", licence="CC-BY-NC-ND-4.0",
            resize_policy="ours", resize_note="peers: TRIDENT Resize(224) bicubic, LazySlide Resize((224, 224)) bicubic",
            model="GPFM", unconfirmed="the card's own transform (the peers' is used)",
        ),
        Preset(
            "phikon", "vit_base_patch16_224", dict(img_size=224, num_classes=0), embed_dim=768, interpolation="bilinear",
            weights_files=("pytorch_model.bin", "model.safetensors"), source="huggingface.co/owkin/phikon",
            licence="Owkin non-commercial", layout="transformers_vit", norm_eps=1e-12,
            resize_note="card: ViTImageProcessor resize to 224 x 224 (bilinear); TRIDENT Resize(224) bilinear",
            model="Phikon (Owkin, iBOT ViT-B/16)",
        ),
        Preset(
            "phikon_v2", "vit_large_patch14_dinov2",
            dict(img_size=224, patch_size=16, init_values=1e-5, num_classes=0), embed_dim=1024,
            weights_files=("model.safetensors",), source="huggingface.co/owkin/phikon-v2", licence="Owkin non-commercial",
            layout="transformers_dinov2", resize_policy="ours",
            resize_note="ours: bicubic antialiased; TRIDENT: Resize(224) bilinear", model="Phikon-v2 (Owkin, DINOv2 ViT-L/16)",
            unconfirmed="the card's image processor (resize and crop)",
        ),
        Preset(
            "midnight", "vit_giant_patch14_dinov2", dict(img_size=224, num_classes=0, init_values=1e-5), embed_dim=3072,
            embedding="cls_mean", mean=_HALF[0], std=_HALF[1], interpolation="bilinear", weights_files=("model.safetensors",),
            source="huggingface.co/kaiko-ai/midnight", licence="MIT", layout="transformers_dinov2",
            resize_note="card: Resize(224) (bilinear) + CenterCrop(224); TRIDENT and LazySlide the same; the file's 518 px "
                        "position grid resampled once as transformers does",
            model="Midnight-12k (kaiko.ai)",
            unconfirmed="the embedding (class token ++ patch mean, LazySlide's and the card's for classification; TRIDENT's "
                        "default is the class token)",
        ),
    )
}
