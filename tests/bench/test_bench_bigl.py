"""bench-bigl's predictions with the host's pointwise work: the fixed-plan table adds each step's host bytes at the
stated rate to the prediction without them, the probe's rate is a rate of the bytes it counts, and a rate that is
not positive is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.bigl import host_rate_probe, main


def test_fixed_plan_table_adds_the_host_work_at_the_stated_rate(tmp_path: Path, capsys) -> None:
    common = ["--no-timing", "--no-budget", "--predict-models", "resnet18", "--predict-sides", "128", "256",
              "--predict-stages", "0", "1"]
    assert main([*common, "--host-rate", "inf", "--out", str(tmp_path / "bare.json")]) == 0
    assert main([*common, "--host-rate", "4", "--out", str(tmp_path / "host.json")]) == 0
    out = capsys.readouterr().out
    assert "host GB" in out and "at 4.0 GB/s" in out and "not counted (--host-rate inf)" in out
    bare = json.loads((tmp_path / "bare.json").read_text())
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["host_rate"] == 4e9
    for b, h in zip(bare["predicted"], host["predicted"], strict=True):
        assert (b["stages"], b["side"], b["host_bytes"]) == (h["stages"], h["side"], h["host_bytes"])
        if b["stages"] is None:
            assert h["host_bytes"] == 0
        else:  # the stem's activations alone: ReLU, max-pool, their gradients (more than 8 of its 64-channel maps)
            assert h["host_bytes"] > 8 * 64 * (b["side"] // 2) ** 2 * 4
        for link in b["predicted"]:
            extra = h["host_bytes"] / 4e9
            assert h["predicted"][link]["serial_s"] == pytest.approx(b["predicted"][link]["serial_s"] + extra, rel=1e-12)
            assert h["predicted"][link]["overlap_s"] == pytest.approx(b["predicted"][link]["overlap_s"] + extra, rel=1e-12)


def test_host_rate_probe_is_a_finite_rate() -> None:
    rate = host_rate_probe(side=256, repeats=2)
    assert math.isfinite(rate) and rate > 1e6  # bytes/s: even a slow CPU moves megabytes a second


@pytest.mark.parametrize("rate", ["0", "-3"])
def test_a_host_rate_that_is_not_positive_is_refused(rate: str, capsys) -> None:
    assert main(["--no-timing", "--no-budget", "--host-rate", rate]) == 2
    assert "--host-rate" in capsys.readouterr().err
