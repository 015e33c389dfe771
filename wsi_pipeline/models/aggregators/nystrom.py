"""Nystrom self-attention (Xiong et al. 2021) as TransMIL uses it, written for this package.

For a sequence of N tokens and ``m`` landmarks, the sequence is padded on the LEFT to a
multiple of ``m`` and cut into ``m`` segments of ``l = ceil(N / m)`` slots; the landmarks are
the segment means of the scaled queries and of the keys. Two treatments of that padding
(``mode``, one of :data:`NYSTROM_MODES`):

- ``reference`` (default): the numerics of the ``nystrom-attention`` package (0.0.14), which
  TransMIL's code uses. The pads are zero tokens (zero query, key and value: the QKV
  projection has no bias); they enter the segment means (every segment divides by ``l``), act
  as ``m * l - N`` extra keys with value zero (they take softmax weight), and landmarks made of
  pads only are kept. This is the model the TransMIL paper trained.
- ``masked``: a landmark is the mean over the real tokens of its segment, segments made only of
  padding are dropped, and padding is never a key or a value. The result does not depend on the
  pad count, and with N <= m every landmark is one token, so the approximation equals exact
  softmax attention (up to the iterative pseudo-inverse).

In both modes ``attn = softmax(Q Kl^T) pinv(softmax(Ql Kl^T)) softmax(Ql K^T)``, with the
Moore-Penrose pseudo-inverse approximated by ``pinv_iterations`` steps of the cubic Newton
iteration of the Nystromformer paper, initialised with ``x^T / (max row sum * max column sum)``
over the whole batch and all heads; a depthwise convolution (``residual_kernel`` x 1, per
head, no bias) over the sequence axis of V is added to the attention output, then heads are
merged and projected (with dropout).

Output token i is the output of input token i: the padded output is cut to its LAST N rows
(nystrom-attention < 0.0.10, pinned by TransMIL's code, kept the first N and shifted every
token's output; that is not reproduced). Parameter names match the package's module
(``to_qkv``, ``to_out.0``, ``res_conv``), so a state dict moves between the two unchanged.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["NYSTROM_MODES", "NystromAttention", "NystromMode", "check_nystrom_mode", "iterative_pinv"]

#: How the left padding to a multiple of the landmark count is treated (module docstring).
NystromMode = Literal["reference", "masked"]
NYSTROM_MODES: tuple[str, ...] = typing.get_args(NystromMode)


def check_nystrom_mode(mode: str, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``mode`` is one of :data:`NYSTROM_MODES`."""
    if mode not in NYSTROM_MODES:
        raise ValueError(f"{where}={mode!r}; expected one of {NYSTROM_MODES}")


def iterative_pinv(x: Tensor, iters: int = 6) -> Tensor:
    """Approximate Moore-Penrose pseudo-inverse of square matrices ``x`` [..., k, k].

    Cubic iteration ``Z <- Z (13 I - X Z (15 I - X Z (7 I - X Z))) / 4`` started at
    ``X^T / (max_j sum_i |x_ij| * max_i sum_j |x_ij|)`` (maxima over the whole batch), which
    converges for any non-singular X.
    """
    absx = x.abs()
    col = absx.sum(dim=-1)
    row = absx.sum(dim=-2)
    z = x.transpose(-1, -2) / (col.max() * row.max())
    eye = torch.eye(x.shape[-1], device=x.device, dtype=x.dtype)
    for _ in range(iters):
        xz = x @ z
        z = 0.25 * z @ (13 * eye - xz @ (15 * eye - xz @ (7 * eye - xz)))
    return z


