"""privacy.clip_norm = "adaptive": DP-STAT picks each step's S1 in the engine (trainer/engine/adaptive_clip.py).

Specifications: the engine's choice is the library's DP-STAT (adaptive_clipping/dp_stat.py, whose
statistical audit covers the rule) on the whole batch's norms with the same noise; an adaptive step
is exactly the fixed-S1 step at the norm it chose; N trainers choose what one trainer chooses; the
ledger charges the counts with the step, and calibration pays for them inside the target ε.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from widedp.accounting import events as ev
from widedp.adaptive_clipping.dp_stat import dp_stat_from_noise
from tests.engine_fixtures import ListSampler, make_engine, poisson_batches, wide_ctr
from widedp.trainer.engine.adaptive_clip import AdaptiveClip, adaptive_clip_from_config
from widedp.trainer.config import Config, ConfigError, load_config

ADAPTIVE = AdaptiveClip(theta=0.01, num_doublings=10, count_noise=0.5, beta=0.1)


def test_the_choice_from_summed_trainer_counts_is_dp_stat_on_the_whole_batch_with_the_same_noise():
    rng = np.random.default_rng(3)
    for trial in range(200):
        norms = rng.lognormal(mean=-1.0, sigma=1.5, size=int(rng.integers(0, 60)))
        cuts = np.sort(rng.integers(0, norms.size + 1, size=2))
        parts = np.split(norms, cuts)  # three trainers' examples
        counts = sum(ADAPTIVE.counts(p ** 2) for p in parts)
        clip, event = ADAPTIVE.choose(counts, np.random.default_rng(trial))
        noise = np.random.default_rng(trial).normal(0.0, ADAPTIVE.count_noise, ADAPTIVE.num_doublings + 1)
        index = dp_stat_from_noise(norms, ADAPTIVE.theta, ADAPTIVE.num_doublings, ADAPTIVE.threshold, noise)
        assert clip == ADAPTIVE.theta * 2.0 ** index
        assert event == ev.SelfComposedDpEvent(ev.GaussianDpEvent(0.5), 11)


def _engine(ds, batches, clip, num_trainers=1, mode="sparse", selection="threshold", num_shards=2, lr_reference=None,
            **kw):
    adaptive = dataclasses.replace(ADAPTIVE, lr_reference=lr_reference)
    plan = {"clip_norm": None, "adaptive_clip": adaptive} if clip == "adaptive" else {"clip_norm": clip}
    return make_engine(ds, num_shards=num_shards, mode=mode, selection=selection, q=0.25, seed=5, dim=4,
                       sampler=ListSampler(batches), plan_overrides=plan, num_trainers=num_trainers, **kw)


def _state(engine):
    tables = np.concatenate([np.asarray(w, dtype=np.float64).ravel()
                             for s in engine.shards.broadcast("state_dict") for w in s["weights"]])
    dense = torch.cat([p.detach().ravel() for p in engine.model.parameters()]).numpy()
    return tables, dense


@pytest.mark.parametrize("mode,selection,lr_reference", [("sparse", "threshold", None), ("sparse", "em", None),
                                                         ("dpsgd", "none", None), ("sparse", "threshold", 0.7)])
def test_an_adaptive_step_is_the_fixed_step_at_the_norm_dp_stat_chose(mode, selection, lr_reference):
    """With privacy.adaptive_clip_lr_reference S_ref, also at learning rates times S_ref/S1."""
    ds = wide_ctr(n=48, seed=0)
    batches = poisson_batches(len(ds), 0.25, 11, 3)
    adaptive = _engine(ds, batches, "adaptive", mode=mode, selection=selection, lr_reference=lr_reference)
    chosen = []
    for _ in batches:
        stats = adaptive.step()
        assert stats is not None and stats.adaptive_clip and stats.clip_norm in ADAPTIVE.candidates
        chosen.append(stats.clip_norm)
    # the same run with S1 fixed at each step's choice: the gradient noise, sampling and selection
    # streams are independent of the clip stream, so every state is equal
    fixed = _engine(ds, batches, chosen[0], mode=mode, selection=selection)
    for clip in chosen:
        fixed.private_plan.clip_norm = fixed.step_clip = clip
        fixed.lr_scale = 1.0 if lr_reference is None else lr_reference / clip
        for role in fixed.trainers.roles:
            role.options = dataclasses.replace(role.options, clip_norm=clip)
        assert fixed.step() is not None
    for a, b in zip(_state(adaptive), _state(fixed)):
        np.testing.assert_array_equal(a, b)
    assert len(set(chosen)) >= 1 and all(c < ADAPTIVE.candidates[-1] for c in chosen)


@pytest.mark.parametrize("num_trainers", [2, 3])
def test_n_trainers_choose_the_s1_one_trainer_chooses_and_end_in_the_same_state(num_trainers):
    ds = wide_ctr(n=48, seed=1)
    batches = poisson_batches(len(ds), 0.25, 12, 3)
    one = _engine(ds, batches, "adaptive", selection="threshold")
    many = _engine(ds, batches, "adaptive", num_trainers=num_trainers, selection="threshold")
    for _ in batches:
        assert one.step().clip_norm == many.step().clip_norm
    for a, b in zip(_state(one), _state(many)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_ledger_charges_dp_stat_with_every_step_and_the_budget_is_the_one_recorded():
    ds = wide_ctr(n=48, seed=2)
    batches = poisson_batches(len(ds), 0.25, 13, 2)
    engine = _engine(ds, batches, "adaptive")
    for _ in batches:
        engine.step()
    step = engine.step_event
    selection, noise = step.event.events
    assert noise == ev.ComposedDpEvent([ADAPTIVE.event, ev.GaussianDpEvent(engine.private_plan.noise_multiplier)])
    assert engine.ledger.history == [(step, 2)]


def _config(*overrides):
    cfg = load_config(None, ["data.path=x", "train.mode=dpsgd", "train.steps=100", "train.batch_size=100",
                             "privacy.target_epsilon=2", "train.recalibrate=false", *overrides])
    return cfg


def test_calibration_pays_for_the_counts_inside_the_target():
    from widedp.trainer.config.planning import plan_privacy

    fixed_plan, fixed = plan_privacy(_config("privacy.accountant=rdp"), n=10_000, vocabulary=0)
    plan, info = plan_privacy(_config("privacy.clip_norm=adaptive", "privacy.adaptive_clip_noise=3", "privacy.accountant=rdp"),
                              n=10_000, vocabulary=0)
    assert plan.adaptive_clip == AdaptiveClip(0.01, 12, 3.0, 0.05) and plan.clip_norm is None
    assert info.noise_multiplier > fixed.noise_multiplier  # the counts cost budget: more gradient noise
    from widedp.accounting.base import make_accountant
    acc = make_accountant("rdp")
    from widedp.accounting.calibration import sampled_step_event
    spent = acc.epsilon([(sampled_step_event(0.01, plan.noise_event()), 100)], info.delta)
    assert spent == pytest.approx(2.0, rel=1e-3) and spent <= 2.0 + 1e-9
    assert info.adaptive_clip["max"] == pytest.approx(0.01 * 2 ** 12)


def test_count_noise_auto_is_a_twentieth_of_the_expected_batch():
    cfg = _config("privacy.clip_norm=adaptive")
    assert adaptive_clip_from_config(cfg.privacy, 400).count_noise == pytest.approx(20.0)
    assert adaptive_clip_from_config(_config().privacy, 400) is None


@pytest.mark.parametrize("override,message", [
    ("privacy.clip_norm=0", 'privacy.clip_norm must be > 0 or "adaptive"'),
    ("privacy.clip_norm=adaptve", "privacy.clip_norm must be a number"),
    ("privacy.adaptive_clip_min=0", "privacy.adaptive_clip_min must be > 0"),
    ("privacy.adaptive_clip_beta=1", "privacy.adaptive_clip_beta must be in (0, 1)"),
    ("privacy.adaptive_clip_noise=0", "privacy.adaptive_clip_noise must be > 0"),
])
def test_bad_adaptive_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(override).validate()


def test_adaptive_clip_parameters_are_checked():
    with pytest.raises(ValueError, match="count_noise"):
        AdaptiveClip(0.1, 3, 0.0)
    with pytest.raises(ValueError, match="num_doublings"):
        AdaptiveClip(0.1, -1, 1.0)
    with pytest.raises(ValueError, match="fixed clip_norm or an adaptive_clip"):
        from widedp.trainer.engine import PrivacyPlan
        PrivacyPlan(1.0, 1.0, None, "none", adaptive_clip=ADAPTIVE)
    assert dataclasses.replace(ADAPTIVE, beta=0.5).threshold < ADAPTIVE.threshold
    assert isinstance(Config(), Config)
