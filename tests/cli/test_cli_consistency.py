"""One command line: the same flags mean the same thing in every command, and help shows no noise.

Flags shared by commands (``--quiet``, ``--no-progress``, ``--set``, ``--device``) are defined once in
``wsi_pipeline.cli._common``; these tests walk every parser the console script builds and hold each
command to the same spelling, help text and accepted values, and compare choice lists with the
registries and with what a pipeline YAML accepts.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wsi_pipeline.cli.main import build_parser, main

#: Commands that do long work, as the user types them (tissue has two).
LONG_RUNNING = ("tile", "train", "eval", "predict", "features", "demo", "tissue train", "tissue predict")
#: Commands that read a pipeline config and so take ``--set``.
CONFIG_COMMANDS = ("train", "eval", "demo")
#: Commands that run models and so take ``--device``.
DEVICE_COMMANDS = ("train", "eval", "predict", "features", "demo", "tissue train", "tissue predict")

#: The least each command needs to parse.
REQUIRED = {
    "tile": ["--slides", "s", "--out", "o"],
    "train": ["--config", "c.yaml"],
    "eval": ["--config", "c.yaml"],
    "predict": ["--model", "m", "--slides", "s", "--out", "o"],
    "features": ["--manifest", "m.csv", "--tiles", "t", "--out", "o"],
    "demo": [],
    "tissue train": ["--slides", "s", "--out", "o"],
    "tissue predict": ["--slides", "s", "--model", "m", "--out", "o"],
}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the console script by its command line (``""`` is the top level, ``"tissue train"``...)."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        out[name] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub_name, sub in a.choices.items():
                    walk(sub, f"{name} {sub_name}".strip())

    walk(build_parser(), "")
    return out


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    assert flag in parser._option_string_actions, f"{parser.prog} has no {flag}"
    return parser._option_string_actions[flag]


def _parse(command: str, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args([*command.split(), *REQUIRED.get(command, []), *extra])


# ----------------------------------------------------------------------------------------------
# --quiet and --no-progress
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", LONG_RUNNING)
def test_every_long_running_command_takes_quiet_and_no_progress_with_one_help_text(command):
    parsers = _parsers()
    reference = parsers["train"]
    for flag in ("--quiet", "--no-progress"):
        action = _option(parsers[command], flag)
        assert action.nargs == 0 and action.default is False
        assert action.help == _option(reference, flag).help  # same words, so the same meaning
    plain, no_progress, quiet = _parse(command), _parse(command, "--no-progress"), _parse(command, "--quiet")
    assert (plain.quiet, plain.no_progress) == (False, False)
    assert (no_progress.quiet, no_progress.no_progress) == (False, True)
    assert (quiet.quiet, quiet.no_progress) == (True, False)  # --quiet implies --no-progress when the command runs


def _tile_log(tmp_path: Path, slide: Path, name: str, flags: list[str], caplog) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="wsi_pipeline"):
        code = main(["tile", "--slides", str(slide.parent), "--out", str(tmp_path / name), "--workers", "0",
                     "--no-qc-images", *flags])
    assert code == 0
    return [r for r in caplog.records if r.name.startswith("wsi_pipeline")]


def test_quiet_and_no_progress_change_what_tile_logs(tmp_path, caplog, monkeypatch):
    """Off a terminal a progress bar becomes INFO lines of ``wsi_pipeline.progress``; --no-progress drops
    them, --quiet drops every INFO line of the package; the logger levels are restored afterwards."""
    from wsi_pipeline.synthetic.slides import make_slide

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    slide = make_slide(tmp_path / "slides" / "a.svs", size=512, seed=3, n_lesions=0, tissue_fraction=0.5).path
    levels = {n: logging.getLogger(n).level for n in ("wsi_pipeline", "wsi_pipeline.progress")}
    logging.getLogger("wsi_pipeline").setLevel(logging.INFO)  # as `-v` would: INFO lines of the stage show
    try:
        plain = _tile_log(tmp_path, slide, "plain", [], caplog)
        assert any(r.name == "wsi_pipeline.progress" and r.levelno == logging.INFO for r in plain)
        no_progress = _tile_log(tmp_path, slide, "no_progress", ["--no-progress"], caplog)
        assert not any(r.name == "wsi_pipeline.progress" for r in no_progress)
        quiet = _tile_log(tmp_path, slide, "quiet", ["--quiet"], caplog)
        assert not [r for r in quiet if r.levelno < logging.WARNING]
        assert logging.getLogger("wsi_pipeline").level == logging.INFO  # what the test set, restored after --quiet
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
    # the tiling itself is the same whatever is shown
    stores = {name: sorted(p.name for p in (tmp_path / name).glob("*.zarr")) for name in ("plain", "no_progress", "quiet")}
    assert stores["plain"] == stores["no_progress"] == stores["quiet"] == ["a.zarr"]


# ----------------------------------------------------------------------------------------------
# --set section.key=value
# ----------------------------------------------------------------------------------------------


def _pipeline_yaml(tmp_path: Path) -> tuple[Path, dict]:
    raw = {
        "name": "p",
        "data": {"manifest": "m.csv", "tiles_dir": "tiles", "n_classes": 2},
        "train": {"epochs": 4, "lr": 1.0e-4},
        "eval": {"bootstrap": 100},
        "seeds": [0],
        "methods": [{"name": "a", "strategy": "accumulate", "chunk_size": 16}, {"name": "b", "strategy": "frozen"}],
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, raw


class _Loaded(Exception):
    """Raised right after a command has resolved its config, so that nothing runs."""


def _config_of(command: str, config: Path, sets: list[str], monkeypatch) -> object:
    """The config ``command`` resolves from ``--config config --set ...``, read through the command's own run path."""
    import wsi_pipeline.config.pipeline as pipeline

    seen = []
    real = pipeline.load_config

    def recording(path, overrides=(), values=None):
        seen.append(real(path, overrides, values=values))
        raise _Loaded

    argv = [command, "--config", str(config), *[x for s in sets for x in ("--set", s)]]
    with monkeypatch.context() as m, pytest.raises(_Loaded):
        m.setattr(pipeline, "load_config", recording)
        main(argv)
    assert len(seen) == 1
    return seen[0]


