"""train.modelmix: seed B's Alg 1 in the engine (trainer/engine/modelmix.py), accounted by ModelMixDpEvent.

Specifications: the gap is enforced exactly and symmetrically; a mixed step is the plain DP-SGD
step taken from the secret mix of the two latest states (tables on the shards and dense
parameters alike); the mixing weights do not depend on the sharding; the ledger records the
ModelMix event the plan budgeted; a checkpoint carries θ_{t-2}; the config refuses every setting
where a coordinate would be noised without being mixed. The statistical audit of the mixed step
(and of its broken variant without the gap) is in tests/test_modelmix_accountant.py and calls
`trainer.engine.modelmix.mix`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.accounting import events as ev
from widedp.accounting.modelmix import ModelMixDpEvent
from tests.engine_fixtures import ListSampler, make_engine, poisson_batches, wide_ctr
from widedp.trainer.config import ConfigError, load_config
from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.layout import row_block_uniform
from widedp.trainer.engine.modelmix import enforce_gap, mix

WIDTH = 3.0
SIGMA = 0.8


def test_the_gap_is_enforced_exactly_symmetrically_and_only_where_it_is_short():
    current = torch.tensor([0.0, 1.0, 2.0, 5.0, -1.0, 3.0], dtype=torch.float64)
    previous = torch.tensor([0.0, 1.5, 0.0, 5.0, -1.2, 3.0 + 1e-9], dtype=torch.float64)
    upper, lower = enforce_gap(current, previous, 1.0)
    gap = upper - lower
    assert torch.allclose(gap.abs(), torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert torch.allclose(upper + lower, current + previous)  # midpoints kept
    assert upper[2] == 2.0 and lower[2] == 0.0  # a long gap is untouched
    assert upper[1] < lower[1] and upper[0] > lower[0]  # the order kept; equal states: θ_{t-1} above


def test_the_mix_lies_between_the_pushed_states_and_alpha_is_uniform_and_partition_free():
    alpha = row_block_uniform(NoiseKey(7), "modelmix", 3, 1, 0, 5000, 2)
    split = torch.cat([row_block_uniform(NoiseKey(7), "modelmix", 3, 1, 0, 1500, 2),
                       row_block_uniform(NoiseKey(7), "modelmix", 3, 1, 1500, 5000, 2)])
    assert torch.equal(alpha, split)
    assert stats.kstest(alpha.numpy().ravel(), "uniform").pvalue > 1e-4
    assert not torch.equal(alpha, row_block_uniform(NoiseKey(7), "modelmix", 4, 1, 0, 5000, 2))  # fresh every step
    current, previous = torch.zeros(5000, 2), torch.zeros(5000, 2)
    out = mix(current, previous, 2.0, alpha)
    assert torch.all(out >= -1.0) and torch.all(out <= 1.0)
    assert torch.allclose(out, -1.0 + 2.0 * alpha)
    with pytest.raises(ValueError, match="gap"):
        mix(current, previous, -1.0, alpha)


def _engine(ds, batches, width, num_shards=2, **kw):
    return make_engine(ds, num_shards=num_shards, mode="dpsgd", selection="none", q=0.25, seed=5, dim=4, sigma=SIGMA,
                       sampler=ListSampler(batches), plan_overrides={"mix_width": width}, lr=0.2, dense_lr=0.1, **kw)


def _tables(engine):
    return [torch.as_tensor(np.asarray(w)) for s in engine.shards.broadcast("state_dict") for w in s["weights"]]


def _dense(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_mixed_step_is_the_plain_step_taken_from_the_secret_mix_of_the_pushed_states(num_shards):
    ds = wide_ctr(n=48, seed=0)
    batches = poisson_batches(len(ds), 0.25, 11, 1)
    mixed, plain = _engine(ds, batches, WIDTH, num_shards), _engine(ds, batches, 0.0, num_shards)
    start_tables, start_dense = _tables(plain), _dense(plain)
    assert mixed.step() is not None and plain.step() is not None
    # this step's ℓ2 sensitivity S = S1/b (no S2); the gap in gradient units is w·S
    gradient_gap = WIDTH * mixed.private_plan.clip_norm / mixed.b
    shard_of = {}
    t_index = 0
    for s, state in enumerate(mixed.shards.broadcast("state_dict")):
        for t, w in enumerate(state["weights"]):
            shard_of[t_index] = (s, t)
            t_index += 1
    for k, (got, before, after_plain) in enumerate(zip(_tables(mixed), start_tables, _tables(plain))):
        s, t = shard_of[k]
        lo, hi = mixed.layout.row_range(mixed.layout.tables[t], s)
        if hi <= lo:
            continue
        alpha = row_block_uniform(mixed.mix_key, "modelmix", 0, t, lo, hi, 4)
        want = mix(before, before, 0.2 * gradient_gap, alpha) + (after_plain - before)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    for i, (n, p) in enumerate(mixed.model.named_parameters()):
        alpha = row_block_uniform(mixed.mix_key, "modelmix-dense", 0, i, 0, p.numel(), 1).view_as(p)
        want = mix(start_dense[n], start_dense[n], 0.1 * gradient_gap, alpha) + (_dense(plain)[n] - start_dense[n])
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=2e-6)
    assert any(not torch.allclose(v, _dense(plain)[n]) for n, v in _dense(mixed).items())  # mixing did something


def test_the_ledger_records_the_modelmix_event_that_was_budgeted():
    ds = wide_ctr(n=48, seed=1)
    batches = poisson_batches(len(ds), 0.25, 12, 2)
    engine = _engine(ds, batches, WIDTH)
    for _ in batches:
        engine.step()
    assert engine.ledger.history == [(ev.PoissonSampledDpEvent(0.25, ModelMixDpEvent(SIGMA, WIDTH, 1)), 2)]


def test_a_resumed_run_mixes_from_the_checkpointed_previous_state():
    ds = wide_ctr(n=48, seed=2)
    batches = poisson_batches(len(ds), 0.25, 13, 3)
    straight = _engine(ds, batches, WIDTH)
    straight.step()
    checkpoint = straight.state_dict()
    assert "mix_previous" in checkpoint and all("mix_previous" in s for s in checkpoint["shards"])
    straight.step()
    resumed = _engine(ds, batches, WIDTH)
    resumed.load_state_dict(checkpoint)  # reproducible mode: the same streams, so the same step
    resumed.step()
    for a, b in zip(_tables(straight), _tables(resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for n, p in _dense(straight).items():
        torch.testing.assert_close(p, _dense(resumed)[n], rtol=0, atol=0)


def test_calibration_with_mixing_needs_less_noise_for_the_same_target():
    from widedp.trainer.config.planning import plan_privacy

    base = ["data.path=x", "train.mode=dpsgd", "train.optimizer=sgd", "train.steps=200", "train.batch_size=100",
            "privacy.target_epsilon=3", "privacy.accountant=rdp"]  # the same accountant for both (auto: pld vs rdp)
    _, plain = plan_privacy(load_config(None, base).validate(), n=10_000, vocabulary=0)
    plan, mixed = plan_privacy(load_config(None, base + ["train.modelmix=true", "privacy.mix_width=4"]).validate(),
                               n=10_000, vocabulary=0)
    assert plan.mix_width == 4.0 and mixed.mix_width == 4.0
    assert mixed.noise_multiplier < plain.noise_multiplier
    assert plan.noise_event() == ModelMixDpEvent(mixed.noise_multiplier, 4.0, 1)


@pytest.mark.parametrize("overrides,message", [
    (["train.mode=sparse"], 'train.modelmix needs train.mode = "dpsgd"'),
    (["train.optimizer=adam"], 'train.modelmix needs train.optimizer = "sgd"'),
    (["privacy.accountant=pld"], 'train.modelmix needs privacy.accountant = "rdp"'),
    (["privacy.mix_width=0"], "train.modelmix needs privacy.mix_width > 0"),
    (["train.ema_decay=0.9"], "train.ema_decay > 0 is not supported"),
    (["train.modelmix=false"], "privacy.mix_width and privacy.mix_coordinates apply only with train.modelmix"),
    (["privacy.mix_coordinates=4", "privacy.second_clip_norm=0.5"], "privacy.mix_coordinates > 1 needs"),
    (["privacy.mix_coordinates=0"], "privacy.mix_coordinates must be >= 1"),
])
def test_settings_that_would_noise_a_coordinate_without_mixing_it_are_refused(overrides, message):
    base = ["data.path=x", "train.mode=dpsgd", "train.optimizer=sgd", "train.modelmix=true", "privacy.mix_width=2"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, base + overrides).validate()


def test_the_engine_refuses_mixing_outside_dpsgd_and_with_a_non_sgd_dense_optimizer():
    ds = wide_ctr(n=48, seed=3)
    batches = poisson_batches(len(ds), 0.25, 14, 1)
    with pytest.raises(ValueError, match="ModelMix needs mode 'dpsgd'"):
        make_engine(ds, mode="sparse", selection="threshold", sampler=ListSampler(batches),
                    plan_overrides={"mix_width": 1.0})
    engine = make_engine(ds, mode="dpsgd", selection="none", sampler=ListSampler(batches), dense_optimizer="adam",
                         plan_overrides={"mix_width": 1.0})
    with pytest.raises(ValueError, match="plain SGD"):
        engine.step()


# ---- refined clipping (seed B Alg 2, privacy.mix_coordinates = k) ------------------------------------

def _shard_after_norms(seed=0):
    """An in-process shard holding one step's contributions (lookup + the shards' norms round)."""
    ds = wide_ctr(n=48, seed=seed)
    batches = poisson_batches(len(ds), 0.5, 21 + seed, 1)
    engine = _engine(ds, batches, WIDTH, num_shards=1, norms_on_trainer=False)
    role = engine.trainers.roles[0]
    role.begin_part(batches[0])
    shard = engine.shards.shards[0] if hasattr(engine.shards, "shards") else engine.shards._shards[0]
    return shard, role


def test_clamped_row_sums_are_the_per_example_row_gradients_clamped_then_summed():
    shard, role = _shard_after_norms()
    n_examples = role.bags[0].examples.size
    rng = np.random.default_rng(0)
    factors = rng.uniform(0.2, 1.0, n_examples)
    bound = 0.01
    keys, got = shard.gradients._clamped_row_sums64(factors, 0, bound)
    # slow reference: each example alone through the unclamped path, clamped, added up
    want = {}
    for j in range(n_examples):
        one = np.zeros(n_examples)
        one[j] = factors[j]
        k, s = shard.gradients._clipped_row_sums64(one, 0)
        for key, row in zip(k.tolist(), s.clamp(-bound, bound)):
            want[key] = want.get(key, 0) + row
    assert keys.tolist() == sorted(want)
    torch.testing.assert_close(got, torch.stack([want[k] for k in keys.tolist()]), rtol=1e-12, atol=1e-12)
    assert bool((got.abs() < torch.cat([v.abs() for v in [shard.gradients._clipped_row_sums64(factors, 0)[1]]])).any())
    # a bound that never binds is the plain clipped sum
    keys2, loose = shard.gradients._clamped_row_sums64(factors, 0, 1e9)
    k3, plain = shard.gradients._clipped_row_sums64(factors, 0)
    assert np.array_equal(keys2, k3)
    torch.testing.assert_close(loose, plain, rtol=1e-12, atol=1e-12)


def test_dense_clamped_sum_clamps_every_per_example_coordinate():
    from widedp.trainer.engine.dense_grads import PerExampleGradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, pooled, dense):
            return self.net(torch.cat([pooled.flatten(1), dense], 1)).squeeze(1)

        def loss(self, out, labels):
            return torch.nn.functional.binary_cross_entropy_with_logits(out, labels, reduction="none")

    wrapped = Wrapped()
    pooled, dense, labels = torch.randn(6, 1, 2), torch.randn(6, 1), (torch.rand(6) < 0.5).float()
    grads = PerExampleGradients(wrapped, pooled, dense, labels)
    factors = torch.rand(6, dtype=torch.float64)
    got = grads.clamped_sum(factors, 0.05)
    for n, per in grads.per_example.items():
        want = sum((factors[j] * per[j].double()).clamp(-0.05, 0.05) for j in range(6))
        torch.testing.assert_close(got[n], want)


def test_a_refined_clipping_run_records_corollary_4_1s_event_and_needs_less_noise():
    from widedp.trainer.config.planning import plan_privacy

    ds = wide_ctr(n=48, seed=4)
    batches = poisson_batches(len(ds), 0.25, 15, 2)
    engine = make_engine(ds, num_shards=2, mode="dpsgd", selection="none", q=0.25, seed=5, dim=4, sigma=SIGMA,
                         sampler=ListSampler(batches), plan_overrides={"mix_width": WIDTH, "mix_coordinates": 8})
    plain = make_engine(ds, num_shards=2, mode="dpsgd", selection="none", q=0.25, seed=5, dim=4, sigma=SIGMA,
                        sampler=ListSampler(batches), plan_overrides={"mix_width": WIDTH})
    for _ in batches:
        engine.step(), plain.step()
    assert engine.ledger.history == [(ev.PoissonSampledDpEvent(0.25, ModelMixDpEvent(SIGMA, WIDTH, 8)), 2)]
    assert any(not torch.equal(a, b) for a, b in zip(_tables(engine), _tables(plain)))  # the clamp binds
    base = ["data.path=x", "train.mode=dpsgd", "train.optimizer=sgd", "train.steps=200", "train.batch_size=100",
            "privacy.target_epsilon=3", "train.modelmix=true", "privacy.mix_width=4"]
    _, l2_only = plan_privacy(load_config(None, base).validate(), n=10_000, vocabulary=0)
    _, refined = plan_privacy(load_config(None, base + ["privacy.mix_coordinates=16"]).validate(), n=10_000,
                              vocabulary=0)
    assert refined.noise_multiplier < l2_only.noise_multiplier