class NystromAttention(nn.Module):
    """Multi-head Nystrom attention over [B, N, dim] -> [B, N, dim].

    Parameters
    ----------
    dim : token width.
    heads, dim_head : number of heads and width of each (inner width ``heads * dim_head``).
    num_landmarks : m, the number of landmarks.
    pinv_iterations : iterations of :func:`iterative_pinv`.
    residual : add the depthwise convolution of V.
    residual_kernel : its length along the sequence (33).
    dropout : dropout after the output projection.
    mode : ``reference`` (the nystrom-attention package's numerics: pads are keys and
        landmarks) or ``masked`` (pads masked out); see the module docstring.
    """

    def __init__(
        self,
        dim: int,
        *,
        heads: int = 8,
        dim_head: int = 64,
        num_landmarks: int = 256,
        pinv_iterations: int = 6,
        residual: bool = True,
        residual_kernel: int = 33,
        dropout: float = 0.0,
        mode: NystromMode = "reference",
    ) -> None:
        super().__init__()
        if num_landmarks < 1:
            raise ValueError(f"num_landmarks={num_landmarks} must be >= 1")
        if residual and residual_kernel % 2 != 1:
            raise ValueError(f"residual_kernel={residual_kernel} must be odd so the output keeps the length")
        check_nystrom_mode(mode, "mode")
        self.mode = mode
        self.heads, self.dim_head = int(heads), int(dim_head)
        self.num_landmarks, self.pinv_iterations = int(num_landmarks), int(pinv_iterations)
        self.scale = dim_head**-0.5
        inner = heads * dim_head
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(dropout))
        self.res_conv = (
            nn.Conv2d(heads, heads, (residual_kernel, 1), padding=(residual_kernel // 2, 0), groups=heads, bias=False)
            if residual
            else None
        )

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim_head={self.dim_head}, num_landmarks={self.num_landmarks}, mode={self.mode!r}"

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        return q * self.scale, k, v

    def _masked_landmarks(self, t: Tensor) -> Tensor:
        """Segment means [B, h, m', d] of ``t`` [B, h, N, d] after masked left padding to a multiple of m."""
        n = t.shape[-2]
        m = self.num_landmarks
        pad = (-n) % m
        seg = (n + pad) // m
        # slot s of the padded sequence holds token s - pad; segment j covers slots [j*seg, (j+1)*seg)
        t = F.pad(t, (0, 0, pad, 0))
        sums = t.reshape(*t.shape[:-2], m, seg, t.shape[-1]).sum(dim=-2)
        first = pad // seg  # segments before this one hold padding only: drop them
        counts = torch.full((m,), float(seg), dtype=t.dtype, device=t.device)
        counts[first] = seg - (pad - first * seg)
        return (sums / counts[:, None])[..., first:, :]

    def _segment_means(self, t: Tensor) -> Tensor:
        """Means [B, h, m, d] of the m equal segments of ``t`` [B, h, m * l, d], pads included."""
        m = self.num_landmarks
        seg = t.shape[-2] // m
        return t.reshape(*t.shape[:-2], m, seg, t.shape[-1]).sum(dim=-2) / seg

    def _factors(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """``(a1, pinv(a2), a3, v, pad)``: ``a1`` [B, h, N, m'] has the rows of the N tokens; the keys
        of ``a3`` [B, h, m', pad + N] and the rows of ``v`` start with ``pad`` pads (0 when masked)."""
        q, k, v = self._qkv(x)
        if self.mode == "reference":
            # the package pads x with zero tokens; to_qkv has no bias, so their q, k, v are zeros
            pad = (-x.shape[1]) % self.num_landmarks
            q, k, v = (F.pad(t, (0, 0, pad, 0)) for t in (q, k, v))
            ql, kl = self._segment_means(q), self._segment_means(k)
        else:
            pad = 0
            ql, kl = self._masked_landmarks(q), self._masked_landmarks(k)
        a1 = torch.softmax(q[:, :, pad:] @ kl.transpose(-1, -2), dim=-1)  # [B, h, N, m']; pad queries unused
        a2 = torch.softmax(ql @ kl.transpose(-1, -2), dim=-1)  # [B, h, m', m']
        a3 = torch.softmax(ql @ k.transpose(-1, -2), dim=-1)  # [B, h, m', pad + N]
        return a1, iterative_pinv(a2, self.pinv_iterations), a3, v, pad

    def forward(self, x: Tensor, *, return_row: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend over ``x`` [B, N, dim] and return [B, N, dim].

        With ``return_row=r`` also return row r of the (approximate) attention matrix over the N
        tokens, averaged over heads, [B, N], computed from the Nystrom factors without an N x N
        matrix (in ``reference`` mode the weights the row gives to the pads are left out).
        """
        b, n, _ = x.shape
        a1, a2inv, a3, v, pad = self._factors(x)
        out = (a1 @ a2inv) @ (a3 @ v)
        if self.res_conv is not None:
            # the rows of the real tokens: the package's out[:, -n:] after its row-wise projection
            out = out + self.res_conv(v)[:, :, pad:]
        out = self.to_out(out.transpose(1, 2).reshape(b, n, self.heads * self.dim_head))
        if return_row is None:
            return out
        row = ((a1[:, :, return_row : return_row + 1] @ a2inv) @ a3[..., pad:]).squeeze(-2).mean(1)
        return out, row

    def exact_attention(self, x: Tensor) -> Tensor:
        """The exact softmax attention matrix [B, heads, N, N] of ``x`` (O(N^2) memory; for tests)."""
        q, k, _ = self._qkv(x)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1)
