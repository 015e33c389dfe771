"""Foundation-model ViTs trained end to end: exact accumulation (float64), checkpointing, partial
fine-tuning (frozen blocks, layer-wise decay, LoRA), checkpoints of the trained part only, and
the strategies that cannot take a ViT (Big-Layers) or can (PatchGD)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from wsi_pipeline.config.model import EncoderConfig
from wsi_pipeline.config.schema import build
from wsi_pipeline.methods.models import build_method_encoder
from wsi_pipeline.models import build_aggregator
from wsi_pipeline.models.finetune import LoRALinear, trained_state
from wsi_pipeline.training.accumulate import accumulate_step, classification_loss

#: A Virchow2-shaped ViT at toy size: 4 register tokens, SwiGLU, class token ++ mean of patch tokens.
TINY = {
    "name": "timm:vit_huge_patch14_224",
    "timm_kwargs": {"img_size": 28, "patch_size": 14, "embed_dim": 24, "depth": 3, "num_heads": 2, "reg_tokens": 4,
                    "mlp_ratio": 5.3375, "mlp_layer": "SwiGLUPacked", "act_layer": "silu", "global_pool": "",
                    "init_values": 0.5},
    "embedding": "cls_mean",
}
VARIANTS = {
    "full": {},
    "checkpointing": {"checkpointing": True},
    "lora_last2": {"lora": {"rank": 2, "alpha": 4.0}, "freeze_blocks": 1},
    "freeze1": {"freeze_blocks": 1},
}
AGGREGATORS = {"abmil": {}, "dtfd": {"n_groups": 3, "distill": "AFS"}, "transmil": {"dim": 16, "num_landmarks": 4}}


def _method(strategy: str = "accumulate", **enc: object) -> SimpleNamespace:
    cfg = build(EncoderConfig, {**TINY, **enc}, "encoder")
    return SimpleNamespace(name="m", strategy=strategy, encoder=cfg)


def _agg_kwargs(name: str) -> dict:
    return {"generator": torch.Generator().manual_seed(5)} if name == "dtfd" else {}


def _grads(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for m in modules for p in m.parameters() if p.requires_grad]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("agg_name", list(AGGREGATORS))
def test_accumulation_with_a_vit_is_exact_in_float64(float64, agg_name: str, variant: str) -> None:
    """accumulate_step's gradient == plain autograd through the whole bag at once (relative <= 1e-10)."""
    torch.manual_seed(0)
    enc = build_method_encoder(_method(**VARIANTS[variant]))
    if VARIANTS[variant].get("lora"):  # adapters start at B = 0: give them a value so their input gradient matters
        with torch.no_grad():
            for m in enc.modules():
                if isinstance(m, LoRALinear):
                    m.lora_b.normal_(0, 0.1)
    agg = build_aggregator(agg_name, enc.num_features, 3, dropout=0.0, **AGGREGATORS[agg_name])
    tiles = torch.randn(11, 3, 28, 28)
    label = 2

    # reference: the bag through encoder and aggregator with gradient in one go, one backward
    enc.train()
    out = agg(enc(tiles), **({"label": label} if agg_name == "dtfd" else {}), **_agg_kwargs(agg_name))
    ref_loss = classification_loss(out, label)
    ref_loss.backward()
    ref = _grads(enc, agg)
    scale = max(float(g.abs().max()) for g in ref)
    assert scale > 0 and sum(float(g.abs().sum()) for g in _grads(enc)) > 0, "the encoder must get gradient"
    for chunk in (1, 4):
        enc.zero_grad(set_to_none=True)
        agg.zero_grad(set_to_none=True)
        loss = accumulate_step(enc, agg, tiles, label, chunk, aggregator_kwargs=_agg_kwargs(agg_name))
        assert abs(loss - float(ref_loss.detach())) <= 1e-12 * max(1.0, abs(float(ref_loss.detach())))
        rel = max(float((a - b).abs().max()) for a, b in zip(_grads(enc, agg), ref)) / scale
        assert rel <= 1e-10, f"chunk {chunk}: relative gradient difference {rel:.2e}"