def test_set_has_one_syntax_in_train_eval_and_demo(tmp_path, monkeypatch):
    from wsi_pipeline.config.pipeline import config_from_dict

    path, raw = _pipeline_yaml(tmp_path)
    sets = ["train.lr=5e-5", "methods.a.chunk_size=8", "methods.1.train.epochs=2", "eval.protocols=[all]",
            "bootstrap=0", "seeds=[0, 1]"]
    # the reference: the same edits made by hand on the parsed YAML
    expected_raw = yaml.safe_load(path.read_text())
    expected_raw["train"]["lr"] = 5e-5
    expected_raw["methods"][0]["chunk_size"] = 8
    expected_raw["methods"][1]["train"] = {"epochs": 2}
    expected_raw["eval"]["protocols"] = ["all"]
    expected_raw["eval"]["bootstrap"] = 0  # the short form: only eval has bootstrap
    expected_raw["seeds"] = [0, 1]
    expected = config_from_dict(expected_raw, default_name="p")
    resolved = {command: _config_of(command, path, sets, monkeypatch) for command in CONFIG_COMMANDS}
    for command, config in resolved.items():
        assert config == expected, command
    assert expected.methods[1].train.epochs == 2 and expected.methods[0].train.epochs == 4
    for command in CONFIG_COMMANDS:
        action = _option(_parsers()[command], "--set")
        assert action.metavar == "SECTION.KEY=VALUE" and action.help == _option(_parsers()["train"], "--set").help


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_set_short_form_only_when_one_section_has_the_key(command, capsys, monkeypatch):
    import wsi_pipeline.cli._common as common

    assert _parse(command, "--set", "epochs=3", "--set", "manifest=x.csv").overrides == ["train.epochs=3", "data.manifest=x.csv"]
    assert _parse(command, "--set", "seeds=[1]").overrides == ["seeds=[1]"]  # a top-level key is already the full form
    with pytest.raises(SystemExit) as e:
        _parse(command, "--set", "no_such_key=1")
    assert e.value.code == 2 and "write SECTION.KEY=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(command, "--set", "train.epochs")  # no value
    assert "expected SECTION.KEY=VALUE" in capsys.readouterr().err
    # a key two sections share must be written in full: the error names both full forms
    real = common._sections
    monkeypatch.setattr(common, "_sections", lambda: {**real(), "data": ("manifest", "seed"), "eval": ("seed",)})
    with pytest.raises(SystemExit):
        _parse(command, "--set", "seed=4")
    err = capsys.readouterr().err
    assert "data.seed=4" in err and "eval.seed=4" in err


