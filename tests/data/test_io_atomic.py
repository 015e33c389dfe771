"""The atomic-write helper: the destination is the old file or the complete new one, never partial."""

from __future__ import annotations

import os
import threading
import time

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from wsi_pipeline.io_atomic import atomic_path, temp_path, write_bytes_atomic, write_text_atomic


def _leftovers(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if ".tmp-" in p)


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_mid_write_keeps_old_file_and_removes_temp(tmp_path, exc):
    dest = tmp_path / "a.json"
    dest.write_text("old complete content")
    seen = {}
    with pytest.raises(type(exc)):
        with atomic_path(dest) as tmp:
            with open(tmp, "w") as f:
                f.write("new but half")  # half of the new content is on disk ...
                f.flush()
                seen["tmp"] = tmp
                seen["dest_during"] = dest.read_text()
                raise exc  # ... when the writer fails
    assert seen["dest_during"] == "old complete content"
    assert dest.read_text() == "old complete content"
    assert not seen["tmp"].exists() and _leftovers(tmp_path) == []


def test_failure_without_old_file_leaves_nothing(tmp_path):
    dest = tmp_path / "sub" / "b.csv"
    with pytest.raises(ValueError):
        with atomic_path(dest) as tmp:
            tmp.write_text("partial")
            raise ValueError("bad row")
    assert not dest.exists() and _leftovers(dest.parent) == []


def test_success_replaces_and_creates_parent(tmp_path):
    dest = tmp_path / "x" / "y" / "c.txt"
    assert write_text_atomic(dest, "première\n") == dest
    assert dest.read_bytes() == "première\n".encode()
    write_text_atomic(dest, "second")
    assert dest.read_text() == "second"
    assert write_bytes_atomic(dest, b"\x00\x01") == dest and dest.read_bytes() == b"\x00\x01"
    assert _leftovers(dest.parent) == []


def test_body_that_writes_nothing_fails_cleanly(tmp_path):
    dest = tmp_path / "d.txt"
    dest.write_text("old")
    with pytest.raises(FileNotFoundError):
        with atomic_path(dest):
            pass
    assert dest.read_text() == "old"


def test_temp_name_keeps_suffix_hidden_same_folder(tmp_path):
    dest = tmp_path / "slide_1.mask.png"
    t = temp_path(dest)
    assert t.parent == dest.parent and t.name.startswith(".slide_1.mask.png.tmp-") and t.suffix == ".png"
    assert str(os.getpid()) in t.name
    assert temp_path(dest, suffix=".npz").suffix == ".npz"
    assert temp_path(tmp_path / "noext", suffix="").name == f".noext.tmp-{os.getpid()}"
    names = []
    th = threading.Thread(target=lambda: names.append(temp_path(dest).name))
    th.start()
    th.join()
    assert names[0] != t.name and names[0].endswith(".png")  # another thread never shares the temp file


def test_writers_that_infer_format_from_the_name(tmp_path):
    """np.savez appends .npz to other names; PIL and OpenCV pick the codec from the extension."""
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    with atomic_path(tmp_path / "a.npz") as tmp:
        np.savez(tmp, a=arr)
    with atomic_path(tmp_path / "a.bin", suffix=".npz") as tmp:
        np.savez(tmp, a=arr)
    for name in ("a.npz", "a.bin"):
        with np.load(tmp_path / name) as z:
            np.testing.assert_array_equal(z["a"], arr)
    img = (np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5)
    with atomic_path(tmp_path / "p.png") as tmp:
        Image.fromarray(img).save(tmp)
    with atomic_path(tmp_path / "c.png") as tmp:
        assert cv2.imwrite(str(tmp), img)
    for name in ("p.png", "c.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "p.png")), img)
    state = {"w": torch.arange(5.0)}
    with atomic_path(tmp_path / "m.pt") as tmp:
        torch.save(state, tmp)
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["w"], state["w"])
    assert _leftovers(tmp_path) == []


def test_concurrent_reader_never_sees_a_partial_file(tmp_path):
    """A writer thread rewrites the file in small flushed pieces; a reader polls it meanwhile.
    Every read must be one of the complete versions (each version is one repeated byte)."""
    dest = tmp_path / "shared.bin"
    size = 64 * 1024
    write_bytes_atomic(dest, b"\x00" * size)
    stop = threading.Event()
    reads: list[bytes] = []

    def reader() -> None:
        while not stop.is_set():
            reads.append(dest.read_bytes())

    th = threading.Thread(target=reader)
    th.start()
    try:
        for v in range(1, 40):
            with atomic_path(dest) as tmp, open(tmp, "wb") as f:
                for _ in range(8):
                    f.write(bytes([v]) * (size // 8))
                    f.flush()
                    time.sleep(0.0005)
    finally:
        stop.set()
        th.join()
    assert len(reads) > 10
    for r in reads:
        assert len(r) == size and r == r[:1] * size, "reader saw a partial or mixed file"
    assert dest.read_bytes() == bytes([39]) * size
