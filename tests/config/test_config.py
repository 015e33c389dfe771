"""Pipeline configs: validation errors name the field, overrides, per-method merging, round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from wsi_pipeline.config.pipeline import (
    DemonConfig,
    PipelineConfig,
    EvalProtocol,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    method_by_name,
    save_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "pipelines" / "train_example.yaml"


def minimal(**extra) -> dict:
    raw = {
        "data": {"manifest": "m.csv", "tiles_dir": "tiles", "n_classes": 2},
        "methods": [{"name": "a", "strategy": "accumulate"}],
    }
    raw.update(extra)
    return raw


def write(tmp_path: Path, raw: dict, name: str = "pipe.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


def test_example_config_loads_and_round_trips(tmp_path):
    cfg = load_config(EXAMPLE)
    assert isinstance(cfg, PipelineConfig) and cfg.name == "train_example"
    assert [m.name for m in cfg.methods] == ["abmil_frozen", "abmil_e2e", "abmil_e2e_aug"]
    # per-method overrides are merged over the shared train section
    assert method_by_name(cfg, "abmil_frozen").train.lr == pytest.approx(2e-4)
    assert method_by_name(cfg, "abmil_e2e").train.lr == pytest.approx(cfg.train.lr)
    aug = method_by_name(cfg, "abmil_e2e_aug").train.augment
    assert aug.enabled and aug.blur_p == TrainConfig().augment.blur_p  # partial mapping merged with defaults
    assert config_from_dict(config_to_dict(cfg)) == cfg
    saved = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(saved) == cfg


def test_defaults_follow_the_papers(tmp_path):
    cfg = load_config(write(tmp_path, minimal()))
    t = cfg.methods[0].train
    assert (t.bag_size, t.batch_bags, t.accumulate_batches) == (256, 2, 1)
    assert t.weight_decay == pytest.approx(1e-4) and t.gamma == pytest.approx(0.955)
    assert cfg.seeds == (0, 1, 2) and cfg.name == "pipe"  # name defaults to the file's stem
    assert cfg.eval.protocols == (EvalProtocol(), EvalProtocol(256, 100))
    assert cfg.methods[0].encoder.bn == "frozen" and not t.augment.enabled and not t.demon.enabled


@pytest.mark.parametrize(
    "raw, match",
    [
        (minimal(trian={}), r"unknown key 'trian' in section 'top level'; valid keys: \[.*'train'"),
        (minimal(train={"lrr": 1.0}), r"unknown key 'lrr' in section 'train'; valid keys: \[.*'lr'"),
        (minimal(train={"augment": {"blurr": 1}}), r"unknown key 'blurr' in section 'train.augment'; valid keys: \[.*'blur_p'"),
        (
            {**minimal(), "methods": [{"name": "a", "strategy": "full", "encoder": {"nmae": "resnet18"}}]},
            r"unknown key 'nmae' in section 'methods.a.encoder'; valid keys: \['bn', 'calibrate_bn', 'checkpointing', 'dim', 'dropout', 'embedding', 'freeze_blocks', 'frozen_epochs', 'init', 'input_size', 'layer_decay', 'lora', 'lr_scale', 'mean', 'name', 'recalibrate_bn', 'std', 'timm_kwargs', 'weights'\]",
        ),
        (
            {**minimal(), "methods": [{"name": "a", "strategy": "full", "train": {"epoch": 3}}]},
            r"unknown key 'epoch' in section 'methods.a.train'",
        ),
        (minimal(data={"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2, "tiling": {"size": 3}}), r"'data.tiling'"),
    ],
)
def test_unknown_keys_are_named_with_section_and_valid_keys(tmp_path, raw, match):
    with pytest.raises(ValueError, match=match):
        load_config(write(tmp_path, raw))


@pytest.mark.parametrize(
    "train, exc, match",
    [
        ({"epochs": "ten"}, TypeError, r"train.epochs: expected an integer, got str 'ten'"),
        ({"epochs": 2.5}, TypeError, r"train.epochs: expected an integer, got float"),
        ({"lr": "fast"}, TypeError, r"train.lr: expected a number, got str 'fast'"),
        ({"bf16": "yes"}, TypeError, r"train.bf16: expected true or false"),
        ({"clip_grad_norm": [1]}, TypeError, r"train.clip_grad_norm: expected a number or null"),
        ({"schedule": "step"}, ValueError, r"train.schedule='step'; expected one of 'cosine', 'exponential', 'linear', 'none'"),
        ({"augment": {"blur_sigma": [1.0]}}, TypeError, r"train.augment.blur_sigma: expected a list of 2 values"),
        ({"demon": 3}, TypeError, r"train.demon must be true, false or a mapping"),
        ({"bag_size": 0}, ValueError, r"train.bag_size=0; expected a value > 0"),
    ],
)
def test_wrong_types_name_the_field_and_the_expected_type(tmp_path, train, exc, match):
    with pytest.raises(exc, match=match):
        load_config(write(tmp_path, minimal(train=train)))


def test_missing_required_keys_and_bad_names(tmp_path):
    with pytest.raises(ValueError, match=r"missing required key 'n_classes' in section 'data'"):
        load_config(write(tmp_path, {**minimal(), "data": {"manifest": "m", "tiles_dir": "t"}}))
    with pytest.raises(ValueError, match=r"duplicate method name\(s\) \['a'\]"):
        load_config(write(tmp_path, {**minimal(), "methods": [{"name": "a", "strategy": "full"}] * 2}))
    with pytest.raises(ValueError, match=r"method name 'a/b' must be a folder name"):
        load_config(write(tmp_path, {**minimal(), "methods": [{"name": "a/b", "strategy": "full"}]}))
    with pytest.raises(FileNotFoundError, match="pipeline config not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_numbers_without_a_dot_are_floats(tmp_path):
    # YAML 1.1 reads 1e-4 as a string; a float field accepts it as the number it spells
    cfg = load_config(write(tmp_path, minimal()), ["train.lr=1e-4"])
    p = tmp_path / "raw.yaml"
    p.write_text("data: {manifest: m, tiles_dir: t, n_classes: 2}\ntrain: {lr: 1e-4}\nmethods: [{name: a, strategy: full}]\n")
    assert load_config(p).train.lr == 1e-4 == cfg.train.lr


def test_overrides_parse_yaml_scalars_and_address_methods(tmp_path):
    path = write(tmp_path, minimal(methods=[{"name": "a", "strategy": "full"}, {"name": "b", "strategy": "frozen"}]))
    cfg = load_config(path, [
        "train.lr=5e-5",
        "train.epochs=3",
        "seeds=[4, 5]",
        "methods.b.chunk_size=32",       # by name
        "methods.0.encoder.bn=train",    # by index
        "train.demon.beta_init=0.8",     # a section that was `false` (the default) becomes a mapping
        "train.clip_grad_norm=null",
        "eval.val_protocol=sub16x3",
    ])
    assert cfg.train.lr == pytest.approx(5e-5) and cfg.train.epochs == 3 and cfg.seeds == (4, 5)
    assert method_by_name(cfg, "b").chunk_size == 32 and method_by_name(cfg, "a").encoder.bn == "train"
    assert cfg.train.demon == DemonConfig(enabled=True, beta_init=0.8)
    assert all(m.train.lr == pytest.approx(5e-5) for m in cfg.methods)  # shared section reaches every method
    assert cfg.eval.val_protocol == EvalProtocol(16, 3) and cfg.eval.val_protocol.name == "sub16x3"
    with pytest.raises(ValueError, match=r"override 'train.lr': expected section.key=value"):
        load_config(path, ["train.lr"])
    with pytest.raises(ValueError, match=r"no entry named 'c'; entries: \['a', 'b'\]"):
        load_config(path, ["methods.c.chunk_size=2"])
    with pytest.raises(ValueError, match=r"unknown key 'lrr' in section 'train'"):
        load_config(path, ["train.lrr=1"])


def test_apply_overrides_does_not_touch_other_keys():
    raw = minimal(train={"lr": 1.0, "augment": {"enabled": True}})
    apply_overrides(raw, ["train.augment.hue=0.1"])
    assert raw["train"] == {"lr": 1.0, "augment": {"enabled": True, "hue": 0.1}}


def test_protocol_spelling(tmp_path):
    raw = minimal(eval={"val_protocol": "ens8x3", "protocols": ["all", "sub2048x10", "ens2048x10"]})
    cfg = load_config(write(tmp_path, raw))
    assert cfg.eval.protocols == (EvalProtocol(), EvalProtocol(2048, 10), EvalProtocol(2048, 10, ensemble=True))
    assert cfg.eval.val_protocol == EvalProtocol(8, 3, ensemble=True)
    assert config_to_dict(cfg.eval)["protocols"] == ["all", "sub2048x10", "ens2048x10"]  # saved as written
    # the old spellings are errors naming the field, the value and the one spelling
    for bad, where in (("256x100", r"eval.protocols\[0\]='256x100'"), ({"subsample": {"k": 256, "repeats": 100}}, r"eval.protocols\[0\]=\{'subsample'"),
                       ("subsample256x100", r"eval.protocols\[0\]='subsample256x100'"), ("most", r"eval.protocols\[0\]='most'")):
        with pytest.raises(ValueError, match=where + r".*; expected all, sub<k>x<R> .* or ens<k>x<R>"):
            load_config(write(tmp_path, minimal(eval={"protocols": [bad]})))
    with pytest.raises(ValueError, match=r"eval.val_protocol='sub0x3': EvalProtocol.k=0; expected a value >= 1"):
        load_config(write(tmp_path, minimal(eval={"val_protocol": "sub0x3"})))
    with pytest.raises(ValueError, match=r"eval.protocols\[0\]='sub8x20000': EvalProtocol.repeats=20000; expected a value <= 10000"):
        load_config(write(tmp_path, minimal(eval={"protocols": ["sub8x20000"]})))
    with pytest.raises(TypeError, match=r"eval.protocols must be a non-empty list"):
        load_config(write(tmp_path, minimal(eval={"protocols": "all"})))