# ----------------------------------------------------------------------------------------------
# --device: the names a pipeline YAML accepts
# ----------------------------------------------------------------------------------------------

CANDIDATE_DEVICES = ("auto", "cpu", "cuda", "mps", "cuda:0", "cuda:12", "tpu", "gpu", "CPU", "cuda:", "cuda:x",
                     "mps:0", "xla", "meta", "")


def _yaml_accepts(tmp_path: Path, device: str) -> bool:
    from wsi_pipeline.config.pipeline import load_config

    path, raw = _pipeline_yaml(tmp_path)
    raw["train"]["device"] = device
    path.write_text(yaml.safe_dump(raw))
    try:
        load_config(path)
    except ValueError as e:
        assert "train.device" in str(e)
        return False
    return True


def _device_is_checked_by_config(args: argparse.Namespace, device: str) -> bool:
    """For a command whose --device sets a config value (eval.device, features.device, ...): whether
    the command's config accepts ``device`` (a refusal names the flag); True for the others (argparse checked it)."""
    from wsi_pipeline.cli._common import name_the_flag, config_flags, flag_values
    from wsi_pipeline.config.evaluation import EvalConfig
    from wsi_pipeline.config.features import FeaturesConfig
    from wsi_pipeline.config.predict import PredictConfig
    from wsi_pipeline.config.schema import build
    from wsi_pipeline.config.train import TrainConfig

    if "device" not in config_flags(args):
        return True
    from wsi_pipeline.config.tissue import TissuePredictConfig, TissueTrainConfig

    section, key = config_flags(args)["device"][1].rsplit(".", 1)
    cls = {"train": TrainConfig, "eval": EvalConfig, "features": FeaturesConfig, "predict": PredictConfig, "tissue.train": TissueTrainConfig,
           "tissue.predict": TissuePredictConfig}[section]
    try:
        build(cls, {key: flag_values(args)[f"{section}.{key}"]}, section)
    except ValueError as e:
        assert "--device" in str(name_the_flag(e, args))
        return False
    return True


@pytest.mark.parametrize("command", DEVICE_COMMANDS)
def test_device_accepts_exactly_what_train_device_accepts(command, tmp_path, capsys):
    from wsi_pipeline.devices import DEVICES

    accepted_in_yaml = {d for d in CANDIDATE_DEVICES if _yaml_accepts(tmp_path, d)}
    assert accepted_in_yaml == {"auto", "cpu", "cuda", "mps", "cuda:0", "cuda:12"}
    assert set(DEVICES) <= accepted_in_yaml
    accepted_by_cli = set()
    for d in CANDIDATE_DEVICES:
        try:
            args = _parse(command, "--device", d)
        except SystemExit:
            assert "--device" in capsys.readouterr().err
            continue
        assert args.device == d
        if _device_is_checked_by_config(args, d):
            accepted_by_cli.add(d)
    assert accepted_by_cli == accepted_in_yaml
    assert _option(_parsers()[command], "--device").help.startswith(_option(_parsers()["train"], "--device").help.split(";")[0])


