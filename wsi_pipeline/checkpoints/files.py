"""Checkpoint files: plain containers and tensors only, written atomically, read with ``weights_only=True``.

A run checkpoint (``best.pt``, ``last.pt``) is a :class:`~wsi_pipeline.checkpoints.run.RunCheckpoint`:
its fields, schema version and the migrations of older layouts are described there and in
:mod:`wsi_pipeline.checkpoints.migrations`. :func:`save_run_checkpoint` writes one and
:func:`load_run_checkpoint` reads one (any layout this package wrote); :func:`save_checkpoint` and
:func:`load_checkpoint` are the file layer below them (also used by the tissue model): ``format``
(``wsi-pipeline/checkpoint-v1``) and the ``integrity`` digest are theirs.

Nothing is pickled as a Python object, so ``torch.load(path, weights_only=True)`` reads it and a
file that carries a pickled object is refused (:func:`load_checkpoint`).

Every checkpoint verifies itself: ``<name>.sha256`` beside it (``sha256sum`` format) records the
file's SHA-256, checked on every load, so flipped bytes are an error naming the file, never a model
that silently predicts something else. Saving writes the new hash beside the old one first, then
replaces the checkpoint, then leaves only the new hash: a kill at any point leaves a checkpoint
whose hash is recorded.

The checkpoint also carries its own digest (``integrity``: the SHA-256 of every entry, tensors'
bytes, dtypes and shapes included, :func:`state_digest`), verified on every load: a ``best.pt``
copied alone to another machine (the usual way to share a model) is still checked. A file that
can be verified neither way (saved by an older version, without its ``.sha256``) is refused unless
the caller trusts it (``trust_unverified``; the commands' ``--trust-unverified``).
:func:`load_trained_model` rebuilds the models of a run for evaluation and prediction.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_pipeline.io_atomic import atomic_path, os_error_cause, write_text_atomic
from wsi_pipeline.model_files.loader import load_torch_file
from wsi_pipeline.checkpoints.run import RunCheckpoint

__all__ = [
    "FORMAT",
    "file_sha256",
    "capture_rng",
    "load_checkpoint",
    "load_run_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "save_run_checkpoint",
    "state_digest",
    "trust_unverified",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "wsi-pipeline/checkpoint-v1"
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def _check_plain(obj: Any, where: str) -> None:
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (dict, OrderedDict)):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint key {where}[{k!r}] is a {type(k).__name__}; only str/int keys are allowed")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"checkpoint entry {where} is a {type(obj).__module__}.{type(obj).__name__}; checkpoints hold only "
        "tensors and plain containers (dict, list, str, int, float, bool, None) so they load with weights_only=True"
    )


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (:func:`wsi_pipeline.io_atomic.atomic_path`).

    Raises ``TypeError`` naming the entry if ``state`` holds anything but tensors and plain containers.
    """
    path = Path(path)
    state = dict(state)
    state.setdefault("format", FORMAT)
    state.pop(_DIGEST, None)
    _check_plain(state, "checkpoint")
    state[_DIGEST] = {"scheme": _SCHEME, "sha256": state_digest(state)}
    side = _hash_file(path)
    with atomic_path(path) as tmp:
        try:
            with open(tmp, "wb") as f:
                hashing = _HashingWriter(f)
                torch.save(state, hashing)  # type: ignore[arg-type]  # hashed as written: torch uses write and flush only
        except (OSError, RuntimeError) as e:  # a full disk: name the checkpoint, not a nameless stream
            # torch's zip writer reports a failed write part way as RuntimeError (inline_container.cc)
            cause = os_error_cause(e)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from e
        digest = hashing.hexdigest()
        # the old checkpoint's hash stays valid until the new file has replaced it
        _write_hashes(side, path.name, [digest] + [h for h in _recorded(side) if h != digest][:1])
    _write_hashes(side, path.name, [digest])
    return path


#: The checkpoint's own digest entry, and the scheme of :func:`state_digest`.
_DIGEST = "integrity"
_SCHEME = "entries-sha256-v1"


