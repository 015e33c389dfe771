"""Survival and regression training: losses against independent references, exact coupled (Cox) steps.

- Cox partial likelihood: Efron against lifelines' fitted log-likelihood, both tie rules against a
  loop over the distinct event times written here, and Breslow's score equation at
  scikit-survival's fitted coefficient;
- discrete-time NLL, MSE and Huber against direct formulas;
- the three-pass Cox step of every strategy that supports it (``frozen``, ``full``,
  ``accumulate``, ``bigl``) against plain autograd over the same bags, float64, relative <= 1e-10;
- the strategies that cannot train it refuse it by name.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from wsi_pipeline.config.pipeline import config_from_dict
from wsi_pipeline.data.bags import Bag, Slide
from wsi_pipeline.tasks import Endpoint
from wsi_pipeline.tasks.losses import cox_partial_nll, discrete_bin, discrete_edges, discrete_time_nll
from wsi_pipeline.training.strategies import build_strategy, check_strategy


def _cox_loop(risk: np.ndarray, time: np.ndarray, event: np.ndarray, ties: str) -> float:
    """-log partial likelihood / events, one distinct event time at a time (the textbook sums)."""
    ll = 0.0
    for t in sorted(set(time[event == 1])):
        dead = [i for i in range(len(time)) if time[i] == t and event[i] == 1]
        risk_set = [i for i in range(len(time)) if time[i] >= t]
        s_all = sum(math.exp(risk[i]) for i in risk_set)
        s_dead = sum(math.exp(risk[i]) for i in dead)
        ll += sum(risk[i] for i in dead)
        for j in range(len(dead)):
            ll -= math.log(s_all - (j / len(dead) if ties == "efron" else 0.0) * s_dead)
    return -ll / event.sum()


def _tied_cohort(seed: int = 0, n: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    time = np.round(rng.exponential(4 * np.exp(-0.8 * x)), 0) + 1  # rounded: many tied times
    event = (rng.random(n) < 0.75).astype(float)
    return x, time, event


@pytest.mark.parametrize("ties", ["efron", "breslow"])
def test_cox_loss_equals_the_textbook_sums(ties):
    x, time, event = _tied_cohort(1)
    assert len(set(time[event == 1])) < event.sum()  # ties present
    risk = np.random.default_rng(2).normal(size=len(x))
    got = float(cox_partial_nll(torch.tensor(risk), torch.tensor(time), torch.tensor(event), ties))
    assert got == pytest.approx(_cox_loop(risk, time, event, ties), rel=1e-12)


def test_cox_efron_matches_lifelines_log_likelihood():
    import lifelines
    x, time, event = _tied_cohort(3, 40)
    fit = lifelines.CoxPHFitter().fit(pd.DataFrame({"x": x, "T": time, "E": event}), "T", "E")
    risk = torch.tensor(x * fit.params_["x"])
    ours = -float(cox_partial_nll(risk, torch.tensor(time), torch.tensor(event), "efron")) * event.sum()
    assert ours == pytest.approx(fit.log_likelihood_, rel=1e-10)


def test_cox_breslow_is_stationary_at_scikit_survival_fit():
    import sksurv.linear_model as sksurv
    from sksurv.util import Surv

    x, time, event = _tied_cohort(4, 40)
    model = sksurv.CoxPHSurvivalAnalysis(ties="breslow", tol=1e-12).fit(x[:, None], Surv.from_arrays(event.astype(bool), time))
    beta = torch.tensor(float(model.coef_[0]), dtype=torch.float64, requires_grad=True)
    loss = cox_partial_nll(beta * torch.tensor(x), torch.tensor(time), torch.tensor(event), "breslow")
    (grad,) = torch.autograd.grad(loss, beta)
    assert abs(float(grad)) < 1e-7  # the score equation holds at their maximum likelihood estimate
    other = cox_partial_nll((beta.detach() + 0.05) * torch.tensor(x), torch.tensor(time), torch.tensor(event), "breslow")
    assert float(other) > float(loss.detach())


def test_cox_without_events_is_zero_with_a_graph():
    risk = torch.tensor([0.3, -1.0], requires_grad=True)
    loss = cox_partial_nll(risk, torch.tensor([1.0, 2.0]), torch.tensor([0, 0]))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(risk.grad, torch.zeros(2))


def test_discrete_time_nll_and_bins_follow_the_formula():
    rng = np.random.default_rng(5)
    event_times = rng.exponential(10, 200)
    edges = discrete_edges(event_times, 4)
    assert np.allclose(edges, np.quantile(event_times, [0.25, 0.5, 0.75]))
    times = np.array([0.1, edges[0], edges[1] + 1, 1e6])
    assert discrete_bin(times, edges).tolist() == [0, 1, 2, 3]
    logits = rng.normal(size=(4, 4))
    events = np.array([1, 0, 1, 0])
    got = float(discrete_time_nll(torch.tensor(logits), torch.tensor(discrete_bin(times, edges)), torch.tensor(events)))
    h = 1 / (1 + np.exp(-logits))
    want = []
    for i, j in enumerate(discrete_bin(times, edges)):
        alive = np.prod(1 - h[i, :j])
        want.append(-math.log(alive * h[i, j]) if events[i] else -math.log(alive))
    assert got == pytest.approx(np.mean(want), rel=1e-12)
    with pytest.raises(ValueError, match="use fewer bins"):
        discrete_edges(np.array([1.0, 1, 1, 1, 1, 2]), 4)


def test_regression_losses_on_standardised_targets():
    ep = Endpoint(task="regression", loss="huber", n_outputs=1, target_mean=10.0, target_sd=2.0, huber_delta=1.0)

    class Out:
        logits = torch.tensor([0.5], dtype=torch.float64)

    y = 14.0  # standardised: 2.0, error 1.5 > delta: linear part
    assert float(ep.bag_loss(Out, y)) == pytest.approx(1.0 * (1.5 - 0.5 * 1.0))
    mse = Endpoint(task="regression", loss="mse", n_outputs=1, target_mean=10.0, target_sd=2.0)
    assert float(mse.bag_loss(Out, y)) == pytest.approx(1.5**2)
    assert mse.scores(np.array([[0.5]]))["prediction"][0] == pytest.approx(11.0)


# ---- the three-pass step -------------------------------------------------------------------------

def _method(strategy: str, **extra):
    method = {"name": "m", "strategy": strategy, "task": "survival", "loss": "cox", "chunk_size": 3,
              "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil", "options": {"dropout": 0.0}},
              "train": {"batch_bags": 4}, **extra}
    if strategy == "bigl":
        method["bigl"] = {"stages": 1, "max_elements": 3000}
    cfg = config_from_dict({"name": "t", "data": {"manifest": "m.csv", "tiles_dir": "t"}, "methods": [method]})
    return cfg.methods[0]


def _bags(rng: np.random.Generator, sizes=(4, 5, 3, 4)) -> list[tuple[int, Bag]]:
    times = [3.0, 1.0, 3.0, 2.0]  # a tied event time
    events = [1.0, 1.0, 1.0, 0.0]
    out = []
    for b, n in enumerate(sizes):
        slide = Slide(f"s{b}", -1, Path("x"), (times[b], events[b]))
        out.append((b, Bag(slide, np.arange(n), rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8))))
    return out


class _Tiny(torch.nn.Module):
    """A small encoder with BatchNorm and dropout (dropout draws must be replayed in pass 3), 6 features."""

    num_features = 6

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(4, 6), torch.nn.Dropout(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _small_models(strategy, n_outputs: int) -> None:
    """Swap a strategy's ResNet-18 + ABMIL for a small encoder + ABMIL (the gradients are the point, not the size)."""
    from wsi_pipeline.models import build_aggregator

    strategy.encoder = _Tiny()
    with torch.no_grad():  # calibrated-looking running statistics
        bn = strategy.encoder.net[1]
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
    strategy.aggregator = build_aggregator("abmil", 6, n_outputs, dropout=0.0)