# ----------------------------------------------------------------------------------------------
# Choices from the registries
# ----------------------------------------------------------------------------------------------


def test_features_encoder_choices_are_the_registry(capsys):
    from wsi_pipeline.models import ENCODERS

    action = _option(_parsers()["features"], "--encoder")
    # the registry (ResNets and foundation presets), and any timm architecture by the timm: prefix
    from wsi_pipeline.config.features import FeaturesConfig

    # the flag sets features.encoder when given; the default is the config's
    assert list(action.choices) == [*ENCODERS.names(), "timm:<architecture>"] and action.default is None
    assert FeaturesConfig().encoder in ENCODERS
    for name in [*ENCODERS.names(), "timm:vit_small_patch16_224"]:
        assert _parse("features", "--encoder", name).encoder == name
    with pytest.raises(SystemExit) as e:
        _parse("features", "--encoder", "resnet19")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'resnet19'" in err and all(n in err for n in ENCODERS.names())


def test_other_choice_lists_are_the_library_constants():
    from wsi_pipeline.data.store import COMPRESSIONS
    from wsi_pipeline.export.heatmap import MODES
    from wsi_pipeline.slides.opener import BACKENDS
    from wsi_pipeline.config.tiling import DEFAULT_MIN_FOREGROUND as METHODS

    parsers = _parsers()
    assert set(_option(parsers["tile"], "--method").choices) == set(METHODS)
    assert set(_option(parsers["tile"], "--compression").choices) == set(COMPRESSIONS)
    assert set(_option(parsers["tile"], "--backend").choices) == set(BACKENDS)
    for command in ("eval", "predict"):
        assert list(_option(parsers[command], "--heatmap-mode").choices) == list(MODES)


