"""Users' components through the ``wsi_pipeline.plugins`` entry-point group (wsi_pipeline.plugins).

A tiny installed package is made in a temporary folder: a module and a ``.dist-info`` folder whose
``entry_points.txt`` declares it, which is what ``pip install`` leaves in site-packages and what
``importlib.metadata`` reads from any folder on ``sys.path``. The package registers an aggregator, a
task and a strategy's traits with the project's own decorators.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wsi_pipeline import plugins

REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
import torch
from torch import nn

from wsi_pipeline.models.aggregators import AGGREGATORS, MILOutput
from wsi_pipeline.tasks import register_task
from wsi_pipeline.tasks.regression import Regression


@AGGREGATORS.register("{prefix}_median")
class MedianPool(nn.Module):
    """The median of the instance embeddings, then a linear layer."""

    def __init__(self, in_dim, n_classes):
        super().__init__()
        self.classifier = nn.Linear(in_dim, n_classes)

    def forward(self, z, **kw):
        n = z.shape[0]
        return MILOutput(logits=self.classifier(z.median(dim=0).values), attention=torch.full((n,), 1.0 / n))


@register_task("{prefix}_score")
class Score(Regression):
    """Regression under another name."""
'''


def _install(root: Path, prefix: str, body: str, value: str | None = None) -> None:
    """Write package ``<prefix>_plugin`` and its dist-info (entry point ``<prefix>`` -> ``value``) under ``root``."""
    (root / f"{prefix}_plugin.py").write_text(body)
    info = root / f"{prefix}_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {prefix}-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\n{prefix} = {value or prefix + '_plugin'}\n")


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """``tmp_path`` on ``sys.path``; after the test the plugin state and the registries are as before, so no
    later test sees the toy parts."""
    from wsi_pipeline.models import AGGREGATORS
    from wsi_pipeline.tasks import TASKS, base

    monkeypatch.syspath_prepend(str(tmp_path))
    saved = [(reg, dict(reg._items)) for reg in (AGGREGATORS, TASKS)]
    instances, before = dict(base._INSTANCES), plugins._LOADED
    yield tmp_path
    for reg, items in saved:
        reg._items = items
    base._INSTANCES.clear()
    base._INSTANCES.update(instances)
    plugins._LOADED = before


def test_a_plugin_registers_an_aggregator_and_a_task_found_by_the_registries(plugin_path):
    import torch

    from wsi_pipeline.config.choices import aggregator_names, task_names
    from wsi_pipeline.models import build_aggregator
    from wsi_pipeline.tasks import get_task

    _install(plugin_path, "inproc", PLUGIN.format(prefix="inproc"))
    loaded = plugins.load_plugins(reload=True)
    assert loaded.get("inproc") == "inproc_plugin"
    assert "inproc_median" in aggregator_names() and "inproc_score" in task_names()
    z = torch.randn(7, 4)
    agg = build_aggregator("inproc_median", 4, 1)
    expected = agg.classifier(z.median(dim=0).values)  # the plugin's function, computed here independently
    torch.testing.assert_close(agg(z).logits, expected)
    assert get_task("inproc_score").name == "inproc_score"


def test_a_plugin_function_is_called_once(plugin_path):
    body = "CALLS = []\n\ndef register():\n    CALLS.append(1)\n"
    _install(plugin_path, "fn", body, value="fn_plugin:register")
    plugins.load_plugins(reload=True)
    plugins.load_plugins()
    import fn_plugin  # type: ignore[import-not-found]

    assert fn_plugin.CALLS == [1]


def test_a_broken_plugin_is_named(plugin_path):
    _install(plugin_path, "broken", "raise RuntimeError('no GPU driver')\n")
    with pytest.raises(ImportError, match=r"plugin 'broken' = 'broken_plugin' .*from broken-plugin.* RuntimeError: no GPU driver"):
        plugins.load_plugins(reload=True)


@pytest.mark.slow
def test_a_fresh_process_finds_the_plugin_without_being_told(tmp_path):
    """A worker or a command starts as a new interpreter: the registries load the plugins on the first lookup,
    so a pipeline config naming the plugin's aggregator and task is accepted with no import of the plugin."""
    _install(tmp_path, "fresh", PLUGIN.format(prefix="fresh"))
    code = textwrap.dedent("""
        from wsi_pipeline.config.pipeline import config_from_dict
        cfg = config_from_dict({
            "name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t"},
            "methods": [{"name": "m", "strategy": "frozen", "task": "fresh_score",
                         "aggregator": {"name": "fresh_median"}}],
        })
        print(cfg.task, cfg.methods[0].aggregator.name)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fresh_score", "fresh_median"]
