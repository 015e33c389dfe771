"""Dask's start-up INFO lines stay hidden on the normal path and show with -v (our package at INFO)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
if sys.argv[1] == "verbose":
    logging.getLogger("wsi_pipeline").setLevel(logging.INFO)
from wsi_pipeline.jobs.cluster import dask_client, parse_cluster
with dask_client(parse_cluster("local:1")) as client:
    assert client.submit(lambda x: x + 1, 1).result() == 2
"""


def _info_lines(mode: str) -> int:
    # a cluster started earlier in this process set DASK_LOGGING__DISTRIBUTED=warning for its workers: start clean
    env = {k: v for k, v in os.environ.items() if k != "DASK_LOGGING__DISTRIBUTED"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return sum(" INFO " in f" {line} " or line.startswith("INFO") for line in run.stderr.splitlines())


@pytest.mark.slow
def test_a_local_cluster_prints_no_info_lines_unless_verbose():
    assert _info_lines("quiet") == 0
    assert _info_lines("verbose") > 0  # the same cluster does log them: the quiet run hid them
