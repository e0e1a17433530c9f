"""`widedp audit`: one-run privacy audit of a whole training run (canaries with rows of their
own, white box) and the canary exposure test — the trainer's glue around `widedp.auditing`.

The measurement is `widedp.auditing`'s (the canaries, the scores, the one-run bound, the exposure
test: pure, no torch, no Ray). This module drives training with it: it adds the canaries to the
training split (`WithCanaries`, the engine's data interface), trains through `build_run` (local
or Ray shards), reads their rows back from the shards, runs the deliberately broken variants,
and writes audit.json / audit.png.

What is audited: the released model of one `widedp train` run of the user's configuration,
against the ε the run's ledger claims, for the engine's neighbouring relation (add/remove one
example, docs/DESIGN.md §1). Steinke, Nasr & Jagielski, "Privacy auditing with one (1)
training run" (NeurIPS 2023): m canary examples, each included in the training set
independently with probability ½ by the auditor's own secret coins; after training, score
every canary, guess "member" for the k+ highest scores and "non-member" for the k− lowest,
and turn the number of correct guesses into an ε lower bound at a stated confidence
(`auditing.one_run_audit`). If the run is (ε, δ)-DP, the bound exceeds ε with probability
at most 1 − confidence: a bound above the claimed ε is evidence the claim is false.

Canaries (white box): canary i is one example whose bag of the audited feature is the single
id of a row r_i appended to that feature's table — a row no real example and no other canary
touches — so row r_i's history is exactly the per-step mechanism applied to canary i alone
(its selection and its noise). To put as much of its clipped gradient as it can on that row
(the analogue of the paper's Dirac gradient canaries), a CTR canary has every other bag empty,
dense features 0 and label 1; a CBOW canary's context is its word, with a target and
negatives drawn uniformly from their (other) table, since its loss needs them.
With `--feature all` (CTR) canary i instead reads a row of its own in every table, and nothing
else: each table's selection then gets its own chance to give a member away, which is what
catches a selection that never picks an untouched row (a member's row is selected only when
its one count beats the threshold's noise, rarely for any one row). Score: ‖released rows −
initial rows‖₂ over the canary's own rows (the released model: the averaged tables when
averaging is on). Ties (e.g. rows never selected: score 0) are broken by a random order from
the audit's generator, which is independent of the membership coins.

Sparse mode's two channels: as the run executes, a canary's row moves only when the step's
selection picks it (selection and value together; a count of 1 rarely passes a calibrated
threshold). `channel="value"` adds the canaries' rows to every step's selection — rows fixed by
the auditor before training, independently of the data, so the union is a post-processing of the
selection and the run's claim covers it — and the audit sees the noisy values alone.

User level (privacy.unit = "user"): a canary is a *user* — a unit of its own whose every example
(`canary_examples` of them, by default privacy.max_examples_per_user) carries the canary — and
is included or not as a whole. The guarantee bounds that user's whole contribution; the broken
variant "clip-per-example" clips each of its examples separately while the ledger claims user
level, so the canary user moves its row by up to k·S1 per step, and the audit must catch it.

The canary rows enlarge one table by m rows: the audited run is the user's configuration with
that table m rows larger and up to m more examples (n, and so q = b/n at fixed b, change a
little; the run's own ledger gives the claimed ε of exactly the run that was audited).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from widedp.trainer.data.format.jagged import KeyedJaggedTensor

from widedp.auditing.canaries import (CANARY_KINDS, PHRASE_PLACEMENTS, Canaries, as_gradient_canaries, make_canaries,
                                      make_phrase_examples)
from widedp.auditing.canary_exposure import canary_ranks, exposure, exposure_report
from widedp.auditing.conformance import combined_refutation, poisson_sampling_test, threshold_selection_test
from widedp.auditing.fdp_one_run import epsilon_lower_bound_gdp
from widedp.auditing.one_run_audit import audit_from_scores
from widedp.auditing.threshold_audit import claim_curve_test, threshold_audit, threshold_audit_at
from widedp.auditing.scores import (claimed_mechanism_threshold, guess_counts, phrase_log_perplexities,
                                    robust_step_scales, selected_step_scores, step_projections,
                                    subsampled_gaussian_log_likelihood_ratios, tie_broken, white_box_scores)
from widedp.trainer.data.format.dataset import Batch, _gather_jagged

AUDIT_KINDS = ("one-run", "exposure")
#: What the one-run auditor sees (`--observe`): the released model only, or every step's release.
OBSERVATIONS = ("final", "steps")
THREAT_MODELS = {
    "final": "final model only: the auditor reads the released model once, after the last step",
    "steps": "intermediate releases: the auditor reads the model after every step (each step's noisy update), "
             "as an observer of every checkpoint or a federated participant would",
}


# ---- deliberately broken training: the audit's teeth ------------------------------------------------
@contextlib.contextmanager
def _sigma_scaled(module, name: str, sigma_at: int, factor: float):
    """`module.name` (a mechanism whose positional argument `sigma_at` is its noise multiplier σ
    and whose result carries its `event`) draws noise of factor·σ while its result still says
    `GaussianDpEvent(σ)`: the ledger is told σ."""
    from widedp.accounting.events import GaussianDpEvent

    real = getattr(module, name)

    def scaled(*args, **kwargs):
        sigma = args[sigma_at]
        out = real(*args[:sigma_at], factor * sigma, *args[sigma_at + 1:], **kwargs)
        return dataclasses.replace(out, event=GaussianDpEvent(sigma))

    setattr(module, name, scaled)
    try:
        yield
    finally:
        setattr(module, name, real)


def _noise_scaled(factor: float):
    """Every Gaussian step draws noise of factor·σ while the ledger is told the planned σ."""
    import widedp.trainer.engine.noise_stage as engine_module

    return _sigma_scaled(engine_module, "noisy_step", 2, factor)  # noisy_step(rows, dense, σ, …)


def _noise_off(run):
    """No noise at all while the ledger is told σ."""
    return _noise_scaled(0.0)


def _sigma_over_10(run):
    """Noise of σ/10 while the ledger is told σ."""
    return _noise_scaled(0.1)


def _sigma_over_2(run):
    """Noise of σ/2 while the ledger is told σ: a subtle break (ε roughly doubles)."""
    return _noise_scaled(0.5)


@contextlib.contextmanager
def _clip_doubled(run):
    """Each example clipped to 2·S1 while the noise is σ·S1 and the ledger is told sensitivity S1:
    the add/remove sensitivity taken for a bound half its size (the factor 2 that separates the
    replace-one sensitivity 2·S1 from the add/remove one, missed)."""
    from widedp.trainer.engine.trainer_role import TrainerRole

    real = TrainerRole.finish_part

    def doubled(self, clip_norm, select=None):
        return real(self, None if clip_norm is None else 2.0 * clip_norm, select)

    TrainerRole.finish_part = doubled  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrainerRole.finish_part = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _selection_rewritten(run, rewrite: Callable):
    """Each step's selected ids become rewrite(engine, selected ids, touched sparse-table ids)
    while the real selector's event is charged. The fused selection is turned off: the rewrite
    needs every touched row's id (and, to release them, its sums) back from the shards."""
    engine = run.engine
    stage = engine.selection
    real, fused = stage.select, stage.fuse
    stage.fuse = False

    def rewritten(rows, shard_parts=None):
        selection = real(rows, shard_parts)
        if selection is None:
            return None
        touched = rows.global_ids[~np.isin(rows.tables, engine.dense_tables)]
        return dataclasses.replace(selection, ids=rewrite(engine, selection.ids, touched))

    stage.select = rewritten
    try:
        yield
    finally:
        del stage.select
        stage.fuse = fused