def _eval_bn(module):
    """BatchNorm layers on running statistics (as the strategies' frozen BatchNorm), dropout left in train mode."""
    from wsi_pipeline.training.accumulate import bn_training

    return bn_training(module, False)


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max |want| over all parameters' gradients together (a parameter whose true gradient
    is zero, e.g. the attention score's bias under the softmax, holds rounding noise only)."""
    assert len(got) == len(want)
    g, w = torch.cat([t.reshape(-1) for t in got]), torch.cat([t.reshape(-1) for t in want])
    return float((g - w).abs().max() / w.abs().max())


def _grads(modules) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for m in modules for p in m.parameters() if p.requires_grad]


@pytest.mark.parametrize("name", ["full", "accumulate", pytest.param("bigl", marks=pytest.mark.slow), "frozen"])
def test_coupled_cox_step_equals_plain_autograd(name, float64):
    """``group_step`` (three passes) against plain autograd: each bag embedded with gradient from the seed
    ``bag_epoch`` gives it, in the strategy's chunks (so dropout draws the same masks), one Cox loss over the
    step's outputs, one backward. ``bigl`` keeps its Big-Layers ResNet-18; the others use a small encoder."""
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.training.epoch import seed_torch

    torch.manual_seed(0)
    strategy = build_strategy(_method(name), None, "cpu", endpoint=Endpoint(task="survival", loss="cox", n_outputs=1, ties="efron"))
    if name != "bigl":
        _small_models(strategy, 1)
    strategy.train()
    bags = _bags(np.random.default_rng(0))
    if name == "frozen":  # a frozen method's bags carry features
        with torch.no_grad():
            feats = [strategy.encoder.eval()(tiles_to_tensor(bag.data)).numpy() for _, bag in bags]
        bags = [(b, Bag(bag.slide, bag.indices, f)) for (b, bag), f in zip(bags, feats)]
    chunk = 3 if name == "accumulate" else None
    loss = strategy.group_step(bags, seed=0, epoch=0)
    got = _grads(strategy.trainable())
    for m in strategy.trainable():
        m.zero_grad(set_to_none=True)
    outs = []
    for b, bag in bags:
        seed_torch(0, 0, b)
        if name == "frozen":
            z = torch.as_tensor(bag.data)
        else:
            x = tiles_to_tensor(bag.data)
            step = chunk or len(x)
            with _eval_bn(strategy.encoder):
                z = torch.cat([strategy.encoder(x[a : a + step]) for a in range(0, len(x), step)])
        outs.append(strategy.aggregator(z))
    ref = strategy.endpoint.group_loss(outs, [bag.slide.y for _, bag in bags])
    ref.backward()
    want = _grads(strategy.trainable())
    assert _relative(got, want) <= 1e-10
    assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
    if name != "frozen":
        assert float(got[0].abs().max()) > 0  # the encoder's first layer did get a gradient


