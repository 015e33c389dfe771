"""Optimisers and schedules against hand computations and torch's own implementations."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from wsi_pipeline.config.pipeline import DemonConfig, TrainConfig
from wsi_pipeline.training.optim import (
    DemonAdam,
    EpochSchedule,
    build_optimizer,
    clip_gradients,
    demon_beta,
    lr_at_epoch,
)


def test_demon_beta_follows_the_papers_decay_rule():
    # the paper derives beta_t from beta_t / (1 - beta_t) = (1 - t/T) * beta_init / (1 - beta_init)
    beta0, T = 0.9, 50
    for t in range(T + 1):
        ratio = (1 - t / T) * beta0 / (1 - beta0)
        assert demon_beta(beta0, t, T) == pytest.approx(ratio / (1 + ratio), abs=1e-12)
    assert demon_beta(beta0, 0, T) == pytest.approx(beta0)
    assert demon_beta(beta0, T, T) == 0.0 and demon_beta(beta0, T + 5, T) == 0.0  # stays at 0 past T
    with pytest.raises(ValueError, match="total_steps=0"):
        demon_beta(beta0, 0, 0)


def test_demon_adam_three_step_trajectory_by_hand():
    """theta0 = 1, loss = theta^2 / 2 (gradient = theta), lr 0.1, beta_init 0.9, beta2 0.999, T = 3."""
    lr, b2, eps = 0.1, 0.999, 1e-8
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = DemonAdam([p], total_steps=3, lr=lr, betas=(0.9, b2), eps=eps)
    got = []
    for _ in range(3):
        opt.zero_grad()
        (0.5 * p**2).sum().backward()
        opt.step()
        got.append(float(p.detach()))

    # step 1: beta = 0.9 (t = 0), g = 1
    b = 0.9
    m, v, prod = (1 - b) * 1.0, (1 - b2) * 1.0, b               # m = 0.1, v = 0.001
    th1 = 1.0 - lr * (m / (1 - prod)) / (math.sqrt(v / (1 - b2)) + eps)   # = 1 - 0.1 * 1 / (1 + 1e-8)
    assert th1 == pytest.approx(0.9, abs=1e-8)
    # step 2: beta = 0.9 (2/3) / (0.1 + 0.9 (2/3)) = 6/7, g = th1
    b = 6 / 7
    m, v, prod = b * m + (1 - b) * th1, b2 * v + (1 - b2) * th1**2, prod * b
    th2 = th1 - lr * (m / (1 - prod)) / (math.sqrt(v / (1 - b2**2)) + eps)
    # by hand: m = 0.3/3.5 ... m_hat = 0.9375 exactly when th1 = 0.9; v_hat = 0.001809 / 0.001999
    assert m / (1 - prod) == pytest.approx(0.9375, rel=1e-7)
    # step 3: beta = 0.9 (1/3) / (0.1 + 0.3) = 0.75, g = th2
    b = 0.75
    m, v, prod = b * m + (1 - b) * th2, b2 * v + (1 - b2) * th2**2, prod * b
    th3 = th2 - lr * (m / (1 - prod)) / (math.sqrt(v / (1 - b2**3)) + eps)
    assert got == pytest.approx([th1, th2, th3], abs=1e-12)
    # the paper's undampened form (m = g + beta m) would take a very different second step
    m_u = 1.0 * 0.9 * 1.0 + th1  # beta_1 * m_1 + g_2 with m_1 = g_1 = 1
    assert abs(th1 - lr * m_u / math.sqrt(v / (1 - b2**3)) - got[1]) > 1e-2


def test_demon_adam_without_decay_is_torch_adam(float64):
    """float64: the two optimisers evaluate the same update in different orders; Adam divides
    by sqrt(v) + eps with eps = 1e-8 far above float64 gradient noise (~1e-17), so each step
    differs by < lr * 1e-15 / 1e-8 and six steps by far less than the 1e-12 asserted. (In
    float32, gradient noise ~1e-8 is as large as eps and bounds nothing useful.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    ours = DemonAdam(model.parameters(), total_steps=10, lr=1e-2, weight_decay=1e-2, decay=False)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-2, weight_decay=1e-2)
    x, y = torch.randn(16, 5), torch.randint(0, 2, (16,))
    for _ in range(6):
        for net, opt in ((model, ours), (twin, ref)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_demon_state_survives_a_state_dict_round_trip():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = DemonAdam([p], total_steps=5, lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = DemonAdam([q], total_steps=5, lr=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as read back from a checkpoint file
    for o, w in ((opt, p), (opt2, q)):
        w.grad = torch.full((3,), 0.5)
        o.step()
    assert torch.equal(p, q)


def test_build_optimizer_picks_adam_or_demon():
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = build_optimizer(p, TrainConfig(lr=3e-4), total_steps=10)
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["weight_decay"] == pytest.approx(1e-4)
    demon = build_optimizer(p, TrainConfig(demon=DemonConfig(enabled=True, beta_init=0.8)), total_steps=10)
    assert isinstance(demon, DemonAdam) and demon.param_groups[0]["betas"][0] == 0.8
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], TrainConfig(), 1)


def _torch_lrs(make, epochs: int, lr: float) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_schedule_matches_torch():
    t = TrainConfig(epochs=12, lr=1e-3, schedule="cosine", min_lr=1e-5)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12, eta_min=1e-5), 12, 1e-3)
    assert [lr_at_epoch(e, t) for e in range(12)] == pytest.approx(ref, rel=1e-9)


