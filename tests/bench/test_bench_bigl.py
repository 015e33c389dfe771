"""bench-bigl's predictions with the host's pointwise work: the fixed-plan table adds each step's host bytes at the
stated rate to the prediction without them, the probe's rate is a rate of the bytes it counts, and a rate that is
not positive is refused."""

from __future__ import annotations

import json
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


def test_host_rate_probe_is_a_rate_of_the_bytes_it_counts(monkeypatch) -> None:
    """The probe divides the bytes HostWork counts for its ops by their median wall time (no speed is asserted)."""
    import benchmarks.bigl as bench

    clock = iter(range(100))  # every perf_counter() call one "second" later: each timed run takes 1 s
    monkeypatch.setattr(bench.time, "perf_counter", lambda: float(next(clock)))
    rate = host_rate_probe(side=64, repeats=3)
    # the ops on [1, 64, 32, 32] (a = its bytes) and the 16 x 16 pool (m = its elements): the multiplication (a in,
    # a out), the in-place ReLU (2 a), the max-pool (a in; m float32 and m int64 out), backward the pool's (m float32,
    # a, m int64 in; a out), the ReLU's (3 a) and the multiplication's (a in, a out)
    a, m = 64 * 32 * 32 * 4, 64 * 16 * 16
    assert rate == 2 * a + 2 * a + (a + 12 * m) + (12 * m + 2 * a) + 3 * a + 2 * a


@pytest.mark.parametrize("rate", ["0", "-3"])
def test_a_host_rate_that_is_not_positive_is_refused(rate: str, capsys) -> None:
    assert main(["--no-timing", "--no-budget", "--host-rate", rate]) == 2
    assert "--host-rate" in capsys.readouterr().err


def test_measured_points_are_printed_beside_their_predictions(capsys) -> None:
    """The CUDA-only table, fed CPU measurements and a stated bandwidth: each measured point beside the prediction
    of the same step with and without host work (so that a GPU run cannot fail on it)."""
    import torch

    from benchmarks.bigl import _label, _measure_all, _parser, _print_measured_vs_predicted
    from wsi_pipeline.bigl.traffic import DeviceModel, dry_step, predict

    args = _parser().parse_args(["--model", "resnet18", "--warmup", "0", "--repeats", "1", "--stages", "0"])
    configs: list[int | None] = [None, 0]
    results, labels = _measure_all(args, configs, [64], torch.device("cpu"), 1 << 16)
    rows = _print_measured_vs_predicted(results, configs, labels, args, 1 << 16, (12.0, 10.0), 5e9)
    assert "Measured against predicted" in capsys.readouterr().out
    assert [(r["stages"], r["side"]) for r in rows] == [(None, 64), (0, 64)]
    for r, c in zip(rows, configs):
        tr = dry_step("resnet18", c, 64, max_elements=1 << 16)
        bare = predict(tr, DeviceModel("x", 10e9, args.efficiency * 494.7e12), plain=c is None)[1]
        assert r["predicted_without_host_s"] == pytest.approx(bare, rel=1e-12)
        assert r["predicted_s"] == pytest.approx(bare + tr.host_bytes / 5e9, rel=1e-12)
        assert r["measured_s"] == results[c][0].mean
    assert _label(0, (2, 2)) in labels.values()
