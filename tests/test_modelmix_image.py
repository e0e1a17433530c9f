"""benchmarks/modelmix_image.py (issue 32, ModelMix on a small CNN): the mixing step, the refined
clipping bound, the per-example gradients, the secret draws and the verdict of results_section."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import modelmix_image as mm  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the mixing step ----------------------------------------------------------------------------


def test_mix_step_enforces_the_gap_and_stays_between_the_states():
    current = torch.tensor([[0.0, 1.0, 0.30, -2.0, 5.0, 5.0]])
    previous = torch.tensor([[0.0, 0.0, 0.25, -2.1, 5.0, 4.99]])
    tau = 0.5
    upper, lower = mm.enforce_gap(current, previous, torch.tensor([[tau]]))
    gap = (upper - lower).abs()
    assert (gap >= tau - 1e-6).all()
    # far-apart coordinates untouched, close ones pushed symmetrically about their midpoint
    assert upper[0, 1] == 1.0 and lower[0, 1] == 0.0
    assert torch.allclose(0.5 * (upper + lower), 0.5 * (current + previous))
    assert torch.allclose(gap[0, [0, 2, 3, 4, 5]], torch.full((5,), tau))
    for alpha in (torch.zeros(1, 6), torch.ones(1, 6), torch.rand(1, 6)):
        mixed = mm.mix_step(current, previous, torch.tensor([[tau]]), alpha)
        lo, hi = torch.minimum(upper, lower), torch.maximum(upper, lower)
        assert (mixed >= lo - 1e-6).all() and (mixed <= hi + 1e-6).all()
        assert torch.allclose(mixed, alpha * upper + (1 - alpha) * lower)
    # α = 1 gives the (gap-adjusted) latest state, α = 0 the older one
    assert torch.allclose(mm.mix_step(current, previous, torch.tensor([[tau]]), torch.ones(1, 6)), upper)
    assert torch.allclose(mm.mix_step(current, previous, torch.tensor([[tau]]), torch.zeros(1, 6)), lower)


def test_mix_step_uses_each_runs_own_gap():
    current, previous = torch.zeros(2, 3), torch.zeros(2, 3)
    gaps = torch.tensor([[0.2], [2.0]])
    upper, lower = mm.enforce_gap(current, previous, gaps)
    assert torch.allclose(upper - lower, gaps.expand(2, 3))


def test_mix_step_without_enforced_gap_would_not_mix():
    """The enforcement matters: equal states with gap 0 give no mixing at all (the broken variant)."""
    theta = torch.randn(1, 5)
    assert torch.equal(mm.mix_step(theta, theta.clone(), torch.tensor([[0.0]]), torch.rand(1, 5)), theta)
    assert not torch.equal(mm.mix_step(theta, theta.clone(), torch.tensor([[0.1]]), torch.rand(1, 5)), theta)


def test_alpha_is_uniform_fresh_per_step_and_not_from_torch_seed():
    torch.manual_seed(0)
    a = mm.RunRandomness(n=10, dim=50, chunk=4)
    torch.manual_seed(0)
    b = mm.RunRandomness(n=10, dim=50, chunk=4)
    steps = [a.alpha(t) for t in range(9)]  # crosses chunk boundaries
    for x in steps:
        assert x.shape == (50,) and (x >= 0).all() and (x < 1).all()
    assert all(not torch.equal(steps[i], steps[j]) for i in range(9) for j in range(i))
    assert torch.equal(a.alpha(3), steps[3])  # addressed by step: the same step gives the same α
    # a fresh secret key per run: the same torch seed does not reproduce another run's α or noise
    assert not torch.equal(b.alpha(0), steps[0])
    assert not torch.equal(a.noise(0), b.noise(0))
    assert not torch.equal(a.noise(0), a.noise(1))
    mean = torch.stack(steps).mean()
    assert abs(float(mean) - 0.5) < 0.05


def test_noise_is_standard_normal_and_sample_rate():
    r = mm.RunRandomness(n=2000, dim=1000, chunk=8)
    z = torch.stack([r.noise(t) for t in range(8)])
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1.0) < 0.05
    sizes = [len(r.sample(0.1)) for _ in range(50)]
    assert 170 < sum(sizes) / 50 < 230


# ---- clipping -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 100])
def test_refined_clipping_bounds(k):
    g = torch.randn(3, 40, 200) * torch.tensor([0.01, 1.0, 50.0]).view(3, 1, 1)
    g[:, 0, 0] = 30.0  # one large coordinate per run
    c = 2.0
    out = mm.clip_rows(g, c, mm.refined_bound(c, k))
    assert (out.norm(dim=-1) <= c * (1 + 1e-5)).all()
    assert (out.abs() <= c / math.sqrt(k) * (1 + 1e-6)).all()
    if k == 1:
        small = g[0].norm(dim=-1) <= c
        assert torch.allclose(out[0][small], g[0][small])  # ℓ2 clipping leaves short rows alone
    else:
        assert float(out[:, 0, 0].max()) == pytest.approx(c / math.sqrt(k))


def test_clip_rows_per_run_bounds_and_nonprivate():
    g = torch.randn(2, 5, 30) * 10
    out = mm.clip_rows(g, torch.tensor([1.0, math.inf]).view(2, 1, 1), torch.tensor([0.1, math.inf]).view(2, 1, 1))
    assert (out[0].norm(dim=-1) <= 1 + 1e-5).all() and (out[0].abs() <= 0.1 + 1e-7).all()
    assert torch.equal(out[1], g[1])


# ---- per-example gradients ----------------------------------------------------------------------


def _loop_grads(theta, x, y):
    rows = []
    for i in range(len(y)):
        t = theta.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(mm.forward(t, x[i: i + 1]), y[i: i + 1])
        rows.append(torch.autograd.grad(loss, t)[0])
    return torch.stack(rows)


def test_per_example_gradients_match_a_loop():
    gen = torch.Generator().manual_seed(1)  # test data only
    x = torch.randn(2, 6, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (2, 6), generator=gen)
    thetas = torch.stack([mm.init_params(0), mm.init_params(1) * 3])
    assert thetas.shape == (2, mm.DIM) and mm.DIM == 1898
    loop = torch.stack([_loop_grads(thetas[r], x[r], y[r]) for r in range(2)])
    func = torch.stack([mm.per_example_grads(thetas[r], x[r], y[r]) for r in range(2)])
    manual = mm.batched_per_example_grads(thetas, x, y)
    assert torch.allclose(func, loop, atol=1e-5, rtol=1e-4)
    assert torch.allclose(manual, loop, atol=1e-5, rtol=1e-4)
    assert torch.allclose(mm.batched_per_example_grads_func(thetas, x, y), loop, atol=1e-5, rtol=1e-4)
    assert float(loop.abs().max()) > 1e-3  # not trivially zero


def test_load_split_gives_the_public_split():
    pytest.importorskip("sklearn", reason="the digits data set is in the bench extra: pip install -e '.[bench]'")
    data = mm.load_split()
    assert [len(d[1]) for d in data] == list(mm.SPLIT)
    x = data[0][0]
    assert x.shape[1:] == (1, 8, 8) and float(x.min()) >= -1.0 and float(x.max()) <= 1.0


def _synthetic_split(seed: int = 0):
    """Digits-shaped data (8×8 pixels in [−1, 1], ten classes) so the training loop runs without scikit-learn."""
    g = torch.Generator().manual_seed(seed)  # test data only; nothing private is keyed by it
    def part(n):
        return torch.rand(n, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (n,), generator=g)
    return part(64), part(32), part(32)


def test_train_runs_smoke():
    data = _synthetic_split()
    specs = [mm.RunSpec("nonprivate", None, 1.0), mm.RunSpec("dpsgd", 3.0, 1.0, sigma=1.0),
             mm.RunSpec("modelmix", 3.0, 1.0, sigma=1.0, width=4.0, k=100)]
    mm.train_runs(specs, data, batch=16, steps=3)
    for s in specs:
        assert 0.0 <= s.result["val_accuracy"] <= 1.0 and not s.result["diverged"]


# ---- results_section ----------------------------------------------------------------------------


def _doc(dp: list[float], mix: list[float]) -> dict:
    def row(method, accs, width=0.0, k=1):
        return dict(method=method, epsilon=3.0, lr=1.0, width=width, k=k, sigma=1.0, val_accuracy_tuning=0.8,
                    seeds=[1, 2, 3], test_accuracies=accs, median=sorted(accs)[1], min=min(accs), max=max(accs))

    setting = dict(data="digits", split=[1200, 300, 297], n=1200, batch=32, q=32 / 1200, steps=1500, epochs=40.0,
                   clip=1.0, delta=1 / 2400, params=1898, model="cnn", lrs=[1.0], mix_points=[[4.0, 100]],
                   epsilons=[3.0], tuning_seed=0, seeds=[1, 2, 3], accountant="rdp", paper=mm.PAPER)
    return {"setting": setting, "calibration": [],
            "rows": [row("nonprivate", [0.95, 0.96, 0.97]), row("dpsgd", dp), row("modelmix", mix, 4.0, 100)]}


@pytest.mark.parametrize("dp, mix, verdict", [
    ([0.70, 0.72, 0.74], [0.75, 0.78, 0.80], "**helps**"),
    ([0.70, 0.72, 0.74], [0.60, 0.62, 0.69], "**hurts**"),
    ([0.70, 0.72, 0.74], [0.73, 0.78, 0.80], "**level** (seed ranges overlap)"),
    ([0.70, 0.72, 0.74], [0.50, 0.60, 0.71], "**level** (seed ranges overlap)"),
])
def test_results_section_verdict(dp, mix, verdict):
    lines, goals = mm.results_section(_doc(dp, mix))
    assert len(goals) == 1
    goal, measured, status, why = goals[0]
    assert goal == "digits CNN: does ModelMix help over DP-SGD at equal ε = 3?"
    assert status == verdict
    assert f"{sorted(mix)[1]:.3f}" in measured and f"{sorted(dp)[1]:.3f}" in measured
    text = "\n".join(lines)
    for difference in ("ResNet20", "CIFAR10", "50,000", "1,500", "3,400", "c = 20"):
        assert difference in text