@contextlib.contextmanager
def _clip_per_example(run):
    """Claims user level (n, q, δ over users, units sampled) but clips, weighs and counts each
    example on its own: a user with k examples in a step contributes up to k·S1."""
    from widedp.trainer.engine.trainer_role import TrainerRole, UnitSample

    if run.engine.example_units is None:
        raise ValueError("--broken clip-per-example breaks user-level clipping: set privacy.unit = \"user\"")
    real = TrainerRole.begin_part

    def per_example(self, idx, dense_state=None, candidates=None, releases=None):
        return real(self, idx.examples if isinstance(idx, UnitSample) else idx, dense_state, candidates, releases)

    TrainerRole.begin_part = per_example  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrainerRole.begin_part = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _group_as_example(run):
    """User level by example sampling (each user keeps ≤ k examples) charged as if each user
    had one: the ledger records the example-level events, not `GroupDpEvent(…, k)`."""
    from widedp.trainer.engine.plan import step_event_of

    engine = run.engine
    budget = engine.budget
    if budget.group_size == 1:
        raise ValueError("--broken group-as-example breaks the group accounting of privacy.user_sampling = "
                         "\"examples\" (privacy.unit = \"user\")")
    real = budget.group_size
    budget.group_size = 1
    budget.step_event = step_event_of(engine.mode, engine.q, engine.plan, engine.selects, 1)
    try:
        yield
    finally:
        budget.group_size = real
        budget.step_event = step_event_of(engine.mode, engine.q, engine.plan, engine.selects, real)


def _every_touched_row(run):
    """The selection also takes every touched row of the sparse tables (as if it skipped the
    private mechanism for them) while the real selector's event is charged."""
    return _selection_rewritten(run, lambda engine, selected, touched: np.union1d(selected, touched))


def _skip_untouched(run):
    """The selection drops every row of the sparse tables that no example of the batch touched
    (as if it ran over the touched rows only, the mistake DESIGN §1 step 3 warns of), keeping
    DP-FEST's fixed rows, while the real selector's event is charged: a row that moves was
    touched, so a canary's own row moves only if the canary is a member."""
    def touched_only(engine, selected, touched):
        keep = touched
        if engine.fixed_rows is not None:
            keep = np.union1d(keep, engine.sparse_vocabulary.to_global(engine.fixed_rows))
        return np.intersect1d(selected, keep)
    return _selection_rewritten(run, touched_only)


@contextlib.contextmanager
def _delta_one_over_n_at_build(stated: dict):
    """While the run is built, privacy.delta = "auto" resolves to 1/n (n: examples, or users at
    user level) instead of min(1/(10n), n^-1.1): σ is calibrated, the budget checked and the
    ledger's ε computed at δ = 1/n, while the run states the auto δ (`stated["delta"]`, which
    the audit's bound uses). A δ of 1/n admits mechanisms that publish an example outright."""
    import widedp.trainer.config.planning as planning

    real = planning.default_delta

    def one_over_n(n: int) -> float:
        stated["delta"] = real(n)
        return 1.0 / n

    planning.default_delta = one_over_n
    try:
        yield
    finally:
        planning.default_delta = real


def _delta_one_over_n(run):
    """The run-time half of `delta-one-over-n` (the build-time half: `_delta_one_over_n_at_build`)."""
    return contextlib.nullcontext()


class _ShuffledBatches:
    """Batches cut from a shuffle of the examples, about q·n each, every example in exactly one
    batch per epoch (the last batch of an epoch holds what is left): what a data loader that
    shuffles gives. Not Poisson sampling: Chua et al. (ICML 2024) show accounting it as Poisson
    under-counts."""

    def __init__(self, num_examples: int, sample_rate: float, rng: np.random.Generator):
        self.num_examples, self.sample_rate, self._rng = int(num_examples), float(sample_rate), rng
        self.batch_size = max(1, int(round(self.sample_rate * self.num_examples)))
        self._order = np.zeros(0, dtype=np.int64)

    def sample(self) -> np.ndarray:
        if not self._order.size:
            self._order = self._rng.permutation(self.num_examples).astype(np.int64)
        batch, self._order = self._order[:self.batch_size], self._order[self.batch_size:]
        return np.sort(batch)


@contextlib.contextmanager
def _shuffle_as_poisson(run):
    """Batches from a shuffle of the examples each epoch (`_ShuffledBatches`) while the ledger
    charges Poisson sampling at the same q."""
    engine = run.engine
    if engine.example_units is not None:
        raise ValueError("--broken shuffle-as-poisson replaces example-level Poisson sampling: privacy.unit is "
                         "\"user\" (audit it at privacy.unit = \"example\")")
    if engine.q >= 1.0:
        raise ValueError("--broken shuffle-as-poisson needs q < 1 (at q = 1 every example is in every step either "
                         "way): lower train.batch_size below the number of examples")
    real = engine.sampler
    engine.sampler = _ShuffledBatches(real.num_examples, engine.q, real._rng)
    try:
        yield
    finally:
        engine.sampler = real


def _selection_sigma_over_2(run):
    """Gaussian thresholding with noise σ_sel/2 on the counts while the ledger is told σ_sel: the
    selection's σ composed wrongly."""
    import widedp.selection.selectors.threshold as threshold_module

    if run.engine.mode != "sparse" or run.engine.plan is None or run.engine.plan.selection != "threshold":
        raise ValueError("--broken selection-sigma-over-2 halves the noise of Gaussian thresholding: set "
                         "train.mode = \"sparse\" and train.selection = \"threshold\"")
    # gaussian_threshold(touched, counts, num_rows, τ, σ_sel, C1, rng)
    return _sigma_scaled(threshold_module, "gaussian_threshold", 4, 0.5)


