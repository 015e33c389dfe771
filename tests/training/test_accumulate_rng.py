"""accumulate_step and the global random number generators.

Pass 3 of accumulate_step replays pass 1's dropout draws by restoring each chunk's RNG state; it
must then put the generators back where passes 1 and 2 left them. The references here run the
pass-1 chunks (and the aggregator) by hand from the same starting state and read the generator.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wsi_pipeline.models import build_aggregator
from wsi_pipeline.training.accumulate import accumulate_step

DIM = 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


class DropEncoder(nn.Module):
    """[k, 3, 4, 4] -> [k, DIM]: linear, BatchNorm, dropout (its masks are recorded per call)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(48, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(p)
        self.masks: list[tuple[bool, torch.Tensor]] = []  # (grad enabled, mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin(x.flatten(1)))
        out = self.drop(h)
        self.masks.append((torch.is_grad_enabled(), ((out != 0) | (h == 0)).cpu()))
        return out


def models(p_enc: float, p_agg: float, device: str) -> tuple[DropEncoder, nn.Module]:
    torch.manual_seed(0)
    enc = DropEncoder(p_enc).to(device).train()
    agg = build_aggregator("abmil", DIM, 2, hidden=16, attn_dim=8, dropout=p_agg).to(device).train()
    return enc, agg


def agg_masks(agg: nn.Module) -> list[torch.Tensor]:
    """Record the aggregator's dropout masks (outputs that are zero where the input was not)."""
    seen: list[torch.Tensor] = []
    for m in agg.modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(lambda mod, inp, out: seen.append(((out != 0) | (inp[0] == 0)).cpu()))
    return seen


def rng_state(device: str) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(torch.device(device))] if device == "cuda" else [])


def set_rng_state(state: list[torch.Tensor], device: str) -> None:
    torch.set_rng_state(state[0])
    if device == "cuda":
        torch.cuda.set_rng_state(state[1], torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_enc", [0.0, 0.5], ids=["enc-nodrop", "enc-drop"])
def test_consecutive_steps_draw_fresh_dropout_masks(device, p_enc):
    """Two steps on the same bag: every dropout mask of the second step is new (before the fix, a
    deterministic encoder left the generator where the aggregator started, so its masks repeated)."""
    enc, agg = models(p_enc, 0.5, device)
    seen = agg_masks(agg)
    x = torch.randn(10, 3, 4, 4)
    torch.manual_seed(1)
    accumulate_step(enc, agg, x, 1, 3)
    first_agg, first_enc = list(seen), list(enc.masks)
    seen.clear()
    enc.masks.clear()
    accumulate_step(enc, agg, x, 1, 3)
    assert len(first_agg) == len(seen) == 3  # ABMIL: projection and both attention branches
    for a, b in zip(first_agg, seen):
        assert not torch.equal(a, b)
    if p_enc:
        # within a step pass 3 replays pass 1 (4 chunks: 3, 3, 3, 1); across steps the masks differ
        for masks in (first_enc, enc.masks):
            assert [g for g, _ in masks] == [False] * 4 + [True] * 4
            for (_, m1), (_, m3) in zip(masks[:4], masks[4:]):
                assert torch.equal(m1, m3)
        assert any(not torch.equal(a[1], b[1]) for a, b in zip(first_enc[:3], enc.masks[:3]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bn", ["frozen", "chunk"])
@pytest.mark.parametrize("p_agg", [0.0, 0.5], ids=["agg-nodrop", "agg-drop"])
def test_rng_after_the_step_is_that_of_one_encoder_pass(device, bn, p_agg):
    """After the step the generators stand where the pass-1 forwards (and the aggregator) left them."""
    enc, agg = models(0.5, p_agg, device)
    x = torch.randn(11, 3, 4, 4)
    torch.manual_seed(2)
    start = rng_state(device)

    # reference: pass 1 by hand (no gradient, chunks of 4, BatchNorm as the policy runs it)
    enc.bn.train(bn == "chunk")
    with torch.no_grad():
        z = torch.cat([enc(x[a : a + 4].to(device)) for a in range(0, 11, 4)])
    after_pass1 = rng_state(device)
    agg(z)  # pass 2 draws the aggregator's dropout masks, if any
    after_pass2 = rng_state(device)
    enc.train()
    if p_agg == 0.0:
        assert all(torch.equal(a, b) for a, b in zip(after_pass1, after_pass2))
    assert not all(torch.equal(a, b) for a, b in zip(start, after_pass1))  # the encoder did draw

    set_rng_state(start, device)
    accumulate_step(enc, agg, x, 1, 4, bn=bn)
    end = rng_state(device)
    assert all(torch.equal(a, b) for a, b in zip(end, after_pass2))
    if p_agg:
        # the aggregator's draws are kept, not rewound: the next numbers are not the ones it used
        assert not all(torch.equal(a, b) for a, b in zip(end, after_pass1))


def test_frozen_encoder_skips_pass_3_and_keeps_the_stream():
    """A frozen encoder (no trainable parameter) has no pass 3; the state is that of passes 1 and 2."""
    enc, agg = models(0.5, 0.5, "cpu")
    enc.requires_grad_(False)
    x = torch.randn(7, 3, 4, 4)
    torch.manual_seed(3)
    enc.bn.eval()  # bn="frozen": running statistics (the last chunk holds one tile)
    with torch.no_grad():
        z = torch.cat([enc(x[a : a + 2]) for a in range(0, 7, 2)])
    agg(z)
    expected = torch.get_rng_state()
    enc.bn.train()
    torch.manual_seed(3)
    accumulate_step(enc, agg, x, 0, 2)
    assert torch.equal(torch.get_rng_state(), expected)
