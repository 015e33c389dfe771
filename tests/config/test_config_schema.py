"""The generic config builder: every error names the field's path; choices and bounds from field metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from wsi_pipeline.config.pipeline import config_from_dict
from wsi_pipeline.config.schema import build, spec


@dataclass(frozen=True)
class Inner:
    lr: float = 1.0
    mode: Literal["a", "b"] = "a"


@dataclass(frozen=True)
class Outer:
    name: str
    count: int = field(default=1, metadata=spec(ge=1))
    fraction: float | None = field(default=None, metadata=spec(gt=0.0, le=1.0))
    colour: str = field(default="red", metadata=spec(choices=lambda: ["red", "blue"]))
    sizes: tuple[int, ...] = ()
    pair: tuple[float, float] = (0.0, 1.0)
    inner: Inner = field(default_factory=Inner)
    items: tuple[Inner, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


def test_build_types_values_and_defaults():
    got = build(Outer, {"name": "x", "count": 3, "fraction": 1, "sizes": [1, 2], "pair": [1, "2e-1"],
                        "inner": {"lr": "1e-4", "mode": "b"}, "items": [{"lr": 2}], "options": {"k": [1]}})
    assert got == Outer("x", 3, 1.0, "red", (1, 2), (1.0, 0.2), Inner(1e-4, "b"), (Inner(2.0),), {"k": [1]})
    assert isinstance(got.fraction, float) and isinstance(got.items[0].lr, float)  # YAML ints become floats
    assert build(Outer, {"name": "y"}) == Outer("y")


@pytest.mark.parametrize(
    "raw, exc, match",
    [
        ({"name": "x", "cuont": 1}, ValueError, r"unknown key 'cuont' in section 'sec'; valid keys: \['colour', 'count',"),
        ({"name": "x", "inner": {"lrr": 1}}, ValueError, r"unknown key 'lrr' in section 'sec.inner'; valid keys: \['lr', 'mode'\]"),
        ({"name": "x", "items": [{}, {"mode": "c"}]}, ValueError, r"sec.items\[1\].mode='c'; expected one of 'a', 'b'"),
        ({"name": "x", "items": [{"lr": "x"}]}, TypeError, r"sec.items\[0\].lr: expected a number, got str 'x'"),
        ({"name": "x", "count": "3"}, TypeError, r"sec.count: expected an integer, got str '3'"),
        ({"name": "x", "count": True}, TypeError, r"sec.count: expected an integer, got bool True"),
        ({"name": "x", "count": 0}, ValueError, r"sec.count=0; expected a value >= 1"),
        ({"name": "x", "fraction": 1.5}, ValueError, r"sec.fraction=1.5; expected a value <= 1.0"),
        ({"name": "x", "fraction": 0}, ValueError, r"sec.fraction=0.0; expected a value > 0.0"),
        ({"name": "x", "fraction": "half"}, TypeError, r"sec.fraction: expected a number or null, got str 'half'"),
        ({"name": "x", "colour": "green"}, ValueError, r"sec.colour='green'; expected one of \['red', 'blue'\]"),
        ({"name": "x", "pair": [1.0]}, TypeError, r"sec.pair: expected a list of 2 values \(a number, a number\)"),
        ({"name": "x", "sizes": [1, "b"]}, TypeError, r"sec.sizes\[1\]: expected an integer, got str 'b'"),
        ({"name": "x", "options": [1]}, TypeError, r"sec.options: expected a mapping, got list"),
        ({"count": 2}, ValueError, r"missing required key 'name' in section 'sec'"),
        (["name"], TypeError, r"sec: expected a mapping with keys \['name', 'count',"),
    ],
)
def test_build_errors_name_the_field_path(raw, exc, match):
    with pytest.raises(exc, match=match):
        build(Outer, raw, "sec")


def _pipeline(**method) -> dict:
    return {"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
            "methods": [{"name": "a", "strategy": "frozen"}, {"name": "b", "strategy": "accumulate", **method}]}


@pytest.mark.parametrize(
    "method, exc, match",
    [
        ({"train": {"lr": "x"}}, TypeError, r"methods.b.train.lr: expected a number, got str 'x'"),
        ({"encoder": {"name": "resnet9"}}, ValueError, r"methods.b.encoder.name='resnet9'; expected one of \[.*'resnet18', .*\] or 'timm:<architecture>'"),
        ({"encoder": {"bn": "batch"}}, ValueError, r"methods.b.encoder.bn='batch'; expected one of 'frozen', 'chunk', 'train'"),
        ({"aggregator": {"name": "mlp"}}, ValueError, r"methods.b.aggregator.name='mlp'; expected one of \[.*'abmil'.*'transformer'"),
        ({"strategy": "fancy"}, ValueError, r"methods.b.strategy='fancy'; expected one of \['frozen', 'full', 'accumulate'"),
        ({"train": {"schedule": "step"}}, ValueError, r"methods.b.train.schedule='step'; expected one of 'cosine'"),
        ({"train": {"select_metric": "f1"}}, ValueError, r"methods.b.train.select_metric='f1'; expected one of 'auto', 'auc'"),
        ({"train": {"device": "tpu"}}, ValueError, r"methods.b.train.device='tpu'; expected auto, cpu, cuda, mps or cuda:<index>"),
        ({"chunk_size": "big"}, TypeError, r"methods.b.chunk_size: expected an integer, got str 'big'"),
    ],
)
def test_pipeline_errors_name_the_method_field(method, exc, match):
    with pytest.raises(exc, match=match):
        config_from_dict(_pipeline(**method))


def test_unnamed_method_is_named_by_index():
    raw = _pipeline()
    raw["methods"].append({"strategy": "full", "train": {"lr": "x"}})
    with pytest.raises(ValueError, match=r"missing required key 'name' in section 'methods\[2\]'"):
        config_from_dict(raw)
    raw["methods"][2] = {"strategy": "full", "nmae": "c"}
    with pytest.raises(ValueError, match=r"unknown key 'nmae' in section 'methods\[2\]'"):
        config_from_dict(raw)


def test_device_names_are_the_cli_ones():
    """``train.device`` accepts what every command's ``--device`` accepts (mps included), and nothing else."""
    from wsi_pipeline.devices import DEVICES, check_device

    for name in (*DEVICES, "cuda:0", "cuda:3"):
        raw = _pipeline(train={"device": name})
        assert config_from_dict(raw).methods[1].train.device == name == check_device(name)
    for bad in ("gpu", "cuda:", "mps:0", "CPU", "cuda:x"):
        with pytest.raises(ValueError, match=r"methods.b.train.device="):
            config_from_dict(_pipeline(train={"device": bad}))
        with pytest.raises(ValueError, match=r"--device="):
            check_device(bad, "--device")
