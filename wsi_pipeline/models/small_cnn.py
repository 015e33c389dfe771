"""A small instance encoder for 27-32 px patches, trained from scratch: the two-convolution network
of Ilse, Tomczak and Welling (ICML 2018) for their colon and breast histology experiments.

The paper's instance network (its appendix, after Sirinukunwattana et al. 2016)::

    conv(4x4, stride 1, no padding) -> 36 channels, ReLU, max-pool 2x2
    conv(3x3, stride 1, no padding) -> 48 channels, ReLU, max-pool 2x2
    fc 512, ReLU, dropout
    fc 512, ReLU, dropout                       -> the 512-wide instance embedding

on 27 x 27 px patches (colon) and 32 x 32 px patches (breast). At 27 px the second max-pool
leaves a 5 x 5 map (27 -> 24 -> 12 -> 10 -> 5), so the first fully connected layer reads
48 x 5 x 5 = 1200 values. Here the second max-pool is an adaptive max-pool to that 5 x 5 grid:
at 27 and 28 px input it is exactly the paper's 2 x 2 max-pool (tested), and it lets the same weights
take other patch sizes (32 px grid tiles: a 12 x 12 map pooled to 5 x 5 with 3 x 3 windows that
overlap by one pixel) instead of tying the network to one tile size. Inputs smaller than 16 px
are refused (the second convolution would have nothing to read).

No BatchNorm: the ``encoder.bn`` modes and ``calibrate_bn`` change nothing, and gradient
accumulation is exact (``accumulate`` replays dropout's random draws chunk by chunk). Not a
ResNet, so not a Big-Layers model: ``bigl`` refuses it (its activations are small anyway; train
it with ``full`` or ``accumulate``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from wsi_pipeline.model_files import load_torch_file

__all__ = ["INITS", "IlseCNN", "MIN_INPUT_PX", "load_state_file"]

log = logging.getLogger(__name__)

#: The smallest patch side (px) the network takes: conv 4 -> pool 2 -> conv 3 must leave >= 1 px.
MIN_INPUT_PX = 16

#: Weight initialisations: ``pytorch`` (each layer's own default, as the paper's public code has it)
#: or ``he`` (He et al. 2015: normal weights of variance 2 / fan-in, zero biases).
INITS = ("pytorch", "he")


class IlseCNN(nn.Module):
    """Two convolutions + two fully connected layers: ``[B, 3, H, W]`` -> ``[B, num_features]``.

    Parameters
    ----------
    embed_dim : width of both fully connected layers and of the embedding (512 in the paper).
    dropout : dropout after each fully connected layer (the paper's network has it; the rate is
        ours, 0.5 as :class:`torch.nn.Dropout`'s default, since the paper states none).
    channels : output channels of the two convolutions (36, 48 in the paper).
    init : ``pytorch`` keeps each layer's default (uniform weights of variance 1 / (3 fan-in)):
        every ReLU layer then divides the variance of its input by about 6, and on inputs
        standardised to unit variance the embedding comes out with a standard deviation of about
        0.04. ``he`` draws normal weights of variance 2 / fan-in with zero biases, which keeps the
        variance through the ReLU layers (He et al., ICCV 2015): an embedding of order 1, so that
        a head trained at the pipeline's learning rate moves its logits in the epochs it has.

    channels_last : hand the convolutions their input in channels-last memory (NHWC strides; the
        tensor's shape and values are unchanged). The same function, computed in another summation
        order: on CPUs (oneDNN) a training step of this network runs 1.4-1.7x faster than on
        channels-first input (``make bench-small-cnn`` measures both side by side). ``False`` keeps
        the input's layout.

    Attributes
    ----------
    num_features : the embedding width D (``embed_dim``).
    """

    def __init__(self, *, embed_dim: int = 512, dropout: float = 0.5, channels: tuple[int, int] = (36, 48),
                 init: str = "pytorch", channels_last: bool = True) -> None:
        super().__init__()
        if int(embed_dim) < 1 or min(channels) < 1:
            raise ValueError(f"ilse_cnn: embed_dim={embed_dim} and channels={channels} must be >= 1")
        if init not in INITS:
            raise ValueError(f"ilse_cnn: init={init!r}; expected one of {list(INITS)}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"ilse_cnn: dropout={dropout}; expected a probability in [0, 1)")
        c1, c2 = int(channels[0]), int(channels[1])
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=4), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
            nn.Conv2d(c1, c2, kernel_size=3), nn.ReLU(inplace=True), nn.AdaptiveMaxPool2d(5),
        )
        self.fc = nn.Sequential(
            nn.Linear(c2 * 5 * 5, embed_dim), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(embed_dim, embed_dim), nn.ReLU(inplace=True), nn.Dropout(dropout),
        )
        self.num_features = int(embed_dim)
        self.channels_last = bool(channels_last)
        if init == "he":
            for layer in self.modules():
                if isinstance(layer, (nn.Conv2d, nn.Linear)):
                    nn.init.kaiming_normal_(layer.weight, mode="fan_in", nonlinearity="relu")
                    if layer.bias is not None:
                        nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, num_features]`` of patches ``x`` ``[B, 3, H, W]`` (H, W >= 16 px)."""
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"ilse_cnn: expected patches [B, 3, H, W]; got {tuple(x.shape)}")
        if min(x.shape[-2:]) < MIN_INPUT_PX:
            raise ValueError(f"ilse_cnn: patches of {tuple(x.shape[-2:])} px are too small; the network needs at least "
                             f"{MIN_INPUT_PX} x {MIN_INPUT_PX} px (the paper's are 27 and 32 px)")
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.fc(torch.flatten(self.features(x), 1))


def load_state_file(model: nn.Module, path: str | Path) -> None:
    """Load a state dict saved with ``torch.save(model.state_dict(), path)`` into ``model``, strictly (in place).

    Raises ``FileNotFoundError`` when ``path`` is missing and ``ValueError`` naming the missing,
    unexpected or mis-shaped keys when the file is for another network.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"encoder weights {path} not found; pass a file written by torch.save(state_dict)")
    state = load_torch_file(path)  # the pickle screened first (UnsafeModelFileError names the file)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, expected a state dict (name -> tensor)")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}" for k, v in own.items()
             if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or wrong:
        raise ValueError(f"{path} does not match this {type(model).__name__} encoder: missing keys {missing}, "
                         f"unexpected keys {unexpected}, shape mismatches {wrong}")
    model.load_state_dict(state)
    log.info("loaded %d tensors from %s", len(state), path)