def test_exponential_schedule_matches_torch():
    t = TrainConfig(epochs=45, lr=1e-4, schedule="exponential", gamma=0.955)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.955), 45, 1e-4)
    assert [lr_at_epoch(e, t) for e in range(45)] == pytest.approx(ref, rel=1e-9)
    assert lr_at_epoch(44, t) == pytest.approx(1e-4 * 0.955**44)


def test_linear_schedule_matches_torch_after_the_papers_warmup():
    """PatchGD paper: 2 warm-up epochs, then linear decay to half the peak (torch's LinearLR from 1 to 1/2)."""
    epochs, lr, w = 12, 1e-3, 2
    t = TrainConfig(epochs=epochs, lr=lr, schedule="linear", warmup_epochs=w, min_lr=lr / 2)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.5, total_iters=epochs - w), epochs - w, lr)
    lrs = [lr_at_epoch(e, t) for e in range(epochs)]
    assert lrs[:w] == pytest.approx([lr / 3, 2 * lr / 3], rel=1e-12)  # warm-up by hand: lr (e + 1) / (w + 1)
    assert lrs[w:] == pytest.approx(ref, rel=1e-9)
    # one more epoch of the same decay would reach min_lr exactly
    assert lrs[-1] - (lrs[-2] - lrs[-1]) == pytest.approx(lr / 2, rel=1e-9)


def test_warmup_then_cosine_by_hand_and_constant_schedule():
    t = TrainConfig(epochs=6, lr=1.0, schedule="cosine", warmup_epochs=2)
    lrs = [lr_at_epoch(e, t) for e in range(6)]
    # warm-up 1/3, 2/3, then cosine over the remaining 4 epochs: 1, (1 + cos(pi/4))/2, 1/2, (1 + cos(3pi/4))/2
    hand = [1 / 3, 2 / 3, 1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2]
    assert lrs == pytest.approx(hand, abs=1e-12)
    assert [lr_at_epoch(e, TrainConfig(epochs=3, lr=0.5, schedule="none")) for e in range(3)] == [0.5] * 3


