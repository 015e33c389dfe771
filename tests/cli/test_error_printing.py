"""The command line tells a user's mistake from a bug (cli/main.py, wsi_pipeline.failures): a config value of
the wrong type is one line (exit 2); a TypeError, AttributeError or KeyError from our code propagates with
its traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wsi_pipeline.cli import verify as verify_cli
from wsi_pipeline.cli.main import main
from wsi_pipeline.failures import ConfigTypeError

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, train: dict) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "p",
        "data": {"manifest": str(tmp_path / "m.csv"), "tiles_dir": str(tmp_path / "tiles"), "n_classes": 2},
        "methods": [{"name": "m", "strategy": "full", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}}],
        "train": train,
    }))
    return path


@pytest.mark.parametrize("train, field", [({"epochs": [1, 2]}, "train.epochs: expected an integer, got list"),
                                          ({"lr": {"a": 1}}, "train.lr: expected a number")])
def test_a_wrong_typed_config_value_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], train: dict,
                                                field: str) -> None:
    rc = main(["train", "--config", str(_config(tmp_path, train)), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("wsi-pipeline train: error: ") and field in lines[0], err
    assert "Traceback" not in err


def test_the_config_type_error_is_a_type_error() -> None:
    """Callers that catch TypeError (the config tests, --set) still catch it; the CLI tells it apart."""
    assert issubclass(ConfigTypeError, TypeError)
    from wsi_pipeline.cli.main import USER_ERRORS

    assert ConfigTypeError in USER_ERRORS and TypeError not in USER_ERRORS


@pytest.mark.parametrize("bug", [TypeError("unsupported operand type(s) for +: 'int' and 'str'"),
                                 AttributeError("'NoneType' object has no attribute 'tiles'"), KeyError("slide_id")],
                         ids=lambda e: type(e).__name__)
def test_a_bug_propagates_with_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: Exception) -> None:
    def run(args):
        raise bug

    monkeypatch.setattr(verify_cli, "run", run)
    with pytest.raises(type(bug)) as info:
        main(["verify", "--tiles", str(tmp_path)])
    assert info.value is bug


def test_a_bug_prints_a_traceback_and_exit_status_1(tmp_path: Path) -> None:
    """The console script as a user runs it: a TypeError in a command is Python's traceback, not one line."""
    script = ("import sys\n"
              "from wsi_pipeline.cli import verify\n"
              "def run(args):\n"
              "    return 1 + 'x'\n"
              "verify.run = run\n"
              "from wsi_pipeline.cli.main import main\n"
              f"sys.exit(main(['verify', '--tiles', {str(tmp_path)!r}]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback (most recent call last)" in out.stderr
    assert "TypeError: unsupported operand type(s) for +: 'int' and 'str'" in out.stderr
    assert "wsi-pipeline verify: error:" not in out.stderr
