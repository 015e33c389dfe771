"""Shared fixtures. Real-slide tests find ../shared/slides (or $WSI_TEST_SLIDES) and skip without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def real_slides_dir() -> Path:
    """Folder of real vendor slides; skips the test when it is absent."""
    d = Path(os.environ.get("WSI_TEST_SLIDES", SHARED / "slides"))
    if not (d / "CMU-1-Small-Region.svs").is_file():
        pytest.skip(f"real slides not found at {d} (set WSI_TEST_SLIDES or place ../shared/slides beside the repo)")
    return d


@pytest.fixture(scope="session")
def cohorts_dir() -> Path:
    """Folder of the public cohorts' label files; skips the test when it is absent."""
    d = Path(os.environ.get("WSI_TEST_COHORTS", SHARED / "cohorts"))
    if not (d / "README.md").is_file():
        pytest.skip(f"cohort label files not found at {d} (set WSI_TEST_COHORTS or place ../shared/cohorts beside the repo)")
    return d


@pytest.fixture(scope="session")
def store_cohort(tmp_path_factory) -> Path:
    """A small tile-level synthetic cohort (12 slides, 32 px tiles); returns the manifest path."""
    from wsi_pipeline.synthetic.stores import make_store_cohort

    return make_store_cohort(tmp_path_factory.mktemp("store_cohort"), n_slides=12, seed=0)


@pytest.fixture
def float64():
    """Run the test with torch's default dtype float64: models built, tiles converted
    (``tiles_to_tensor``) and features read by the pipeline follow it. Exact claims are checked
    in float64, where rounding stays far below the bounds whatever kernels the CPU runs."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def opener():
    """``open_slide`` that closes every slide it opened when the test ends."""
    from wsi_pipeline.slides import open_slide

    opened = []

    def _open(*args, **kwargs):
        slide = open_slide(*args, **kwargs)
        opened.append(slide)
        return slide

    yield _open
    for slide in opened:
        slide.close()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one intra-op thread.

    Chunked and PatchGD layers issue many small ops; on a shared 2-core machine a second
    intra-op thread only adds synchronisation stalls (6-10x slower measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking (torchrun's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