def test_checkpointing_is_on_for_trained_vits_and_keeps_the_function(float64) -> None:
    torch.manual_seed(0)
    on = build_method_encoder(_method())  # default: on when the weights train
    assert on.model.grad_checkpointing
    assert not build_method_encoder(_method(checkpointing=False)).model.grad_checkpointing
    assert not build_method_encoder(_method("frozen")).model.grad_checkpointing
    assert not build_method_encoder(_method(), training=False).model.grad_checkpointing
    off = build_method_encoder(_method(checkpointing=False))
    off.load_state_dict(on.state_dict())
    x = torch.randn(3, 3, 28, 28)
    a, b = on(x), off(x)
    a.square().sum().backward()
    b.square().sum().backward()
    assert torch.equal(a, b)
    for (name, p), q in zip(on.named_parameters(), off.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_checkpointing_bounds_saved_activations_by_block_inputs(float64) -> None:
    """With checkpointing, what a chunk keeps for backward grows with depth only by each block's input
    (tokens x width), not by the blocks' internal activations (attention maps, MLP hidden states)."""
    from benchmarks.memory import SavedTensorMeter

    def peak(depth: int, ckpt: bool) -> int:
        torch.manual_seed(0)
        kw = {**TINY["timm_kwargs"], "depth": depth}
        enc = build_method_encoder(_method(timm_kwargs=kw, checkpointing=ckpt))
        x = torch.randn(4, 3, 28, 28)
        with SavedTensorMeter(exclude=(enc,)) as meter:
            enc(x).sum().backward()
        return meter.peak

    tokens, width = 1 + 4 + 4, 24
    block_input = 4 * tokens * width * 8  # bytes of one block's input for 4 tiles, float64
    plain = peak(6, False) - peak(2, False)
    ckpt = peak(6, True) - peak(2, True)
    assert ckpt <= 4 * block_input, f"4 more checkpointed blocks kept {ckpt} bytes, more than their inputs"
    assert plain >= 5 * ckpt, f"without checkpointing 4 blocks keep {plain} bytes; checkpointed {ckpt}"


def test_freeze_blocks_and_layer_decay_groups(float64) -> None:
    torch.manual_seed(0)
    enc = build_method_encoder(_method(freeze_blocks=2))
    frozen = [n for n, p in enc.named_parameters() if not p.requires_grad]
    assert all(n.startswith(("model.patch_embed.", "model.cls_token", "model.reg_token", "model.pos_embed",
                             "model.blocks.0.", "model.blocks.1.")) for n in frozen)
    assert any(n.startswith("model.blocks.1.") for n in frozen) and any(n.startswith("model.patch_embed") for n in frozen)
    trained = set(trained_state(enc))
    assert trained and all(k.startswith(("model.blocks.2.", "model.norm.", "model.fc_norm")) for k in trained)
    with pytest.raises(ValueError, match="freeze_blocks=4, but the encoder has 3 blocks"):
        build_method_encoder(_method(freeze_blocks=4))

    # layer-wise decay (timm's grouping): block i of L gets decay ** (L - 1 - i), the embeddings decay ** L,
    # the final norm (grouped with the last block) and the aggregator 1
    from wsi_pipeline.config.train import TrainConfig
    from wsi_pipeline.training.optim import EpochSchedule, build_optimizer
    from wsi_pipeline.training.strategies import Strategy

    strat = Strategy.__new__(Strategy)
    strat.method = SimpleNamespace(encoder=build(EncoderConfig, {**TINY, "layer_decay": 0.5}, "encoder"), train=TrainConfig())
    strat.encoder = build_method_encoder(_method(layer_decay=0.5))
    strat.aggregator = build_aggregator("abmil", strat.encoder.num_features, 2)
    groups = strat.param_groups()
    scale_of = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    named = dict(strat.encoder.named_parameters())
    assert scale_of[id(named["model.blocks.2.attn.qkv.weight"])] == 1.0
    assert scale_of[id(named["model.blocks.1.mlp.fc2.weight"])] == 0.5
    assert scale_of[id(named["model.blocks.0.attn.qkv.weight"])] == 0.5**2
    assert scale_of[id(named["model.patch_embed.proj.weight"])] == 0.5**3
    assert scale_of[id(named["model.reg_token"])] == 0.5**3
    assert scale_of[id(named["model.norm.weight"])] == 1.0
    assert all(scale_of[id(p)] == 1.0 for p in strat.aggregator.parameters())
    assert len(scale_of) == sum(1 for p in strat.encoder.parameters()) + sum(1 for p in strat.aggregator.parameters())
    train = TrainConfig(lr=1e-3, schedule="none")
    opt = build_optimizer(groups, train, total_steps=1)
    EpochSchedule(opt, train).set_epoch(0)
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lrs[id(named["model.blocks.0.attn.qkv.weight"])] == pytest.approx(1e-3 * 0.5**2, rel=1e-15)


def test_lora_starts_as_the_base_model_and_trains_only_adapters(float64) -> None:
    torch.manual_seed(0)
    base = build_method_encoder(_method(checkpointing=False))
    torch.manual_seed(0)
    lora = build_method_encoder(_method(lora={"rank": 2, "alpha": 4.0}, checkpointing=False))
    missing, unexpected = lora.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.endswith(("lora_a", "lora_b")) for k in missing) and len(missing) == 2 * 2 * 3
    x = torch.randn(2, 3, 28, 28)
    assert torch.equal(lora(x), base(x))  # B = 0: the adapters add exactly nothing
    assert set(trained_state(lora)) == set(missing)
    qkv = lora.model.blocks[0].attn.qkv
    assert isinstance(qkv, LoRALinear) and qkv.weight is not None and not qkv.weight.requires_grad
    # the adapted layer's function: W x + b + (alpha / r) B A x, against a hand computation
    with torch.no_grad():
        qkv.lora_b.normal_()
        v = torch.randn(5, 24)
        expect = v @ qkv.weight.T + qkv.bias + 2.0 * (v @ qkv.lora_a.T) @ qkv.lora_b.T
        torch.testing.assert_close(qkv(v), expect, rtol=1e-13, atol=1e-13)


def test_bigl_refuses_a_vit_and_frozen_refuses_fine_tuning_options() -> None:
    from wsi_pipeline.training.strategies import check_strategy

    m = SimpleNamespace(name="vit_bigl", strategy="bigl", encoder=build(EncoderConfig, TINY, "encoder"))
    with pytest.raises(ValueError, match="strategy 'bigl' needs a CNN encoder .* use|strategy 'accumulate'"):
        check_strategy(m)
    m = SimpleNamespace(name="vit_frozen", strategy="frozen", encoder=build(EncoderConfig, {**TINY, "lora": {}}, "encoder"))
    with pytest.raises(ValueError, match="encoder.lora fine-tunes the encoder, but strategy 'frozen' never trains it"):
        check_strategy(m)
    with pytest.raises(ValueError, match="apply to foundation-model"):
        build(EncoderConfig, {"name": "resnet18", "freeze_blocks": 2}, "encoder")
    with pytest.raises(ValueError, match="apply to 'timm:<architecture>' encoders only"):
        build(EncoderConfig, {"name": "uni_v1", "timm_kwargs": {"depth": 2}}, "encoder")