def state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over every entry of a checkpoint's ``state`` but its ``integrity`` record: each key path,
    each plain value's ``repr`` and each tensor's dtype, shape and bytes, in a fixed order."""
    h = hashlib.sha256()

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{where}:tensor:{t.dtype}:{tuple(t.shape)}\n".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, Mapping):
            h.update(f"{where}:dict:{len(obj)}\n".encode())
            for k in sorted(obj, key=lambda k: (type(k).__name__, str(k))):
                walk(obj[k], f"{where}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            h.update(f"{where}:list:{len(obj)}\n".encode())
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")
        else:
            h.update(f"{where}={obj!r}\n".encode())

    walk({k: v for k, v in state.items() if k != _DIGEST}, "")
    return h.hexdigest()


#: Loading a checkpoint that carries no digest and has no ``.sha256`` beside it (``--trust-unverified``).
_trust = {"unverified": False}


def trust_unverified(on: bool = True) -> None:
    """Let :func:`load_checkpoint` read checkpoints that cannot be verified (for this process; ``--trust-unverified``)."""
    _trust["unverified"] = bool(on)


class _HashingWriter:
    """A binary file wrapper that feeds every byte written to SHA-256 (what ``torch.save`` needs: write, flush)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.h = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.h.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def file_sha256(path: str | os.PathLike, *, block: int = 1 << 22) -> str:
    """SHA-256 of the file at ``path`` (hex), read in ``block``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _hash_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _recorded(side: Path) -> list[str]:
    """The hashes listed in a ``.sha256`` file (``<hex>  <name>`` lines); empty when there is none."""
    try:
        text = side.read_text()
    except FileNotFoundError:
        return []
    return [ln.split()[0].lower() for ln in text.splitlines() if ln.strip()]


def _write_hashes(side: Path, name: str, hashes: list[str]) -> None:
    write_text_atomic(side, "".join(f"{h}  {name}\n" for h in hashes))


def verify_checkpoint(path: str | os.PathLike) -> bool:
    """Check ``path`` against the SHA-256 recorded beside it; ``ValueError`` naming the file on a mismatch.

    Returns False when there is no ``.sha256`` file (then only the digest inside the checkpoint can
    verify it, :func:`load_checkpoint`), True when the file matched.
    """
    path = Path(path)
    side = _hash_file(path)
    recorded = _recorded(side)
    if not recorded:
        return False
    found = file_sha256(path)
    if found not in recorded:
        raise ValueError(
            f"checkpoint {path} is damaged: its sha256 {found[:16]}... does not match the {recorded[0][:16]}... recorded "
            f"in {side.name} when it was saved; restore it from a backup or retrain the run"
        )
    return True


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                    trust_unverified: bool | None = None) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)``, verified by the SHA-256 beside it and by
    the digest inside it.

    ``trust_unverified``: read a checkpoint that neither can verify (default: what
    :func:`trust_unverified` set for the process, else no).

    Raises
    ------
    FileNotFoundError : no such file.
    UnsafeModelFileError : (a ``ValueError``) its pickle allocates memory from a number (``bytearray(10**12)``),
        found before it is unpickled (:func:`~wsi_pipeline.model_files.loader.load_torch_file`).
    ValueError : the file does not match its recorded SHA-256 (:func:`verify_checkpoint`) or its own
        digest, cannot be verified at all (and is not trusted), carries a pickled Python object
        (refused: loading it could run code), is not a torch file, or is not a wsi-pipeline
        checkpoint; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    sidecar = verify_checkpoint(path)
    try:
        state = load_torch_file(path, map_location=map_location)  # the pickle screened first
    except pickle.UnpicklingError as e:
        text = str(e)
        detail = next((ln.strip() for ln in text.splitlines() if "global" in ln.lower()), "")
        if not detail:  # the weights-only unpickler fails the same way on a file that is no pickle at all
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            reason = next((ln for ln in lines if ln.startswith("Unsupported")), lines[0] if lines else "")
            raise ValueError(f"cannot read checkpoint {path}: not a torch checkpoint file ({reason[:200]})") from e
        raise ValueError(
            f"refusing to load {path}: it carries a pickled Python object, which torch.load(weights_only=True) "
            "will not unpickle (unpickling can run arbitrary code). wsi-pipeline checkpoints hold only tensors and "
            "plain containers; use a checkpoint written by `wsi-pipeline train`, or re-save this file's state dicts "
            f"as plain tensors. Detail: {detail[:300]}"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"cannot read checkpoint {path}: not a readable torch file ({e}); it may be truncated") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not a wsi-pipeline checkpoint (format {found!r}, expected {FORMAT!r})")
    _check_digest(path, state, sidecar, _trust["unverified"] if trust_unverified is None else trust_unverified)
    return state


def _check_digest(path: Path, state: dict[str, Any], sidecar: bool, trusted: bool) -> None:
    """Verify the digest a checkpoint carries; refuse one that nothing verifies unless ``trusted``."""
    own = state.pop(_DIGEST, None)
    if isinstance(own, Mapping) and own.get("scheme") == _SCHEME:
        found = state_digest(state)
        if found != own.get("sha256"):
            raise ValueError(
                f"checkpoint {path} is damaged: the digest of its contents {found[:16]}... does not match the "
                f"{str(own.get('sha256'))[:16]}... stored inside it when it was saved; restore it from a backup or retrain"
            )
        return
    if sidecar:
        return
    if not trusted:
        raise ValueError(
            f"checkpoint {path} cannot be verified: it carries no digest of its own (saved by an older version) and "
            f"has no {_hash_file(path).name} beside it; copy that file with it, or load it anyway with --trust-unverified"
        )
    log.warning("%s is unverified (no digest inside, no %s beside it): loaded as trusted", path, _hash_file(path).name)


def save_run_checkpoint(path: str | os.PathLike, checkpoint: RunCheckpoint) -> Path:
    """Write a run checkpoint to ``path`` (:func:`save_checkpoint`: atomically, with its digest and ``.sha256``)."""
    return save_checkpoint(path, checkpoint.to_state())


def load_run_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                        trust_unverified: bool | None = None) -> RunCheckpoint:
    """Read and verify a run checkpoint (:func:`load_checkpoint`), migrated to today's layout
    (:meth:`RunCheckpoint.from_state`); ``ValueError`` naming the file for anything else."""
    state = load_checkpoint(path, map_location=map_location, trust_unverified=trust_unverified)
    return RunCheckpoint.from_state(state, where=str(path))


def capture_rng() -> dict[str, Any]:
    """Python, NumPy (legacy global) and torch (CPU and CUDA) RNG states as plain containers and tensors."""
    np_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": _tuples_to_lists(random.getstate()),
        "numpy": {
            "key": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore the states captured by :func:`capture_rng`."""
    random.setstate(_lists_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples_to_lists(obj: Any) -> Any:
    return [_tuples_to_lists(v) for v in obj] if isinstance(obj, (tuple, list)) else obj


def _lists_to_tuples(obj: Any) -> Any:
    return tuple(_lists_to_tuples(v) for v in obj) if isinstance(obj, (tuple, list)) else obj