def test_strategies_that_cannot_train_cox_refuse_it_by_name():
    with pytest.raises(ValueError, match="strategy 'patchgd' trains classification only"):
        check_strategy(_method("patchgd", aggregator={"name": "transformer"}, encoder={"name": "resnet18", "bn": "frozen"}))
    with pytest.raises(ValueError, match="set encoder.bn: frozen"):
        check_strategy(_method("bigl", encoder={"name": "resnet18", "bn": "train"}))
    with pytest.raises(ValueError, match="use at least 2"):
        check_strategy(_method("accumulate", train={"batch_bags": 1}))
    with pytest.raises(ValueError, match="dtfd aggregator trains classification only"):
        check_strategy(_method("accumulate", aggregator={"name": "dtfd"}))


@pytest.mark.parametrize("loss", ["mse", "huber", "nll_discrete"])
def test_per_bag_endpoint_losses_train_through_the_strategies(loss, float64):
    """Regression and discrete-time losses go through each bag's step (``accumulate``): its gradient equals
    plain autograd of the loss written here on the same bag."""
    from wsi_pipeline.data.tensors import tiles_to_tensor

    task = "survival" if loss == "nll_discrete" else "regression"
    extra = {"task": task, "loss": loss, "train": {"batch_bags": 1}}
    method = _method("accumulate", **extra)
    endpoint = Endpoint(task=task, loss=loss, n_outputs=3 if loss == "nll_discrete" else 1, edges=(2.0, 5.0),
                        target_mean=3.0, target_sd=2.0, huber_delta=0.5)
    torch.manual_seed(0)
    strategy = build_strategy(method, None, "cpu", endpoint=endpoint)
    _small_models(strategy, endpoint.n_outputs)
    strategy.encoder.net[-1].p = 0.0  # one pass, no replay: no dropout draws to match
    strategy.train()
    rng = np.random.default_rng(3)
    target = (4.0, 1.0) if task == "survival" else (7.5,)
    bag = Bag(Slide("s", -1, Path("x"), target), np.arange(5), rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8))
    value = strategy.bag_step(bag, 1.0)
    got = _grads(strategy.trainable())
    for m in strategy.trainable():
        m.zero_grad(set_to_none=True)
    with _eval_bn(strategy.encoder):
        z = strategy.aggregator(strategy.encoder(tiles_to_tensor(bag.data))).logits.reshape(-1)
    if loss == "nll_discrete":  # the event falls in interval 1 (2 <= 4 < 5)
        h = torch.sigmoid(z)
        ref = -(torch.log(1 - h[0]) + torch.log(h[1]))
    else:
        err = z[0] - (7.5 - 3.0) / 2.0
        ref = err**2 if loss == "mse" else torch.where(err.abs() <= 0.5, 0.5 * err**2, 0.5 * (err.abs() - 0.25))
    ref.backward()
    want = _grads(strategy.trainable())
    assert value == pytest.approx(float(ref.detach()), rel=1e-12)
    assert _relative(got, want) <= 1e-10
