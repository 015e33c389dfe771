"""The numerics tests under every CPU instruction set PyTorch picks kernels for.

PyTorch chooses its CPU kernels by instruction set (``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``,
``avx512`` on x86-64; it takes the best the CPU has unless told). Kernels of different sets sum in
different orders, so float32 results differ by rounding from one machine to the next: a test whose
bound one machine happens to meet can fail on another (two did, on AVX-512, before their
comparisons moved to float64). This test re-runs the numerics tests in a subprocess under each
setting, so a failure that depends on the instruction set shows up on any x86-64 machine that has
the set, not only on a user's. The set the suite itself runs under (the CPU's best, or the one
``ATEN_CPU_CAPABILITY`` names) is skipped here: the suite's own run of those tests is that run.
``make test-isa`` runs this test (marked ``isa``); ``make test`` leaves it out and CI (``.ci/run``) runs both.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

#: The numerics tests (gradients, accumulation, Big-Layers, optimiser, aggregators, evaluation
#: arithmetic, the loop against plain autograd, feature extraction); their fast tests run under
#: each instruction set (about a minute each on a quiet 2-core machine).
NUMERICS_TESTS = (
    "tests/training/test_accumulate.py",
    "tests/training/test_accumulate_rng.py",
    "tests/models/test_aggregators.py",
    "tests/bigl/test_bigl.py",
    "tests/bigl/test_bigl_budget.py",
    "tests/models/test_bn_calibration.py",
    "tests/training/test_features.py",
    "tests/training/test_optim.py",
    "tests/inference/test_protocols.py",
    "tests/training/test_train_loop.py::test_loop_matches_a_plain_autograd_reference",
    "tests/training/test_train_loop.py::test_augmentation_is_one_transform_per_bag",
    # bf16 training against a plain loop with autocast per step (bit for bit), and backward outside autocast
    "tests/training/test_bf16_training.py",
    # a ViT through exact accumulation: each aggregator once, each fine-tuning mode once
    "tests/training/test_foundation_training.py::test_accumulation_with_a_vit_is_exact_in_float64[abmil-checkpointing]",
    "tests/training/test_foundation_training.py::test_accumulation_with_a_vit_is_exact_in_float64[dtfd-lora_last2]",
    "tests/training/test_foundation_training.py::test_accumulation_with_a_vit_is_exact_in_float64[transmil-freeze1]",
)
#: Not numerics (memory accounting), and slow.
DESELECT = ("tests/training/test_accumulate.py::test_saved_activation_memory_does_not_grow_with_the_bag",)

#: ``ATEN_CPU_CAPABILITY`` value -> what ``torch.backends.cpu.get_cpu_capability()`` reports when it applies.
CAPABILITIES = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}


def _capability(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.isa
@pytest.mark.parametrize("isa", sorted(CAPABILITIES))
def test_numerics_tests_pass_under_each_instruction_set(isa):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"ATEN_CPU_CAPABILITY={isa} is an x86-64 setting; this machine is {platform.machine()}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa}
    got = _capability(env)
    if got != CAPABILITIES[isa]:
        # torch falls back to the best set the CPU has: the run would repeat another setting's
        pytest.skip(f"this CPU cannot run ATEN_CPU_CAPABILITY={isa} (torch runs {got})")
    if got == torch.backends.cpu.get_cpu_capability():
        # the suite itself runs under this set: its run of these tests is this one's (no need to repeat it)
        pytest.skip(f"the suite runs under {got} itself; its numerics tests ran there")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", *NUMERICS_TESTS,
           *(f"--deselect={t}" for t in DESELECT)]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"numerics tests under ATEN_CPU_CAPABILITY={isa} ({got}):\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
