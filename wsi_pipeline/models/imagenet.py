"""ImageNet weights for the ResNet encoders: ``encoder: {name: resnet18, weights: imagenet}``.

``weights: imagenet`` names torchvision's published ImageNet checkpoint of that architecture
(``IMAGENET1K_V1`` for all three: the weights the papers' ResNets started from; torchvision's
``DEFAULT`` for ResNet-50 is a later recipe, ``IMAGENET1K_V2``). The file is read from
torchvision's own cache, ``$TORCH_HOME/hub/checkpoints/<file>`` (``~/.cache/torch`` without
``TORCH_HOME``), where any torchvision user already has it, or where
``wsi-pipeline weights fetch resnet18`` puts it. Nothing is downloaded during a run: a missing
file is an error that says how to get it.

The file is checked before it is used: torchvision names each published file after the first
hex digits of its sha256 (``resnet18-f37072fd.pth``), and the file's sha256 must begin with them
(the check ``torch.hub`` makes when it downloads).
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

__all__ = ["IMAGENET", "IMAGENET_WEIGHTS", "check_published_hash", "fetch_imagenet", "imagenet_file", "resolve_weights"]

log = logging.getLogger(__name__)

#: The value of ``encoder.weights`` (and ``--weights``) that names the ImageNet checkpoint.
IMAGENET = "imagenet"

#: Architecture -> torchvision's weights enum entry (``torchvision.models.get_weight`` name).
IMAGENET_WEIGHTS: dict[str, str] = {
    "resnet18": "ResNet18_Weights.IMAGENET1K_V1",
    "resnet34": "ResNet34_Weights.IMAGENET1K_V1",
    "resnet50": "ResNet50_Weights.IMAGENET1K_V1",
}

_HASH_IN_NAME = re.compile(r"-([a-f0-9]{6,})\.")


def _url(name: str) -> str:
    if name not in IMAGENET_WEIGHTS:
        raise ValueError(f"weights: imagenet is offered for {sorted(IMAGENET_WEIGHTS)}, not for encoder {name!r}; "
                         "give the encoder's own weights file instead")
    from torchvision.models import get_weight

    return str(get_weight(IMAGENET_WEIGHTS[name]).url)


def imagenet_file(name: str) -> Path:
    """Where the ImageNet checkpoint of encoder ``name`` lives in torchvision's cache (it may not exist yet)."""
    import torch.hub

    return Path(torch.hub.get_dir()) / "checkpoints" / Path(_url(name)).name


def check_published_hash(path: Path) -> None:
    """Refuse ``path`` unless its sha256 begins with the hex digits in its published name (``<arch>-<hex>.pth``).

    Raises
    ------
    ValueError : the name carries no hash, or the file's sha256 does not begin with it (a damaged
        or partial download: delete it and fetch again).
    """
    m = _HASH_IN_NAME.search(path.name)
    if not m:
        raise ValueError(f"{path}: the file name carries no sha256 prefix (<arch>-<hex>.pth), so it cannot be checked")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if not digest.hexdigest().startswith(m.group(1)):
        raise ValueError(f"{path}: its sha256 {digest.hexdigest()[:16]}... does not begin with {m.group(1)} as its "
                         "published name says: the file is damaged or partial; delete it and run "
                         "`wsi-pipeline weights fetch` again")


def resolve_weights(name: str, weights: str | Path | None) -> str | Path | None:
    """``weights`` as a file: ``"imagenet"`` becomes the checked cache file of ``name``; anything else is returned as is.

    Raises
    ------
    FileNotFoundError : ``imagenet`` and the file is not in the cache (the message gives the
        command that fetches it and the URL, for a machine without network).
    ValueError : ``imagenet`` for an encoder that has no ImageNet checkpoint here; a damaged file.
    """
    if weights is None or str(weights).lower() != IMAGENET:
        return weights
    path = imagenet_file(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"encoder {name} with weights: imagenet needs {path}, which is not there. Fetch it once where the network is "
            f"allowed with `wsi-pipeline weights fetch {name}` (or download {_url(name)} into {path.parent}; "
            "TORCH_HOME moves that folder)"
        )
    check_published_hash(path)
    return path


def fetch_imagenet(name: str, *, progress: bool = True) -> Path:
    """Download (with torchvision's downloader, hash checked) the ImageNet checkpoint of ``name``; return its path.

    A file already in the cache is checked and kept.
    """
    path = imagenet_file(name)
    if path.is_file():
        check_published_hash(path)
        return path
    import torch.hub

    path.parent.mkdir(parents=True, exist_ok=True)
    # downloads to a temporary name and renames it into place only once the sha256 prefix matched
    torch.hub.download_url_to_file(_url(name), str(path), hash_prefix=_HASH_IN_NAME.search(path.name).group(1),  # type: ignore[union-attr]
                                   progress=progress)
    return path
