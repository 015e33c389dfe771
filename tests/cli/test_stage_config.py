"""One builder for every stage's settings: ``--config FILE``, the stage's flags as overrides, ``--set``.

Each case builds the expected typed config independently (the dataclass from the values written by
hand) and compares it with what the command resolves from flags, from ``--set`` and from a YAML file.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from wsi_pipeline.cli.main import build_parser, main


def _pipeline(tmp_path: Path, **eval_keys: object) -> Path:
    raw = {"name": "p", "data": {"manifest": str(tmp_path / "m.csv"), "tiles_dir": str(tmp_path / "t"), "n_classes": 2},
           "methods": [{"name": "a", "strategy": "frozen"}, {"name": "b", "strategy": "frozen"}]}
    if eval_keys:
        raw["eval"] = dict(eval_keys)
    path = tmp_path / f"p{len(list(tmp_path.glob('p*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


#: eval flags and the eval keys they set (the YAML form of the same values).
EVAL_FLAGS = (["--bootstrap", "7", "--no-heatmaps", "--method", "b", "--batch-size", "3", "--heatmap-mode", "raw",
               "--heatmap-method", "b", "--device", "cpu"])
EVAL_KEYS = {"bootstrap": 7, "heatmaps": False, "methods": ["b"], "batch_size": 3, "heatmap_mode": "raw",
             "heatmap_method": "b", "device": "cpu"}


def test_eval_flags_set_the_same_config_as_set_and_as_yaml(tmp_path):
    from wsi_pipeline.cli._common import pipeline_from_args
    from wsi_pipeline.config.pipeline import load_config

    plain = _pipeline(tmp_path)
    by_flags = pipeline_from_args(_parse("eval", "--config", str(plain), *EVAL_FLAGS, "--results", str(tmp_path / "r")))
    by_set = pipeline_from_args(_parse("eval", "--config", str(plain), "--set", f"eval.results={tmp_path / 'r'}",
                                       *[x for k, v in EVAL_KEYS.items() for x in ("--set", f"eval.{k}={yaml.safe_dump(v).strip().removesuffix('...').strip()}")]))
    in_yaml = load_config(_pipeline(tmp_path, **EVAL_KEYS, results=str(tmp_path / "r")))
    assert by_flags.eval == by_set.eval == dataclasses.replace(in_yaml.eval)
    # the reference: the section made directly from the values
    ev = by_flags.eval
    assert (ev.bootstrap, ev.heatmaps, ev.methods, ev.batch_size, ev.heatmap_mode, ev.heatmap_method, ev.device, ev.results) == (
        7, False, ("b",), 3, "raw", "b", "cpu", str(tmp_path / "r"))
    # nothing given: the config's values (the defaults here) are kept
    untouched = pipeline_from_args(_parse("eval", "--config", str(plain))).eval
    assert (untouched.bootstrap, untouched.heatmaps, untouched.methods, untouched.device) == (1000, True, (), "auto")


def test_set_has_the_last_word_over_a_flag(tmp_path):
    from wsi_pipeline.cli._common import pipeline_from_args

    cfg = pipeline_from_args(_parse("eval", "--config", str(_pipeline(tmp_path)), "--bootstrap", "7", "--set", "eval.bootstrap=9"))
    assert cfg.eval.bootstrap == 9


@pytest.mark.parametrize(("flags", "said"), [
    (["--bootstrap", "-1"], ["eval.bootstrap=-1", ">= 0", "--bootstrap"]),
    (["--bootstrap", str(10**9)], ["eval.bootstrap=1000000000", "<= 100000", "--bootstrap"]),
    (["--batch-size", "0"], ["eval.batch_size=0", "> 0", "--batch-size"]),
    (["--method", "zz"], ["eval.methods", "'zz' is not a method", "['a', 'b']", "--method"]),
    (["--heatmap-method", "zz"], ["eval.heatmap_method", "'zz'", "--heatmap-method"]),
    (["--device", "gpu"], ["eval.device='gpu'", "--device"]),
])
def test_a_bad_eval_flag_is_refused_by_the_config_naming_flag_key_and_file(tmp_path, flags, said, capsys):
    path = _pipeline(tmp_path)
    rc = main(["eval", "--config", str(path), *flags, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    for text in [str(path), *said]:
        assert text in err, (text, err)


def test_eval_runs_the_stage_with_the_one_typed_config(tmp_path, monkeypatch):
    """The command hands evaluate_pipeline the config only: every setting is in config.eval."""
    import wsi_pipeline.evaluation.evaluate as evaluate
    import wsi_pipeline.manifests.folds as folds
    from wsi_pipeline.config.pipeline import PipelineConfig

    seen: list[tuple[PipelineConfig, dict]] = []

    class _Stop(Exception):
        pass

    def recording(config, **kwargs):
        seen.append((config, kwargs))
        raise _Stop

    monkeypatch.setattr(evaluate, "evaluate_pipeline", recording)
    monkeypatch.setattr(folds, "check_not_crossval", lambda *a, **k: None)
    with pytest.raises(_Stop):
        main(["eval", "--config", str(_pipeline(tmp_path)), *EVAL_FLAGS, "--no-progress"])
    (config, kwargs), = seen
    assert isinstance(config, PipelineConfig) and set(kwargs) == {"progress", "cluster", "retries"}
    assert config.eval.bootstrap == 7 and config.eval.methods == ("b",) and config.eval.heatmap_mode == "raw"


def test_with_eval_checks_what_it_replaces(tmp_path):
    from wsi_pipeline.config.pipeline import load_config, with_eval

    cfg = load_config(_pipeline(tmp_path))
    assert with_eval(cfg) is cfg and with_eval(cfg, device=None) is cfg
    changed = with_eval(cfg, methods=["a"], bootstrap=0, results=tmp_path / "x")
    assert (changed.eval.methods, changed.eval.bootstrap, changed.eval.results) == (("a",), 0, str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"EvalConfig\.bootstrap=-3"):
        with_eval(cfg, bootstrap=-3)
    with pytest.raises(ValueError, match=r"eval\.methods: 'c' is not a method"):
        with_eval(cfg, methods=["c"])


# ----------------------------------------------------------------------------------------------
# features and predict: the same builder, their own section
# ----------------------------------------------------------------------------------------------

FEATURES_ARGS = ["features", "--manifest", "m.csv", "--tiles", "t", "--out", "o"]
PREDICT_ARGS = ["predict", "--model", "m", "--slides", "s", "--out", "o"]


def test_features_settings_from_yaml_flags_and_set(tmp_path):
    from wsi_pipeline.cli.features import settings
    from wsi_pipeline.config.features import FeaturesConfig

    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump({"features": {"encoder": "resnet50", "batch_size": 16, "device": "cpu"},
                                    "other": {"ignored": True}}))
    assert settings(_parse(*FEATURES_ARGS)) == FeaturesConfig()
    assert settings(_parse(*FEATURES_ARGS, "--config", str(path))) == FeaturesConfig(encoder="resnet50", batch_size=16, device="cpu")
    got = settings(_parse(*FEATURES_ARGS, "--config", str(path), "--bf16", "--batch-size", "8", "--set", "features.device=auto"))
    assert got == FeaturesConfig(encoder="resnet50", batch_size=8, device="auto", bf16=True)
    assert _parse(*FEATURES_ARGS, "--set", "batch_size=8").overrides == ["features.batch_size=8"]  # short form: its section
    with pytest.raises(ValueError, match=r"features\.batch_size=0; expected a value > 0 \(allowed: > 0 and <= 100000\) \(given as --batch-size\)"):
        settings(_parse(*FEATURES_ARGS, "--batch-size", "0"))
    with pytest.raises(ValueError, match=r"f\.yaml: features\.encoder='resnet19'"):
        settings(_parse(*FEATURES_ARGS, "--config", str(path), "--set", "features.encoder=resnet19"))


def test_predict_settings_from_yaml_flags_and_set(tmp_path):
    from wsi_pipeline.cli.predict import settings
    from wsi_pipeline.config.evaluation import ALL, EvalProtocol
    from wsi_pipeline.config.predict import PredictConfig

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"predict": {"protocols": ["all", "ens8x3"], "mpp": 0.25, "seed": 5}}))
    assert settings(_parse(*PREDICT_ARGS)) == PredictConfig()
    got = settings(_parse(*PREDICT_ARGS, "--config", str(path), "--seed", "7", "--no-heatmaps", "--workers", "0",
                          "--set", "predict.batch_size=4"))
    assert got == PredictConfig(protocols=(ALL, EvalProtocol(8, 3, ensemble=True)), mpp=0.25, seed=7, heatmaps=False,
                                workers=0, batch_size=4)
    by_flag = settings(_parse(*PREDICT_ARGS, "--protocol", "all", "--protocol", "sub4x2"))
    assert by_flag.protocols == (ALL, EvalProtocol(4, 2))
    assert set(by_flag.keywords()) == {f.name for f in dataclasses.fields(PredictConfig)}
    for flags, said in ((["--workers", "-1"], r"predict\.workers=-1; expected a value >= 0 \(allowed: >= 0 and <= 4096\) \(given as --workers\)"),
                        (["--mpp", "0"], r"predict\.mpp=0\.0; expected a value > 0 \(given as --mpp\)"),
                        (["--protocol", "sub0x2"], r"predict\.protocols\[0\]='sub0x2'")):
        with pytest.raises(ValueError, match=said):
            settings(_parse(*PREDICT_ARGS, *flags))


def test_predict_keywords_are_predict_slides_parameters():
    import inspect

    from wsi_pipeline.config.predict import PredictConfig
    from wsi_pipeline.evaluation.predict import predict_slides

    assert set(PredictConfig().keywords()) <= set(inspect.signature(predict_slides).parameters)


def test_tissue_settings_from_yaml_flags_and_set(tmp_path):
    from wsi_pipeline.cli.tissue import settings
    from wsi_pipeline.config.tissue import TissuePredictConfig, TissueTrainConfig

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"tissue": {"train": {"epochs": 3, "lr": 0.01}, "predict": {"mpp": 4.0}}}))
    train = ["tissue", "train", "--slides", "s", "--out", "o"]
    assert settings(_parse(*train)) == TissueTrainConfig()
    got = settings(_parse(*train, "--config", str(path), "--size", "64", "96", "--epochs", "5", "--set", "channels=4"))
    assert got == TissueTrainConfig(epochs=5, lr=0.01, size=(64, 96), channels=4)
    predict = ["tissue", "predict", "--slides", "s", "--model", "m", "--out", "o"]
    assert settings(_parse(*predict, "--config", str(path), "--device", "cuda:1")) == TissuePredictConfig(mpp=4.0, device="cuda:1")
    for argv, said in ((train + ["--lr", "0"], r"tissue\.train\.lr=0\.0; expected a value > 0 \(given as --lr\)"),
                       (train + ["--val-fraction", "1"], r"tissue\.train\.val_fraction=1\.0; expected a value < 1"),
                       (predict + ["--slide-mpp", "-2"], r"tissue\.predict\.slide_mpp=-2\.0; expected a value > 0")):
        with pytest.raises(ValueError, match=said):
            settings(_parse(*argv))


def test_heatmap_modes_of_the_config_are_the_renderers():
    from wsi_pipeline.config.choices import HEATMAP_MODES
    from wsi_pipeline.export.heatmap import MODES

    assert HEATMAP_MODES == MODES
    for command in (["eval", "--config", "c.yaml"], PREDICT_ARGS):
        assert _parse(*command, "--heatmap-mode", "minmax").heatmap_mode == "minmax"


def test_eval_methods_of_the_pipeline_stay_in_a_run_config_of_one_method(tmp_path):
    """A run's saved config holds one method and the pipeline's eval section: it still builds."""
    import dataclasses as dc

    from wsi_pipeline.config.pipeline import load_config

    cfg = load_config(_pipeline(tmp_path, methods=["a", "b"], heatmap_method="b"))
    one = dc.replace(cfg, methods=cfg.methods[:1])  # as training/rundir.run_config makes it
    assert one.eval.methods == ("a", "b")
    with pytest.raises(ValueError, match=r"eval\.methods: 'b' is not a method"):
        one.check_eval_methods()


def test_the_evaluation_stage_settings_do_not_change_a_trained_run(tmp_path):
    """A run folder saved with one set of eval stage settings is the same run under others (nothing to resume
    differently), while a setting of training itself still counts as a change."""
    from wsi_pipeline.config.pipeline import load_config, save_config, with_eval
    from wsi_pipeline.training.rundir import changed_since_finished

    cfg = load_config(_pipeline(tmp_path))
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    other = with_eval(cfg, methods=["a"], batch_size=8, heatmaps=False, heatmap_method="a", heatmap_mode="raw",
                      results=tmp_path / "elsewhere", device="cpu")
    assert changed_since_finished(run, other) == []
    lr = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.5))
    assert any("train.lr" in d for d in changed_since_finished(run, lr))
