"""Checkpoints: plain containers only, atomic writes, weights_only loading, refusal of pickled objects."""

from __future__ import annotations

import pickle
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from wsi_pipeline.checkpoints.files import FORMAT, capture_rng, load_checkpoint, restore_rng, save_checkpoint


class Payload:
    """Any Python object a pickle can carry (and run code on load)."""

    def __init__(self) -> None:
        self.x = 1


def state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {
        "config": {"name": "p", "seeds": [0], "train": {"lr": 1e-3, "clip": None}},
        "epoch": 3,
        "models": {"encoder": None, "aggregator": model.state_dict()},
        "optimizer": opt.state_dict(),
        "rng": capture_rng(),
        "best": {"metric": "auc", "value": float("nan"), "epoch": 2},
        "history": [{"epoch": 1, "train_loss": 0.5}],
    }


def test_round_trip_loads_with_weights_only(tmp_path):
    s = state()
    path = save_checkpoint(tmp_path / "run" / "last.pt", s)
    raw = torch.load(path, weights_only=True)  # the plain torch call works, nothing custom is needed
    assert raw["format"] == FORMAT and raw["epoch"] == 3
    back = load_checkpoint(path)
    for k, v in s["models"]["aggregator"].items():
        assert torch.equal(back["models"]["aggregator"][k], v)
    assert back["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3)
    assert back["config"] == s["config"] and back["history"] == s["history"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt", "last.pt.sha256"]  # no temporary file left behind


def test_a_pickled_object_is_refused_with_a_clear_message(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "models": {}, "payload": Payload()}, path)
    with pytest.raises(ValueError, match=r"refusing to load .*evil\.pt: it carries a pickled Python object") as info:
        load_checkpoint(path)
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)


def test_other_files_are_refused_naming_them(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match=r"plain\.pt is not a wsi-pipeline checkpoint \(format None"):
        load_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*junk\.pt"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "absent.pt")


def test_saving_a_non_plain_object_fails_before_touching_the_file(tmp_path):
    path = save_checkpoint(tmp_path / "last.pt", state())
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"checkpoint\['history'\]\[0\]\['arr'\] is a numpy.ndarray"):
        save_checkpoint(path, {**state(), "history": [{"arr": np.zeros(2)}]})
    with pytest.raises(TypeError, match=r"checkpoint\['models'\]\['x'\] is a .*Payload"):
        save_checkpoint(path, {"models": {"x": Payload()}})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "last.pt.sha256"]


def test_ordered_dicts_and_tuples_are_plain(tmp_path):
    s = {"models": OrderedDict(a=torch.ones(1)), "t": (1, 2.5, "x", None, True)}
    back = load_checkpoint(save_checkpoint(tmp_path / "c.pt", s))
    assert back["t"] == (1, 2.5, "x", None, True)


def test_rng_states_round_trip_through_a_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in the legacy state
    saved = load_checkpoint(save_checkpoint(tmp_path / "rng.pt", {"rng": capture_rng()}))["rng"]
    expected = (random.random(), np.random.normal(), np.random.rand(3).tolist(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng(saved)
    got = (random.random(), np.random.normal(), np.random.rand(3).tolist(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
