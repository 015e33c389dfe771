"""Ctrl-C: one line saying how to continue, no traceback; the same command then continues the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline_helpers import make_config
from wsi_pipeline.checkpoints.files import load_run_checkpoint

# train, and touch a flag file once the first epoch's checkpoint exists
TRAIN_AND_FLAG = r"""
import sys, threading, time, pathlib
from wsi_pipeline.cli.main import main
config, run_dir, flag = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
def watch():
    while not (run_dir / "last.pt").exists():
        time.sleep(0.02)
    flag.touch()
threading.Thread(target=watch, daemon=True).start()
sys.exit(main(["train", "--config", config, "--no-progress"]))
"""


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_a_rerun_continues(tmp_path, store_cohort):
    method = [{"name": "m", "strategy": "accumulate", "chunk_size": 4}]
    cfg = make_config(tmp_path, store_cohort, method, name="t", train={"epochs": 3})
    run_dir = tmp_path / "runs" / "t" / "m" / "seed0"
    flag = tmp_path / "epoch.flag"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_AND_FLAG, str(cfg), str(run_dir), str(flag)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not flag.exists():
        if proc.poll() is not None:
            pytest.fail(f"training ended before its first epoch ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "no epoch finished in time"
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, "Ctrl-C took too long to stop the run"
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and "Run the same command again" in lines[0]
    assert not (run_dir / "done").exists()
    epoch = load_run_checkpoint(run_dir / "last.pt").epoch
    assert 1 <= epoch < 3

    from wsi_pipeline.cli.main import main

    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0  # the same command, no flag
    assert (run_dir / "done").exists() and load_run_checkpoint(run_dir / "last.pt").epoch == 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt is the point
def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_next_unit_of_work():
    """Python prints and drops a KeyboardInterrupt raised inside ``__del__``; the recorded request is raised again."""
    import gc

    from wsi_pipeline import interrupt

    class Closing:
        def __del__(self):  # a finalizer that is running when Ctrl-C arrives
            signal.raise_signal(signal.SIGINT)

    restore = interrupt.install()
    try:
        Closing()  # collected at once: the KeyboardInterrupt inside __del__ is ignored by Python
        gc.collect()
        assert interrupt.requested()
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    finally:
        restore()
    assert not interrupt.requested()
    interrupt.check()  # without the handler nothing is pending


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt is the point
def test_training_stops_at_the_next_bag_after_a_swallowed_ctrl_c(tmp_path, store_cohort, monkeypatch, capsys):
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.training import epoch as epoch_mod

    method = [{"name": "m", "strategy": "accumulate", "chunk_size": 4}]
    cfg = make_config(tmp_path, store_cohort, method, name="t", train={"epochs": 2})
    real, calls = epoch_mod.seed_torch, []

    class Closing:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    def seed_and_maybe_interrupt(*keys):
        calls.append(keys)
        if len(calls) == 2:
            Closing()  # Ctrl-C during a finalizer, before the second bag: swallowed by Python
        real(*keys)

    monkeypatch.setattr(epoch_mod, "seed_torch", seed_and_maybe_interrupt)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 130
    assert len(calls) == 2  # the second bag was seeded, the interrupt raised before the third
    assert "interrupted; finished work is kept" in capsys.readouterr().err
