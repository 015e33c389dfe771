"""The GPU check (tools/gpu_check.sh, benchmarks/encoders_gpu.py) stays runnable from a machine without a GPU.

The script runs only where a GPU is lent, rarely and briefly, so what can be checked here is checked
here: it parses, every test it names exists, the CUDA test module's comparisons pass when pointed at
the CPU (so a GPU run does not spend device time on a broken test), and the bf16 bench refuses a CPU
with a clear message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import encoders_gpu

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"


def test_script_parses_and_names_only_existing_tests():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    named = re.findall(r"tests/[\w/]+\.py(?:::\w+)?", text)
    assert len(named) >= 5, named
    for node in named:
        path, _, func = node.partition("::")
        source = (REPO / path).read_text()
        if func:
            assert re.search(rf"^def {func}\(", source, re.M), f"{node} is not a test in {path}"
    for module in set(re.findall(r"-m (benchmarks\.\w+)", text)):
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_encoders_gpu_refuses_a_cpu(capsys):
    assert encoders_gpu.main(["--presets", "uni_v1"]) == 2
    assert "no CUDA device here" in capsys.readouterr().out


def test_cuda_test_module_passes_on_the_cpu_when_pointed_there():
    """WSI_CUDA_TEST_DEVICE=cpu (what the dry run sets): every test of the CUDA module runs and passes, none skipped."""
    env = {**os.environ, "WSI_CUDA_TEST_DEVICE": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/training/test_cuda_float64.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    passed = re.search(r"\b(\d+) passed\b", summary)
    assert passed and int(passed.group(1)) >= 9 and "skipped" not in summary, summary