#: Broken variants for `widedp audit --broken`: a run made non-private on purpose, to show that
#: the audit catches it on the user's own configuration. Never used by training.
BROKEN_VARIANTS: dict[str, Callable] = {"noise-off": _noise_off, "sigma-over-10": _sigma_over_10,
                                        "sigma-over-2": _sigma_over_2, "clip-doubled": _clip_doubled,
                                        "every-touched-row": _every_touched_row, "skip-untouched": _skip_untouched,
                                        "clip-per-example": _clip_per_example, "group-as-example": _group_as_example,
                                        "delta-one-over-n": _delta_one_over_n,
                                        "shuffle-as-poisson": _shuffle_as_poisson,
                                        "selection-sigma-over-2": _selection_sigma_over_2}
#: The broken variants that rewrite the row selection: they act on sparse tables only, so a
#: canary table noised densely (trainer/config/table_policy.py) would not see them.
SELECTION_BROKEN = ("every-touched-row", "skip-untouched")

#: The δ at which the claim's curve is tested besides the run's own (`claim_curve_test`).
CURVE_DELTAS = (1e-3, 1e-2, 1e-1)

#: What a one-run audit of a sparse run sees (`--channel`): the run as it executes (a canary row
#: moves only when selected: selection and value together), or the value channel alone.
CHANNELS = ("as-run", "value")


def _canary_rows_always_selected(run, canaries: Canaries):
    """Each step's selection also takes every canary row (`--channel value`). The canary rows are
    fixed before training by the auditor, independently of the data, so S_t ∪ C is a
    post-processing of the step's selection S_t; the noisy values of the rows in it are the
    step's Gaussian mechanism on the clipped sums restricted to those rows (sensitivity S1 for
    any row set), so the run's claim covers the audited run unchanged. Each canary row then
    receives every step's value noise, member or not, and its updates show the value channel."""
    offsets = run.engine.layout.table_offsets
    rows = np.concatenate([offsets[run.engine.layout.table_index(t)] + canaries.rows(j)
                           for j, t in enumerate(canaries.tables)])
    return _selection_rewritten(run, lambda engine, selected, touched: np.union1d(selected, rows))


def _value_channel_epsilon(engine, ledger, steps: int) -> float:
    """ε of the run's value events alone (its Poisson-sampled step noise, without the selection's
    event or any one-time event), by the run's accountant at its δ: what an audit of the value
    channel alone can approach; the run's claim (every event) is what refutes it."""
    from widedp.accounting.ledger import PrivacyLedger
    from widedp.trainer.engine.plan import step_event_of

    value = PrivacyLedger(ledger.accountant, ledger.delta)
    event = step_event_of(engine.mode, engine.q, engine.plan, False, engine.budget.group_size)  # no selection
    if steps:
        value.record(event, steps)
    return value.epsilon()


class _StepRows:
    """A step callback that reads every canary's rows after each step (the intermediate-release
    threat model): `rows` [initial, after step 1, …]. Reading rows applies their pending lazy
    noise first (`canary_row_values`), as any read of a row does."""

    def __init__(self, canaries: Canaries, initial: np.ndarray):
        self.canaries, self.rows = canaries, [initial]

    def on_step(self, engine, stats, seconds) -> None:
        self.rows.append(canary_row_values(engine, self.canaries, released=False))


class _SampleWatch:
    """White-box view of the run's sampling (the conformance test's input, `poisson_sampling_test`):
    wraps the engine's sampler to count, in each step's sample, the units sampled and the steps
    each canary was in. Only these counts are kept, never which base examples were sampled."""

    def __init__(self, sampler, base_size: int, members: np.ndarray, canaries: int):
        self.sampler, self.base_size, self.members = sampler, int(base_size), members
        self.canary_steps = np.zeros(int(canaries), dtype=np.int64)
        self.units_per_step: list[int] = []
        units_of = getattr(sampler, "units_of", None)
        self.population = int(sampler.num_units if units_of is not None else sampler.num_examples)
        self._units_of = units_of
        self._real = sampler.sample

    def __enter__(self):
        self.sampler.sample = self._sample
        return self

    def __exit__(self, *exc) -> None:
        del self.sampler.sample  # the instance attribute: the class's method again

    def _sample(self):
        idx = self._real()
        self.units_per_step.append(int(np.unique(self._units_of(idx)).size if self._units_of is not None
                                       else np.asarray(idx).size))
        canary = np.asarray(idx, dtype=np.int64)
        canary = canary[canary >= self.base_size]
        self.canary_steps[np.unique(self.members[canary - self.base_size])] += 1
        return idx


#: The conformance tests' null draws come from their own stream of the audit's seed, so adding them
#: left every other draw of the audit as it was.
CONFORMANCE_STREAM = 0xC0F


def _conformance(cfg, run, c: Canaries, sampling: _SampleWatch, rows_by_step: Optional[np.ndarray], steps: int,
                 confidence: float, rng: np.random.Generator, channel: str, policy: dict,
                 step_sizes: bool = False) -> dict:
    """The conformance tests of the run's randomness against its claim (auditing/conformance.py):
    its sampling against the ledger's Poisson(q), and — a sparse run with Gaussian thresholding,
    audited as it runs — how often the non-member canaries' rows (rows nobody reads) were selected
    against the stated τ and σ_sel. `rows_by_step`: the canary rows [observations, m, F·D], every
    step's when observed, else (initial, final). `step_sizes`: also test each step's number of
    sampled units — a statistic of the secret coins of every example, so only where the record is
    no private release or the auditor opted in (`one_run_audit`'s `test_step_sizes`)."""
    from widedp.accounting.calibration import sel_event_of

    engine = run.engine
    tests: dict = {"sampling": None, "selection": None}
    notes: dict = {}
    if steps and len(sampling.units_per_step) == steps:
        tests["sampling"] = poisson_sampling_test(sampling.canary_steps[c.included], steps,
                                                  sampling.units_per_step if step_sizes else None,
                                                  sampling.population, float(engine.q), rng, confidence)
        if not step_sizes:
            notes["sampling_step_sizes"] = ("withheld: each step's sample size is a statistic of the secret coins of "
                                            "every example, un-noised; tested with --test-step-sizes (the record "
                                            "then says so), --broken or privacy.reproducible = true")
        if engine.q >= 1.0:
            notes["sampling"] = "q = 1: every unit in every step, Poisson and shuffled sampling alike (no power)"
    else:
        notes["sampling"] = f"{len(sampling.units_per_step)} samples drawn for {steps} steps (a step redone?): not tested"
    plan = engine.plan
    if cfg.train.mode != "sparse" or plan is None or plan.selection != "threshold":
        notes["selection"] = "tested for sparse mode with train.selection = \"threshold\" only"
    elif channel != "as-run":
        notes["selection"] = "--channel value adds the canaries' rows to every selection: audit it with --channel as-run"
    elif any(p == "dense" for p in policy.values()):
        notes["selection"] = "the canaries' table(s) are noised densely in this run: no selection to test"
    elif rows_by_step is None or not (~c.included).any():
        notes["selection"] = "no non-member canary: no row that nobody reads"
    else:
        event = sel_event_of(engine.budget.step_event) if engine.budget.step_event is not None else None
        sigma = getattr(event, "noise_multiplier", None) or plan.selection_params.noise_multiplier
        d = engine.layout.dim
        rows = rows_by_step[:, ~c.included].reshape(rows_by_step.shape[0], -1, len(c.tables), d)
        moved = np.any(np.diff(rows, axis=0) != 0, axis=-1)  # [observations − 1, non-members, F]
        every_step = moved.shape[0] == steps
        tests["selection"] = threshold_selection_test(
            int(moved.sum()), int(moved.size), plan.selection_params.threshold, float(sigma),
            plan.selection_params.contribution_clip, confidence, steps_per_trial=1 if every_step else max(1, steps))
        tests["selection"]["sigma_from"] = "the ledger's selection event" if event is not None else "the plan"
    combined = combined_refutation(tests, confidence)
    return {**tests, "notes": notes, "combined": combined,
            "what": "the run's randomness against the distribution its claim states (not an ε bound): a correct run "
                    "is refuted with probability ≤ 1 − confidence"}