def test_building_the_parser_imports_no_torch():
    """Choices that live beside torch are read only when a value is checked or a command's help is shown."""
    code = ("import sys; from wsi_pipeline.cli.main import build_parser; "
            "a = build_parser().parse_args(['train', '--config', 'x.yaml', '--device', 'cuda:1', '--set', 'epochs=2']); "
            "print(a.device, a.overrides, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["cuda:1", "['train.epochs=2']", "False"]


# ----------------------------------------------------------------------------------------------
# Help without noise
# ----------------------------------------------------------------------------------------------


def _option_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help as printed (``%(default)s`` and friends expanded)."""
    fmt = parser._get_formatter()
    return {"/".join(a.option_strings) or a.dest: fmt._expand_help(a) if a.help else ""
            for a in parser._actions if not isinstance(a, argparse._SubParsersAction)}


@pytest.mark.parametrize("command", [c for c in _parsers() if c])
def test_help_shows_each_default_once_and_no_empty_ones(command, capsys):
    parser = _parsers()[command]
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for noise in ("(default: None)", "(default: False)", "(default: True)", "(default: [])", "[default"):
        assert noise not in text, f"{command} --help shows {noise}"
    for flag, help_text in _option_helps(parser).items():
        assert help_text.strip(), f"{command} {flag} has no help text"
        assert len(re.findall(r"\bdefault\b", help_text, re.IGNORECASE)) <= 1, f"{command} {flag}: {help_text}"
    for action in parser._actions:
        default = action.default
        shows = action.nargs != 0 and default not in (None, argparse.SUPPRESS) and default != []
        if shows:  # an option with a real default says it, in words or from the formatter
            assert re.search(r"\bdefault\b", _option_helps(parser)["/".join(action.option_strings)], re.IGNORECASE), \
                f"{command} {action.option_strings} does not show its default {default!r}"
        if action.metavar in ("UM", "PX"):  # lengths and resolutions carry their unit
            unit = "um/px" if action.metavar == "UM" else "px"
            assert unit in (action.help or ""), f"{command} {action.option_strings} does not name its unit"


def test_top_level_help_lists_commands_in_the_order_of_the_flow(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    listed = re.findall(r"^ {4}(\w+) ", text, re.MULTILINE)
    assert listed == ["manifest", "tile", "train", "eval", "predict", "features", "weights", "verify", "tissue", "view", "demo"]


#: Each command with a path that does not exist (or a value it refuses), as a user would mistype it.
BAD_CALLS = {
    "manifest": ["manifest", "folder", "--slides", "{missing}", "--out", "{tmp}/m.csv"],
    "tile": ["tile", "--slides", "{missing}", "--out", "{tmp}/tiles"],
    "train": ["train", "--config", "{missing}.yaml"],
    "eval": ["eval", "--config", "{missing}.yaml"],
    "predict": ["predict", "--model", "{missing}", "--slides", "{missing}", "--out", "{tmp}/p"],
    "features": ["features", "--manifest", "{missing}.csv", "--tiles", "{missing}", "--out", "{tmp}/f"],
    "verify": ["verify", "--tiles", "{missing}"],
    "tissue": ["tissue", "predict", "--slides", "{missing}", "--model", "{missing}.pt", "--out", "{tmp}/t"],
    "demo": ["demo", "--config", "{missing}.yaml"],
    "view": ["view", "--slides", "{missing}"],
    "weights": ["weights", "where", "resnet18", "--file", "{missing}"],
}


@pytest.mark.parametrize("command", sorted(BAD_CALLS))
def test_every_command_reports_an_error_in_one_format(command, tmp_path, capsys):
    """One error path (cli/main.py): one line on stderr, `wsi-pipeline <command>: error: ...`, naming the
    missing path, exit status 2, no traceback."""
    missing = str(tmp_path / "no_such_thing")
    argv = [a.format(missing=missing, tmp=tmp_path) for a in BAD_CALLS[command]]
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert lines and lines[-1].startswith(f"wsi-pipeline {command}: error: "), err
    assert missing in lines[-1] and "Traceback" not in err, err
    assert sum("error:" in ln for ln in lines) == 1, err


def test_every_command_has_a_bad_call():
    assert set(BAD_CALLS) == {c.split()[0] for c in _parsers() if c}


def test_the_slide_endings_in_help_and_docs_are_the_finders():
    """`manifest folder --help` and docs/formats.md list exactly the endings the finder looks for."""
    from pathlib import Path

    from wsi_pipeline.slides.finder import SLIDE_EXTENSIONS

    helptext = " ".join((_parsers()["manifest folder"].description or "").split())
    readme = " ".join((Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text().split())
    for ext in SLIDE_EXTENSIONS:
        assert f" {ext} " in f" {helptext.replace(',', ' ')} ", ext
        assert re.search(r"[ `]" + re.escape(ext) + r"[ `]", readme), ext


def test_train_device_is_train_device_and_set_has_the_last_word(tmp_path):
    """`train --device X --set train.device=Y` trains on Y: the flag sets the key, --set comes after (issue 50)."""
    from wsi_pipeline.cli._common import pipeline_from_args

    cfg = tmp_path / "p.yaml"
    cfg.write_text("name: p\ndata: {manifest: m.csv, tiles_dir: t, n_classes: 2}\nmethods:\n"
                   "  - {name: a, strategy: frozen}\n  - {name: b, strategy: frozen, train: {device: cuda}}\n")
    for flags, expected in ((["--device", "cpu"], "cpu"), (["--device", "cpu", "--set", "train.device=mps"], "mps"),
                            (["--set", "train.device=mps", "--device", "cpu"], "mps"), ([], "auto")):
        config = pipeline_from_args(_parse("train", "--config", str(cfg), *flags))
        assert config.methods[0].train.device == expected
        assert config.methods[1].train.device == "cuda"  # a method's own train section is its own
