"""Progress a person can follow: per-epoch lines, and no carriage-return frames when output is a file."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pipeline_helpers import make_config


def test_bars_become_periodic_log_lines_off_a_terminal(caplog, monkeypatch):
    from wsi_pipeline.progress import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.progress"):
        for _ in progress_bar(range(50), desc="work", unit="item", log_every=3600):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "wsi_pipeline.progress"]
    # the first redraw and the final one, nothing in between (log_every is an hour)
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("work: 100%") and "50/50" in lines[-1]
    assert not any("\r" in ln for ln in lines)
    assert sum("50/50" in ln for ln in lines) == 1, lines  # the final line once, not once per closing step
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.progress"):
        with progress_bar(total=7, desc="inner", leave=False, log_every=3600) as bar:
            for _ in range(7):
                bar.update(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "wsi_pipeline.progress"]
    # a bar that is not left still logs its final count, once
    assert sum("7/7" in ln for ln in lines) == 1 and lines[-1].startswith("inner: 100%"), lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.progress"):
        for _ in progress_bar(range(5), enabled=False):
            pass
    assert not caplog.records


@pytest.mark.slow
def test_a_postfix_per_item_and_nested_bars_do_not_flood_a_log(caplog, monkeypatch):
    """Setting the loss on every item must not redraw (= log) every item; cursor moves of nested bars
    must not reach the log."""
    from wsi_pipeline.progress import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.progress"):
        with progress_bar(total=3, desc="epochs", log_every=3600) as outer:
            for _ in range(3):
                with progress_bar(total=40, desc="epoch", leave=False, log_every=3600) as inner:
                    for i in range(40):
                        inner.set_postfix(loss=1.0 / (i + 1))
                        inner.update(1)
                outer.update(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "wsi_pipeline.progress"]
    assert len(lines) <= 3 * 3 + 3, lines  # a few per bar (start, end), never one per item
    assert not any("\x1b" in ln or ln.strip() == "[A" for ln in lines), lines


def test_train_prints_one_line_per_epoch_to_a_log_file(tmp_path, store_cohort):
    method = [{"name": "m", "strategy": "accumulate", "chunk_size": 4}]
    cfg = make_config(tmp_path, store_cohort, method, name="t", train={"epochs": 2})
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log_file:  # a cluster job's log: not a terminal
        rc = subprocess.run([sys.executable, "-m", "wsi_pipeline.cli.main", "train", "--config", str(cfg)],
                            stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ}, timeout=600).returncode
    text = log_path.read_text()
    assert rc == 0, text[-3000:]
    assert "\r" not in text
    epochs = [ln for ln in text.splitlines() if " epoch " in ln and "train_loss" in ln]
    assert len(epochs) == 2, text[-3000:]
    assert "m seed 0 epoch 1/2" in epochs[0] and "s/epoch" in epochs[0] and "left)" in epochs[0]
    assert "epoch 2/2" in epochs[1] and "~0 s left" in epochs[1]


@pytest.mark.parametrize("command", ["tile", "train", "eval", "predict", "features", "demo"])
def test_every_long_command_takes_no_progress(command):
    from wsi_pipeline.cli.main import build_parser

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    assert "--no-progress" in sub._option_string_actions, f"{command} has no --no-progress"