class WithCanaries:
    """A training split plus the included canaries, as one split (indices [0, n) are the
    base split's, [n, n + included·e) the included canaries' in canary order, e =
    `examples_per_canary` copies of each). The same interface the engine uses: `meta` (the
    audited table m rows larger), `take`, `len`, `feature_rows`, `iter_batches`, and `units`
    when the base split has units (each canary a unit of its own: a canary user)."""

    def __init__(self, base, canaries: Canaries, examples_per_canary: int = 1):
        if isinstance(examples_per_canary, bool) or not isinstance(examples_per_canary, (int, np.integer)) \
                or examples_per_canary < 1:
            raise ValueError(f"--canary-examples must be an integer >= 1, got {examples_per_canary!r}")
        self.base, self.canaries = base, canaries
        self.members = np.repeat(np.flatnonzero(canaries.included), int(examples_per_canary))
        meta = base.meta
        sizes = dict(meta.table_sizes)
        for table, first_row in zip(canaries.tables, canaries.first_rows):
            sizes[table] = first_row + canaries.count
        self.meta = dataclasses.replace(meta, table_sizes=sizes, num_examples=len(base) + self.members.size)

    def __len__(self) -> int:
        return len(self.base) + int(self.members.size)

    def take(self, indices) -> Batch:
        """Examples at these indices, in the order given (a Batch as `ParquetDataset.take`)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise IndexError(f"index {bad} out of range for split of size {len(self)}")
        n = len(self.base)
        in_base = idx < n
        base = self.base.take(idx[in_base])
        canary = self.members[idx[~in_base] - n]
        features = list(self.meta.features)
        b_len = base.sparse.lengths().numpy().reshape(len(features), -1) if base.size else np.zeros((len(features), 0), np.int32)
        b_val = base.sparse.values().numpy()
        b_off = np.concatenate([[0], np.cumsum(b_len.sum(1))])
        # Position of every example of the merged batch among (base batch, canary batch).
        source = np.empty(idx.size, dtype=np.int64)
        source[np.flatnonzero(in_base)] = np.arange(base.size)
        source[np.flatnonzero(~in_base)] = base.size + np.arange(canary.size)
        values, lengths = [], []
        for f, name in enumerate(features):
            own = self.canaries.ids[name][canary]
            f_len = np.concatenate([b_len[f], np.full(canary.size, own.shape[1], dtype=np.int64)])
            f_val = np.concatenate([b_val[b_off[f]: b_off[f + 1]], own.reshape(-1)])
            v, ln = _gather_jagged(np.concatenate([[0], np.cumsum(f_len)]), f_val, source)
            values.append(v)
            lengths.append(ln.astype(np.int32))
        sparse = KeyedJaggedTensor(keys=features, values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
                                   lengths=torch.from_numpy(np.concatenate(lengths) if lengths else np.zeros(0, np.int32)),
                                   stride=int(idx.size))
        dense = torch.cat([base.dense, torch.from_numpy(self.canaries.dense[canary])])[torch.from_numpy(source)]
        labels = torch.cat([base.labels, torch.from_numpy(self.canaries.labels[canary])])[torch.from_numpy(source)]
        return Batch(sparse=sparse, dense=dense.reshape(idx.size, self.meta.num_dense), labels=labels, indices=idx.copy())

    def override_pooled_grads(self, indices: np.ndarray, pooled_grads: np.ndarray, features) -> np.ndarray:
        """Gradient canaries: the pooled-output gradients [B, F, D] of a batch of these `indices`
        with every canary's rows replaced — G·u_i on its own features, 0 on the others; its dense
        gradient stays the model's. DP-SGD's guarantee holds for any per-example gradient chosen
        from the current state (adaptive composition), and clipping bounds this one as it bounds
        every example's. Example canaries: as given."""
        c = self.canaries
        if c.directions is None:
            return pooled_grads
        idx = np.asarray(indices, dtype=np.int64)
        at = np.flatnonzero(idx >= len(self.base))
        if not at.size:
            return pooled_grads
        out = np.array(pooled_grads, copy=True)
        out[at] = 0.0
        names = [getattr(f, "name", f) for f in features]
        own = [names.index(f) for f in c.features]
        out[at[:, None], np.asarray(own)[None, :]] = c.gradient_norm * c.directions[self.members[idx[at] - len(self.base)]]
        return out

    def units(self) -> Optional[np.ndarray]:
        """The base split's units (dense indices 0..U-1), then one new unit per included canary;
        None when the base split has none."""
        from widedp.trainer.data.sampler import unit_indices

        base = self.base.units() if hasattr(self.base, "units") else None
        if base is None:
            return None
        dense, count = unit_indices(base)
        return np.concatenate([dense, count + self.members]).astype(np.int64)

    def iter_batches(self, batch_size: int):
        for start in range(0, len(self), batch_size):
            yield self.take(np.arange(start, min(start + batch_size, len(self)), dtype=np.int64))

    def feature_rows(self, feature: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, ids) of one feature over the whole split, canaries last (DP-FEST)."""
        offsets, ids = self.base.feature_rows(feature)
        extra = self.canaries.ids[feature][self.members]  # [members, 0 or 1]
        more = offsets[-1] + extra.shape[1] * np.arange(1, self.members.size + 1, dtype=np.int64)
        return np.concatenate([offsets, more]), np.concatenate([ids, extra.reshape(-1)])


def table_values(engine, table: str, released: bool) -> np.ndarray:
    """Every row of one table [rows, D] from the shards (released: the averaged weights when
    averaging is on)."""
    t = engine.layout.table_index(table)
    parts = []
    engine.store_pending_noise()  # lazy DP-SGD noise: every row's, in a logged round
    for state in engine.shards.broadcast("state_dict"):
        weights = state["averaged_weights"] if released and "averaged_weights" in state else state["weights"]
        parts.append(np.asarray(weights[t], dtype=np.float64))
    rows = engine.layout.tables[t].num_rows
    return np.concatenate(parts)[:rows] if rows else np.zeros((0, engine.layout.dim))


def exposure_audit(cfg, canaries: int = 1000, insertions: int = 9, references: int = 10_000,
                   bins: Optional[int] = None, seed: Optional[int] = None, placement: str = "text") -> dict:
    """The seed's canary exposure test (wide-network-dp §6.5; Carlini et al. 2019): `canaries`
    random 3-word phrases, each inserted `insertions` times into the training data; after one
    run, each phrase's log-perplexity is ranked among `references` random phrases of the same
    form that were not inserted, and Pearson's χ² tests the ranks against uniform (flagged:
    p < 0.01; `bins` default min(20, canaries // 10), so each bin expects ≥ 5 ranks under
    uniformity). Exposure = log2(references + 1) − log2(rank). A phrase inserted n_c times is a
    group of n_c·3 examples: the example-level ε says nothing about it beyond group privacy
    (seed Table 2: sparse flagged at n_c = 15). `placement`: PHRASE_PLACEMENTS."""
    from widedp.trainer.run.train import build_run

    if isinstance(canaries, bool) or not isinstance(canaries, (int, np.integer)) or canaries < 2:
        raise ValueError(f"--canaries must be an integer >= 2, got {canaries!r}")
    if placement not in PHRASE_PLACEMENTS:
        raise ValueError(f"--placement must be one of {list(PHRASE_PLACEMENTS)}, got {placement!r}")
    seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    bins = bins if bins is not None else max(2, min(20, canaries // 10))
    made: dict = {}

    def add_phrases(train_set):
        meta = train_set.meta
        if meta.kind != "cbow":
            raise ValueError(f"--kind exposure needs a CBOW (text) data set, got kind {meta.kind!r}")
        # A phrase's words are contexts (input table) and targets (output table): ids in both.
        vocab = min(meta.table_sizes[meta.feature_tables["context"]], meta.table_sizes[meta.feature_tables["target"]])
        made["phrases"] = rng.integers(0, vocab, (canaries, 3))
        made["references"] = rng.integers(0, vocab, (references, 3))
        words = train_set.feature_rows("target")[1] if placement == "text" else None
        return WithCanaries(train_set, make_phrase_examples(meta, made["phrases"], insertions, rng, placement, words))

    run = build_run(cfg, train_transform=add_phrases)
    with run:
        result = run.run(cfg.train.steps)
        inputs = table_values(run.engine, run.meta.feature_tables["context"], released=True)
        outputs = table_values(run.engine, run.meta.feature_tables["target"], released=True)
        ledger = run.engine.ledger
        claimed = ledger.epsilon() if ledger is not None else math.inf
        delta = float(run.privacy.delta) if ledger is not None else 0.0
        steps = run.engine.step_count
    canary_scores = phrase_log_perplexities(inputs, outputs, made["phrases"])
    reference_scores = phrase_log_perplexities(inputs, outputs, made["references"])
    report = exposure_report(canary_scores, reference_scores, insertions, bins)
    ranks = canary_ranks(canary_scores, reference_scores)
    return {
        "kind": "exposure", "mode": cfg.train.mode,
        "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
        "claimed_epsilon": claimed, "delta": delta, "steps": steps, "stopped_by_budget": bool(result.stopped_by_budget),
        "canaries": canaries, "insertions": insertions, "placement": placement, "references": references,
        "bins": bins,
        "chi2": report.chi2, "p_value": report.p_value, "flagged": bool(report.flagged),
        "mean_exposure": report.mean_exposure, "median_exposure": report.median_exposure,
        "exposure_max": float(np.log2(references + 1)), "audit_seed": seed,
        "ranks": ranks.tolist(), "exposures": exposure(ranks, references + 1).tolist(),
    }


def canary_row_values(engine, canaries: Canaries, released: bool) -> np.ndarray:
    """The canary rows' values [m, len(features)·D] on the shards, each canary's rows side by
    side in `features` order: the released ones (averaged weights when averaging is on) or the
    weights as they are."""
    layout = engine.layout
    if not canaries.tables:
        raise ValueError("these canaries have no rows of their own (inserted phrases)")
    engine.store_pending_noise()
    states = engine.shards.broadcast("state_dict")
    out = np.empty((canaries.count, len(canaries.tables), layout.dim), dtype=np.float64)
    for j, table in enumerate(canaries.tables):
        t = layout.table_index(table)
        rows = canaries.rows(j)
        tables = np.full(rows.size, t, dtype=np.int64)
        owner = layout.owner(tables, rows)
        local = rows - layout.shard_start(tables, owner)
        for s, state in enumerate(states):
            mine = owner == s
            if mine.any():
                weights = state.get("averaged_weights") if released and "averaged_weights" in state else state["weights"]
                out[mine, j] = np.asarray(weights[t])[local[mine]]
    return out.reshape(canaries.count, -1)


def one_run_audit(cfg, canaries: int = 1000, feature: Optional[str] = None, member_fraction: float = 0.1,
                  non_member_fraction: float = 0.1, confidence: float = 0.95, seed: Optional[int] = None,
                  broken: Optional[str] = None, canary_kind: str = "example",
                  canary_examples: Optional[int] = None, observe: str = "final", channel: str = "as-run",
                  test_step_sizes: bool = False) -> dict:
    """Train `cfg` once with canaries and audit it (module docstring). `seed`: the audit's
    coins and tie-breaking (default: fresh OS entropy, recorded in the result only after the
    run). `broken`: a name in BROKEN_VARIANTS to train deliberately broken (the record says
    so). `canary_kind`: one of CANARY_KINDS. `canary_examples`: examples per canary, all
    carrying it (default: privacy.max_examples_per_user at user level — a canary user —
    else 1; more than 1 at example level audits a group the example-level claim does not
    cover). `observe`: one of OBSERVATIONS — "final" scores the released model only; "steps"
    (gradient canaries only) reads every canary's rows after every step, the intermediate-release
    threat model, and scores each canary by the likelihood ratio of the claimed subsampled
    Gaussian mechanism over its per-step updates (`subsampled_gaussian_log_likelihood_ratios`).
    Both bounds are computed from the same scores: the (ε, δ) one-run bound over k+ and k−
    guesses, and the Gaussian-DP (f-DP) bound over the k+ member guesses (`fdp_one_run`).
    `channel`: one of CHANNELS — "as-run" audits the run as it executes (in sparse mode a
    canary row moves only when the step's selection picks it: selection and value together);
    "value" (sparse mode) adds the canaries' rows to every step's selection, so each canary
    row receives every step's noisy value and the audit sees the value channel alone (the
    record also gives the ε of the value events alone, `value_claimed_epsilon`).
    `threshold_audit`: the many-run threshold test over the canaries as independent trials —
    at a threshold chosen on a coin-independent half ("epsilon", "gdp") and, when every step is
    observed, at one fixed from the claimed mechanism before the run with every canary counted
    ("gdp_at_claimed_threshold").
    `conformance`: the run's randomness against its claim (`_conformance`); `test_step_sizes`:
    the auditor's opt-in to also test each step's sample size, an un-noised statistic of the
    secret coins (on anyway for --broken and reproducible runs, which are no private release);
    the record says whether it ran (`conformance_step_sizes`).
    Returns the audit record (`audit.json`)."""
    from widedp.trainer.run.train import build_run

    if not 0 < confidence < 1:
        raise ValueError(f"--confidence must be in (0, 1), got {confidence}")
    if broken is not None and broken not in BROKEN_VARIANTS:
        raise ValueError(f"--broken must be one of {sorted(BROKEN_VARIANTS)}, got {broken!r}")
    if canary_kind not in CANARY_KINDS:
        raise ValueError(f"--canary-kind must be one of {list(CANARY_KINDS)}, got {canary_kind!r}")
    if observe not in OBSERVATIONS:
        raise ValueError(f"--observe must be one of {list(OBSERVATIONS)}, got {observe!r}")
    if observe == "steps" and canary_kind != "gradient":
        raise ValueError("--observe steps scores each step's update along the canary's injected direction: "
                         "use --canary-kind gradient")
    if channel not in CHANNELS:
        raise ValueError(f"--channel must be one of {list(CHANNELS)}, got {channel!r}")
    if channel == "value" and cfg.train.mode != "sparse":
        raise ValueError(f"--channel value audits sparse mode's noisy values of the selected rows; train.mode is "
                         f"{cfg.train.mode!r}, where every row's value is noised every step (use --channel as-run)")
    if channel == "value" and broken in SELECTION_BROKEN:
        raise ValueError(f"--channel value adds the canaries' rows to every selection, which hides what --broken "
                         f"{broken} does to the selection: audit it with --channel as-run")
    if observe == "steps" and cfg.train.mode == "nonprivate":
        raise ValueError("--observe steps scores by the claimed mechanism's likelihood ratio: a nonprivate run "
                         "claims none (audit it with --observe final)")
    user_level = cfg.privacy.unit == "user"
    if canary_examples is None:
        canary_examples = cfg.privacy.max_examples_per_user if user_level else 1
    if broken == "clip-per-example" and not user_level:
        raise ValueError("--broken clip-per-example breaks user-level clipping: set privacy.unit = \"user\"")
    seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    made: dict = {}

    def add_canaries(train_set):
        made["canaries"] = make_canaries(train_set.meta, canaries, feature, rng)
        if canary_kind == "gradient":
            clip = cfg.privacy.clip_norm if cfg.train.mode != "nonprivate" else None
            if clip == "adaptive":  # far above every S1 DP-STAT can pick
                clip = cfg.privacy.adaptive_clip_min * 2.0 ** cfg.privacy.adaptive_clip_doublings
            made["canaries"] = as_gradient_canaries(made["canaries"], cfg.model.embedding_dim, clip, rng)
        made["split"] = WithCanaries(train_set, made["canaries"], canary_examples)
        return made["split"]

    if isinstance(canaries, bool) or not isinstance(canaries, (int, np.integer)) or canaries < 2:
        raise ValueError(f"--canaries must be an integer >= 2, got {canaries!r}")
    k_pos, k_neg = guess_counts(canaries, member_fraction, non_member_fraction)
    stated: dict = {}
    if broken == "delta-one-over-n":
        if str(cfg.privacy.delta) != "auto":
            raise ValueError(f"--broken delta-one-over-n replaces privacy.delta = \"auto\" by 1/n; privacy.delta is "
                             f"{cfg.privacy.delta!r}: set it to \"auto\"")
        if cfg.train.mode == "nonprivate":
            raise ValueError("--broken delta-one-over-n breaks a private run's δ: train.mode is nonprivate")
    with _delta_one_over_n_at_build(stated) if broken == "delta-one-over-n" else contextlib.nullcontext():
        run = build_run(cfg, train_transform=add_canaries)
    with run:
        c: Canaries = made["canaries"]
        dense = {run.engine.layout.tables[t].name for t in run.engine.dense_tables}
        policy = {t: ("dense" if t in dense else "sparse") for t in c.tables}
        if broken in SELECTION_BROKEN and all(p == "dense" for p in policy.values()):
            raise ValueError(f"--broken {broken} rewrites the row selection, but the canaries' table(s) "
                             f"{list(c.tables)} are noised densely in this run (privacy.table_default / "
                             f"privacy.dense_max_rows); set privacy.tables.{c.tables[0]} = \"sparse\" or audit another --feature")
        initial = canary_row_values(run.engine, c, released=False)
        watch = _StepRows(c, initial) if observe == "steps" else None
        if channel == "value" and any(p == "dense" for p in policy.values()):
            raise ValueError(f"--channel value needs the canaries' table(s) {list(c.tables)} to be sparse, but they "
                             f"are noised densely in this run; set privacy.tables.{c.tables[0]} = \"sparse\"")
        with contextlib.ExitStack() as stack:
            if broken:
                stack.enter_context(BROKEN_VARIANTS[broken](run))
            if channel == "value":
                stack.enter_context(_canary_rows_always_selected(run, c))
            split = made["split"]
            sampling = stack.enter_context(_SampleWatch(run.engine.sampler, len(split.base), split.members, c.count))
            result = run.run(cfg.train.steps, [watch] if watch is not None else ())
        final = canary_row_values(run.engine, c, released=True)
        # the weights as they are (not averaged): a row moved iff a step selected it
        last = canary_row_values(run.engine, c, released=False) if watch is None and cfg.train.mode == "sparse" \
            else None
        sample_rate, sigma = float(run.engine.q), run.engine.plan.noise_multiplier if run.engine.plan else None
        ledger = run.engine.ledger
        claimed = ledger.epsilon() if ledger is not None else math.inf
        delta = float(stated.get("delta", run.privacy.delta)) if ledger is not None else 0.0
        steps = run.engine.step_count
        value_claim = _value_channel_epsilon(run.engine, ledger, steps) if channel == "value" else None
        observed = np.stack(watch.rows) if watch is not None else None if last is None else np.stack([initial, last])
        step_sizes = bool(test_step_sizes or broken or cfg.privacy.reproducible)
        conformance = _conformance(cfg, run, c, sampling, observed, steps, confidence,
                                   np.random.default_rng([seed, CONFORMANCE_STREAM]), channel, policy, step_sizes) \
            if ledger is not None else None
    # A sparse run audited as it executes: a canary row moves only in the steps that select it, so
    # the every-step score counts those steps (the selection channel) before their values.
    selection_score = (watch is not None and cfg.train.mode == "sparse" and channel == "as-run"
                       and all(p == "sparse" for p in policy.values()))
    scores_steps = 0  # steps scored by the claim's likelihood ratio (0: another score)
    if watch is not None:
        assert c.directions is not None and sigma is not None  # checked above: gradient canaries, a private run
        rows_by_step = np.stack(watch.rows)
        projections = step_projections(rows_by_step, c.directions)
        if selection_score:
            scores = selected_step_scores(rows_by_step, projections)
        else:
            scales = robust_step_scales(projections)
            normalized = np.divide(projections, scales, out=np.zeros_like(projections), where=scales > 0)
            scores = subsampled_gaussian_log_likelihood_ratios(normalized, sample_rate, sigma)
            scores_steps = normalized.shape[1]
    else:
        scores = white_box_scores(initial, final, c.directions)
    ranked = tie_broken(scores, rng.permutation(scores.size))
    audit = audit_from_scores(ranked, c.included, k_pos, k_neg, delta, confidence)
    gdp = audit_from_scores(ranked, c.included, k_pos, 0, delta, confidence)
    # A nonprivate run (δ = 0, no claim) has no Gaussian-DP bound: μ-GDP with μ > 0 is (ε, 0)-DP for no finite ε.
    gdp_bound = epsilon_lower_bound_gdp(gdp.guesses, gdp.correct, c.count, delta, confidence) if delta > 0 else None
    # The threshold audit (many-run method) over the canaries as independent trials: half (drawn
    # independently of the coins) chooses the threshold, the other half is counted.
    choose = rng.random(c.count) < 0.5
    thresholds = _half_split_thresholds(scores, c.included, choose, delta, confidence)
    if thresholds is not None and watch is not None and not selection_score and delta > 0:
        # every step observed, the score is the claim's likelihood ratio: a threshold fixed from the
        # claimed mechanism alone (simulated at the expected counts), every canary counted
        assert sigma is not None  # watch is set: a private run (checked above)
        claim_t = claimed_mechanism_threshold(sample_rate, sigma, scores_steps, c.count // 2, c.count - c.count // 2, rng)
        thresholds["gdp_at_claimed_threshold"] = dataclasses.asdict(
            threshold_audit_at(scores, c.included, claim_t, delta, confidence))
    # The claim's curve: its accountant's ε at a few δ besides the stated one, each tested with the
    # same jointly bounded rates (at q < 1 the rigorous test where the Gaussian-DP nulls are not).
    curve = None
    if thresholds is not None and ledger is not None and delta > 0:
        rates = thresholds.get("gdp_at_claimed_threshold") or thresholds["epsilon"]
        deltas = sorted({float(delta), *CURVE_DELTAS})
        curve = claim_curve_test(rates["fpr_upper"], rates["fnr_upper"], [(ledger.epsilon(d), d) for d in deltas])
        curve["rates_from"] = "gdp_at_claimed_threshold" if "gdp_at_claimed_threshold" in thresholds else "epsilon"
    return {
        "claim_curve": curve,
        "conformance": conformance,
        "conformance_refuted": bool(conformance is not None and conformance["combined"]["any_refuted"]),
        "conformance_step_sizes": ("tested: the record holds a statistic of the secret sampling coins, un-noised "
                                   + ("(--test-step-sizes)" if test_step_sizes else "(no private release: --broken "
                                      "or privacy.reproducible)")) if conformance is not None and step_sizes
        else "withheld",
        "threshold_audit": thresholds,
        "threshold_assumption": "the canaries are independent trials: each canary's score depends only on its own "
                                "coin and its own rows' noise (white-box canaries on rows no other example reads); "
                                "the one-run bounds do not need this",
        "kind": "one-run", "broken": broken,
        "mode": cfg.train.mode, "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
        "claimed_epsilon": claimed, "delta": delta, "steps": steps, "stopped_by_budget": bool(result.stopped_by_budget),
        "epsilon_lower_bound": audit.epsilon_lower_bound, "confidence": confidence,
        "canaries": c.count, "members": int(c.included.sum()), "guesses": audit.guesses, "correct": audit.correct,
        "guesses_member": k_pos, "guesses_non_member": k_neg,
        "features": list(c.features), "tables": list(c.tables),
        "canary_rows": {t: [r, r + c.count] for t, r in zip(c.tables, c.first_rows)},
        "canary_table_policy": policy if cfg.train.mode == "sparse" else None,
        "canary_kind": canary_kind,
        "privacy_unit": cfg.privacy.unit, "canary_examples": int(canary_examples),
        "score": ("white box: ‖released rows − initial rows‖₂ of the canary's own rows" if c.directions is None else
                  "white box: ⟨initial rows − released rows, u_i⟩, u_i the canary's injected gradient direction"
                  if watch is None else "white box, every step, sparse as run: the number of steps the canary's "
                  "row was selected (moved), ties broken by its updates along u_i over those steps"
                  if selection_score else "white box, every step: the claimed subsampled Gaussian's log-likelihood "
                  "ratio of the canary's per-step updates along u_i, each step's noise scale estimated from "
                  "the released updates (median absolute deviation over canaries)"),
        "exceeds_claim": bool(audit.epsilon_lower_bound > claimed),
        "observe": observe, "threat_model": THREAT_MODELS[observe],
        "sample_rate": sample_rate, "noise_multiplier": sigma,
        "epsilon_lower_bound_gdp": gdp_bound, "gdp_correct": gdp.correct, "gdp_guesses": gdp.guesses,
        "gdp_null": ("exact: every example in every step, the claim is μ-GDP" if sample_rate >= 1.0 else
                     "approximate: a subsampled Gaussian's tradeoff is Gaussian only in the limit of many steps; "
                     "the (ε, δ) bound is the one that refutes the claim"),
        "gdp_exceeds_claim": bool(gdp_bound is not None and gdp_bound > claimed),
        "channel": channel, "value_claimed_epsilon": value_claim,
        "channel_audited": ("the value channel alone: the canaries' rows added to every step's selection (a "
                            "data-independent post-processing of it), so each receives every step's noisy value"
                            if channel == "value" else "the run as it executes" + (
                                ": a canary row moves only when the step's selection picks it (selection and "
                                "value together)" if cfg.train.mode == "sparse" else "")),
        "audit_seed": seed,
        "member_scores": scores[c.included].tolist(), "non_member_scores": scores[~c.included].tolist(),
    }


def _half_split_thresholds(scores: np.ndarray, included: np.ndarray, choose: np.ndarray, delta: float,
                           confidence: float) -> Optional[dict]:
    """The threshold audit at a threshold chosen on the `choose` half, as (ε, δ) and as Gaussian DP;
    None when a half lacks members or non-members (too few trials)."""
    if not all(included[half].any() and (~included[half]).any() for half in (choose, ~choose)):
        return None
    return {objective: dataclasses.asdict(threshold_audit(scores, included, choose, delta, confidence, objective))
            for objective in ("epsilon", "gdp")}


def many_run_audit(cfg, runs: int, confidence: float = 0.95, seed: Optional[int] = None, broken: Optional[str] = None,
                   canary_kind: str = "gradient", observe: str = "final", on_run: Optional[Callable] = None) -> dict:
    """Nasr et al. (2023)'s many-run method with nothing assumed about canaries that share a run:
    `runs` independent training runs of `cfg` (each with fresh secret noise keys and coins), each
    trial one canary of its own run — a member with probability ½ — scored as `one_run_audit`
    scores it; the threshold is chosen on a coin-independent half of the runs and the rates
    counted on the other half (`threshold_audit`, as (ε, δ) and as Gaussian DP).

    Each run trains with two canaries and one of them, picked uniformly at random independently
    of everything, is the run's trial (its coin is fair; the other only fills the table's
    second canary row). `on_run(record)`: called with each run's one-run record (e.g. to charge
    the data set's budget for it). Returns the many-run record (`audit.json`)."""
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 4:
        raise ValueError(f"--runs must be an integer >= 4 (trials split in halves to choose and to count), got {runs!r}")
    if cfg.privacy.reproducible:
        raise ValueError("--runs needs independent runs, but privacy.reproducible = true gives every run the same "
                         "noise: set privacy.reproducible = false")
    if cfg.train.mode == "nonprivate":
        raise ValueError("--runs bounds a private run's ε: train.mode is nonprivate")
    seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    scores, included, claims, deltas, sigmas, steps = [], [], [], [], [], []
    for _ in range(int(runs)):
        record = one_run_audit(cfg, canaries=2, member_fraction=0.5, non_member_fraction=0.0, confidence=confidence,
                               seed=int.from_bytes(rng.bytes(16), "little"),  # each run's coins: 128 bits
                               broken=broken, canary_kind=canary_kind, observe=observe)
        pooled = [(x, True) for x in record["member_scores"]] + [(x, False) for x in record["non_member_scores"]]
        score, member = pooled[int(rng.integers(len(pooled)))]
        scores.append(float(score))
        included.append(bool(member))
        claims.append(float(record["claimed_epsilon"]))
        deltas.append(float(record["delta"]))
        sigmas.append(record["noise_multiplier"])
        steps.append(int(record["steps"]))
        if on_run is not None:
            on_run(record)
    score_arr, coin = np.asarray(scores), np.asarray(included)
    delta = max(deltas)
    choose = rng.random(score_arr.size) < 0.5
    thresholds = _half_split_thresholds(score_arr, coin, choose, delta, confidence)
    claimed = max(claims)
    best = max([t["epsilon_lower_bound"] for t in (thresholds or {}).values()]
               + [t["epsilon_lower_bound_gdp"] or 0.0 for t in (thresholds or {}).values()], default=0.0)
    return {"kind": "many-run", "broken": broken, "mode": cfg.train.mode, "runs": int(runs),
            "claimed_epsilon": claimed, "claimed_epsilon_min": min(claims), "delta": delta,
            "confidence": confidence, "threshold_audit": thresholds, "epsilon_lower_bound": best,
            "noise_multiplier": float(np.median([x for x in sigmas if x is not None])) if any(
                x is not None for x in sigmas) else None, "steps": int(np.median(steps)),
            "exceeds_claim": bool(best > claimed), "canary_kind": canary_kind, "observe": observe,
            "threat_model": THREAT_MODELS[observe],
            "trials": "one canary per run, each run with fresh secret noise: independent trials exactly (no "
                      "assumption about canaries sharing a run)",
            "audit_seed": seed, "member_scores": score_arr[coin].tolist(), "non_member_scores": score_arr[~coin].tolist()}


