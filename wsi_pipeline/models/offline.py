"""No network, ever: timm architecture names that would fetch from elsewhere are refused, and the
model hubs' libraries are told they are offline for the whole process.

``timm.create_model`` reads a name such as ``hf-hub:timm/resnet18.a1_in1k`` as "ask the Hugging
Face Hub for this model's config" (HEAD requests, retries) and ``local-dir:/any/dir`` as "read the
config in that folder", even with ``pretrained=False``. An encoder here is built from timm's own
registry and the weights file the config names; anything else is refused by name.
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["OFFLINE_ENV", "check_timm_architecture", "go_offline"]

#: Environment variables that keep the Hugging Face libraries (hub, transformers, datasets) off the network.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}

#: A timm registry name: an architecture and optionally a pretrained tag (``resnet18.a1_in1k``).
_ARCHITECTURE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?")


def check_timm_architecture(architecture: str, where: str) -> str:
    """``architecture`` when it is a plain timm registry name; ``ValueError`` naming ``where`` and the value
    when it carries a source (``hf-hub:``, ``local-dir:``, a URL, a path or hub repo id)."""
    if _ARCHITECTURE.fullmatch(architecture):
        return architecture
    shown = architecture if len(architecture) <= 120 else architecture[:120] + "..."
    if ":" in architecture or "/" in architecture or "\\" in architecture:
        raise ValueError(
            f"{where}={'timm:' + shown!r}: a source prefix, URL, folder or hub repo id is refused (it would reach the "
            "network or read a folder's config); name a timm architecture (timm.list_models()), e.g. "
            "timm:vit_small_patch16_224, and give its weights file as encoder.weights"
        )
    raise ValueError(f"{where}={'timm:' + shown!r}: not a timm architecture name (letters, digits, '_', "
                     "an optional '.tag'); timm.list_models() lists them")


def go_offline() -> None:
    """Set :data:`OFFLINE_ENV` for this process (and its children); a hub library already imported is told too."""
    os.environ.update(OFFLINE_ENV)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None and hasattr(constants, "HF_HUB_OFFLINE"):
        setattr(constants, "HF_HUB_OFFLINE", True)  # noqa: B010 (a module attribute mypy does not know)