def test_epoch_schedule_sets_the_groups_and_restores():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=1.0)
    t = TrainConfig(epochs=4, lr=0.2, schedule="exponential", gamma=0.5)
    s = EpochSchedule(opt, t)
    assert s.set_epoch(2) == pytest.approx(0.05) and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    s2 = EpochSchedule(torch.optim.Adam([p], lr=1.0), t)
    s2.load_state_dict(s.state_dict())
    assert s2.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def _lrs_seen_by_steps(schedule: EpochSchedule, opt: torch.optim.Optimizer, steps_per_epoch: int, epochs: range) -> list[float]:
    """The rate of every group at each optimiser step (flattened, step by step), as the training
    loop drives the schedule."""
    seen: list[float] = []
    for e in epochs:
        schedule.set_epoch(e)
        for _ in range(steps_per_epoch):
            schedule.before_step()
            seen.extend(g["lr"] for g in opt.param_groups)
            opt.step()
    return seen


def test_step_warmup_matches_torchs_linear_lr_per_step_across_epochs_and_a_resume():
    """warmup_steps N: step k runs at the epoch's rate x (k + 1) / (N + 1), torch's LinearLR from
    1 / (N + 1) to 1 over N steps stepped per optimiser step, multiplied by the epoch schedule; a
    resume in the middle of the warm-up goes on where it stopped."""
    n, per_epoch, epochs = 5, 3, 4
    t = TrainConfig(epochs=epochs, lr=0.4, schedule="exponential", gamma=0.5, warmup_steps=n)

    def groups():
        a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        return [{"params": [a], "lr_scale": 1.0}, {"params": [b], "lr_scale": 0.1}]

    opt = build_optimizer(groups(), t, 100)
    got = _lrs_seen_by_steps(EpochSchedule(opt, t), opt, per_epoch, range(epochs))
    # the reference: torch's per-step LinearLR for the ramp, the exponential rate of each step's epoch
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ramp = torch.optim.lr_scheduler.LinearLR(ref_opt, start_factor=1 / (n + 1), end_factor=1.0, total_iters=n)
    ref = []
    for k in range(per_epoch * epochs):
        epoch_lr = 0.4 * 0.5 ** (k // per_epoch)
        ref.extend(epoch_lr * ref_opt.param_groups[0]["lr"] * share for share in (1.0, 0.1))
        ref_opt.step()
        ramp.step()
    assert got == pytest.approx(ref, rel=1e-12)
    assert got[2 * n] == pytest.approx(0.4 * 0.5 ** (n // per_epoch))  # the ramp ends at step N
    # resume after epoch 0 (3 steps of the 5-step ramp taken): the same rates from there on
    opt1 = build_optimizer(groups(), t, 100)
    s1 = EpochSchedule(opt1, t)
    _lrs_seen_by_steps(s1, opt1, per_epoch, range(1))
    opt2 = build_optimizer(groups(), t, 100)
    s2 = EpochSchedule(opt2, t)
    s2.load_state_dict(s1.state_dict())
    assert s1.state_dict() == {"epoch": 0, "steps": per_epoch}
    assert _lrs_seen_by_steps(s2, opt2, per_epoch, range(1, epochs)) == pytest.approx(ref[2 * per_epoch:], rel=1e-12)
    # off by default, and a checkpoint without a step count resumes with the warm-up taken as done
    t0 = TrainConfig(epochs=2, lr=0.3, schedule="none")
    opt0 = build_optimizer(groups(), t0, 100)
    assert _lrs_seen_by_steps(EpochSchedule(opt0, t0), opt0, 2, range(2)) == pytest.approx([0.3, 0.03] * 4)
    opt3 = build_optimizer(groups(), t, 100)
    s3 = EpochSchedule(opt3, t)
    s3.load_state_dict({"epoch": 1})
    assert _lrs_seen_by_steps(s3, opt3, 1, range(1, 2)) == pytest.approx([0.2, 0.02])


def test_clip_gradients_against_the_norm_by_hand():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_gradients([a, b], None) is None and torch.equal(a.grad, torch.tensor([3.0, 0.0]))
    norm = clip_gradients([a, b], 1.0)
    assert norm == pytest.approx(5.0)
    assert math.sqrt(float(a.grad.pow(2).sum() + b.grad.pow(2).sum())) == pytest.approx(1.0, rel=1e-5)
    assert a.grad[0] / b.grad[0] == pytest.approx(0.75)
