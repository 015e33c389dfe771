"""Nystrom self-attention (Xiong et al. 2021) as TransMIL uses it, written for this package.

For a sequence of N tokens and ``m`` landmarks:

- The sequence is (conceptually) padded on the LEFT to a multiple of ``m`` and cut into ``m``
  segments of ``l = ceil(N / m)`` slots; the landmarks are the segment means of the scaled
  queries and of the keys. The padding is *masked*: a landmark is the mean over the real tokens
  of its segment, segments made only of padding are dropped, and padding is never a key or a
  value. (The reference package lets zero-valued pads act as extra keys and landmarks; masking
  makes the result independent of the pad count and exact for N <= m.) With N <= m every landmark
  is one token, so the approximation equals exact softmax attention (up to the iterative
  pseudo-inverse).
- ``attn = softmax(Q Kl^T) pinv(softmax(Ql Kl^T)) softmax(Ql K^T)``, with the Moore-Penrose
  pseudo-inverse approximated by ``pinv_iterations`` steps of the cubic Newton iteration of the
  Nystromformer paper, initialised with ``x^T / (max column sum * max row sum)`` over the batch.
- A depthwise convolution (``residual_kernel`` x 1, per head, no bias) over the sequence axis of
  V is added to the attention output, then heads are merged and projected (with dropout).

Output token i is the output of input token i (no shift: the reference pin nystrom-attention
0.0.9 sliced the wrong end of its padded output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["NystromAttention", "iterative_pinv"]


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
    ) -> None:
        super().__init__()
        if num_landmarks < 1:
            raise ValueError(f"num_landmarks={num_landmarks} must be >= 1")
        if residual and residual_kernel % 2 != 1:
            raise ValueError(f"residual_kernel={residual_kernel} must be odd so the output keeps the length")
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

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        return q * self.scale, k, v

    def _landmarks(self, t: Tensor) -> Tensor:
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

    def _factors(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ql, kl = self._landmarks(q), self._landmarks(k)
        a1 = torch.softmax(q @ kl.transpose(-1, -2), dim=-1)  # [B, h, N, m']
        a2 = torch.softmax(ql @ kl.transpose(-1, -2), dim=-1)  # [B, h, m', m']
        a3 = torch.softmax(ql @ k.transpose(-1, -2), dim=-1)  # [B, h, m', N]
        return a1, iterative_pinv(a2, self.pinv_iterations), a3

    def forward(self, x: Tensor, *, return_row: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend over ``x`` [B, N, dim] and return [B, N, dim].

        With ``return_row=r`` also return row r of the (approximate) attention matrix, averaged
        over heads, [B, N], computed from the Nystrom factors without an N x N matrix.
        """
        b, n, _ = x.shape
        q, k, v = self._qkv(x)
        a1, a2inv, a3 = self._factors(q, k)
        out = (a1 @ a2inv) @ (a3 @ v)
        if self.res_conv is not None:
            out = out + self.res_conv(v)
        out = self.to_out(out.transpose(1, 2).reshape(b, n, self.heads * self.dim_head))
        if return_row is None:
            return out
        row = ((a1[:, :, return_row : return_row + 1] @ a2inv) @ a3).squeeze(-2).mean(1)
        return out, row

    def exact_attention(self, x: Tensor) -> Tensor:
        """The exact softmax attention matrix [B, heads, N, N] of ``x`` (O(N^2) memory; for tests)."""
        q, k, _ = self._qkv(x)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1)