def write_audit(record: dict, out_dir: Path) -> dict:
    """audit.json and audit.png (score distributions of members and non-members) in out_dir."""
    from widedp.accounting.atomic import atomic_write_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "audit.json", (json.dumps(record, indent=2, default=float) + "\n").encode())
    _plot(record, out_dir / "audit.png")
    return {k: v for k, v in record.items() if not k.endswith("_scores") and k not in ("ranks", "exposures")}


def _plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if record["kind"] == "exposure":
        # matplotlib's stub types `bins` as int | Sequence[float] | str; hist takes any array of edges
        edges = np.linspace(1, record["references"] + 1, record["bins"] + 1)
        ax.hist(record["ranks"], bins=edges)  # type: ignore[arg-type]
        ax.set_xlabel(f"rank of the canary's log-perplexity among {record['references']:,} random phrases (+ itself)")
        ax.set_ylabel("canaries")
        ax.set_title(f"{record['mode']}, n_c = {record['insertions']}: χ² p = {record['p_value']:.2g}, "
                     f"mean exposure {record['mean_exposure']:.2f} bits", fontsize=9)
    else:
        members, others = np.asarray(record["member_scores"]), np.asarray(record["non_member_scores"])
        top = max(members.max(initial=0), others.max(initial=0)) or 1.0
        bottom = min(members.min(initial=0), others.min(initial=0))
        bins = np.linspace(bottom, top, 40)
        # matplotlib's stub types `bins` as int | Sequence[float] | str; hist takes any array of edges
        ax.hist(others, bins=bins, alpha=0.6, label=f"non-members ({others.size})")  # type: ignore[arg-type]
        ax.hist(members, bins=bins, alpha=0.6, label=f"members ({members.size})")  # type: ignore[arg-type]
        ax.set_xlabel("every-step score (audit.json: score)" if record.get("observe") == "steps"
                      else "‖released row − initial row‖₂" if record.get("canary_kind", "example") == "example"
                      else "⟨initial row − released row, injected direction⟩")
        ax.set_ylabel("canaries")
        bounds = f"lower bound {record['epsilon_lower_bound']:.3g}"
        if record.get("epsilon_lower_bound_gdp") is not None:
            bounds += f", GDP {record['epsilon_lower_bound_gdp']:.3g}"
        threshold = (record.get("threshold_audit") or {}).get("gdp") or {}
        if threshold.get("epsilon_lower_bound_gdp") is not None:
            bounds += f", threshold GDP {threshold['epsilon_lower_bound_gdp']:.3g}"
        ax.set_title(f"{record['mode']}: ε claimed {record['claimed_epsilon']:.3g}, "
                     f"{bounds} ({100 * record['confidence']:.0f}%)", fontsize=9)
        ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
