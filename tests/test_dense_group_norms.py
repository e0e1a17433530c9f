"""Per-group (per-user) squared norms of the summed dense gradients (trainer/engine/dense_grads.py).

The specification is the slow, obvious one: for each group u, one backward of Σ_{j∈u} ℓ_j and
the squared norm of the parameter gradients, ‖Σ_{j∈u} ∇_θ ℓ_j‖². The ghost path (Gram matrices
or the materialized weight gradient per group, whichever is cheaper) and the per-example
reference (segment sums) both equal it on every model here, a Linear over a sequence dimension
included, for groups of size 1, several, uneven, empty, one group for the whole batch, and all
groups of size 1 (then the group norms are `sq_norms`). It is the norm of the sum, not the sum
of norms: two examples with opposite gradients in one group have a group norm of 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import widedp.trainer.engine.dense_grads as dg
from widedp.trainer.engine.dense_grads import GhostGradients, PerExampleGradients, dense_gradients
from widedp.trainer.models.base import DenseModel
from widedp.trainer.models.cbow import CBOW
from widedp.trainer.models.dlrm import DLRM

B, F, D = 9, 4, 8


def batch(seed=0, features=F, with_dense=True):
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(B, features, D, generator=g)
    dense = torch.randn(B, 13, generator=g) if with_dense else torch.zeros(B, 0)
    labels = torch.randint(0, 2, (B,), generator=g).float()
    return pooled, dense, labels


class _Binary(DenseModel):
    def loss(self, outputs, labels):
        return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")

    def metrics(self, outputs, labels):
        return {}


class SequenceModel(_Binary):
    """A Linear over the F pooled vectors as a sequence (a [B, F, D] input), then a bias-free Linear."""

    def __init__(self):
        super().__init__()
        self.per_feature = nn.Linear(D, 5)
        self.head = nn.Linear(5 * F, 1, bias=False)

    def forward(self, pooled, dense):
        return self.head(torch.tanh(self.per_feature(pooled)).flatten(1)).squeeze(-1)


class GridModel(SequenceModel):
    """The same Linear over two sequence dimensions (a [B, 2, F/2, D] input)."""

    def forward(self, pooled, dense):
        grid = pooled.unflatten(1, (2, F // 2))
        return self.head(torch.tanh(self.per_feature(grid)).flatten(1)).squeeze(-1)


class ScoreModel(DenseModel):
    """loss_j = labels_j · (w·x_j + b): the gradient flips sign with the label."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(F * D, 1)

    def forward(self, pooled, dense):
        return self.score(pooled.flatten(1)).squeeze(-1)

    def loss(self, outputs, labels):
        return outputs * labels

    def metrics(self, outputs, labels):
        return {}


def build(name):
    torch.manual_seed(0)
    names = [f"f{i}" for i in range(F)]
    return {
        "dlrm-cat": lambda: DLRM(names, D, bottom_mlp=[16], top_mlp=[16, 8], interaction="cat"),
        "dlrm-dot": lambda: DLRM(names, D, bottom_mlp=[16], top_mlp=[16], interaction="dot"),
        "cbow": lambda: CBOW(["context", "target", "neg_0", "neg_1"], D),
        "sequence": SequenceModel,
        "grid": GridModel,
    }[name]()


def inputs(name, seed=0):
    return batch(seed, with_dense=name != "cbow")


GROUPINGS = {
    # sizes 2, 0, 4, 2, 1, 0: uneven, one singleton, two empty groups, examples interleaved
    "mixed": (torch.tensor([2, 0, 3, 2, 4, 2, 0, 3, 2]), 6),
    "whole-batch": (torch.zeros(B, dtype=torch.int64), 1),
    "singletons": (torch.tensor([3, 7, 0, 8, 1, 5, 2, 6, 4]), B),
    # one group of 6 and three of 1: two size classes, padded to 6 and 1 (not all to 6)
    "skewed": (torch.tensor([0, 5, 0, 0, 0, 0, 0, 2, 3]), 6),
    "random": (torch.randint(0, 4, (B,), generator=torch.Generator().manual_seed(5)), 4),
}
MODELS = ["dlrm-cat", "dlrm-dot", "cbow", "sequence", "grid"]


def reference_group_sq_norms(model, pooled, dense, labels, groups, num_groups):
    """Loop over groups: ‖∇_θ Σ_{j∈u} ℓ_j‖² by one backward each (0 for an empty group)."""
    params = list(model.parameters())
    out = torch.zeros(num_groups, dtype=torch.float64)
    for u in range(num_groups):
        idx = (groups == u).nonzero().flatten()
        if not idx.numel():
            continue
        total = model.loss(model(pooled[idx], dense[idx]), labels[idx]).sum()
        if not total.requires_grad:
            continue  # no parameter reaches the loss (CBOW): a zero gradient
        grads = torch.autograd.grad(total, params, allow_unused=True)
        out[u] = sum((g.double().pow(2).sum() for g in grads if g is not None), torch.tensor(0.0, dtype=torch.float64))
    return out


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("name", MODELS)
def test_group_norms_equal_one_backward_per_group(name, grouping):
    model = build(name)
    pooled, dense, labels = inputs(name)
    groups, U = GROUPINGS[grouping]
    want = reference_group_sq_norms(model, pooled, dense, labels, groups, U)
    for cls in (GhostGradients, PerExampleGradients):
        got = cls(model, pooled, dense, labels).group_sq_norms(groups, U)
        assert got.dtype == torch.float64 and got.shape == (U,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9, msg=f"{cls.__name__}")
    if name != "cbow":
        sizes = torch.bincount(groups, minlength=U)
        assert (want[sizes > 0] > 0).all() and (want[sizes == 0] == 0).all()


@pytest.mark.parametrize("name", MODELS)
def test_singleton_groups_are_the_per_example_norms(name):
    model = build(name)
    pooled, dense, labels = inputs(name)
    groups, U = GROUPINGS["singletons"]
    for cls in (GhostGradients, PerExampleGradients):
        grads = cls(model, pooled, dense, labels)
        torch.testing.assert_close(grads.group_sq_norms(groups, U)[groups], grads.sq_norms, rtol=1e-12, atol=1e-15)


def test_the_norm_of_the_sum_not_the_sum_of_norms():
    """Two copies of one example with labels +1 and -1 have opposite gradients: their group's
    norm is 0 (a sum of norms would be twice one example's); two copies with the same label
    have twice the gradient, so four times the squared norm (a sum of norms: twice)."""
    model = ScoreModel()
    x = torch.randn(1, F, D, generator=torch.Generator().manual_seed(7))
    pooled, dense = x.repeat(4, 1, 1), torch.zeros(4, 0)
    labels = torch.tensor([1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    for cls in (GhostGradients, PerExampleGradients):
        grads = cls(model, pooled, dense, labels)
        one = float(grads.sq_norms[0])
        assert one == pytest.approx(float(x.double().pow(2).sum()) + 1.0)  # ‖x‖² + the bias's 1
        got = grads.group_sq_norms(groups, 2)
        assert float(got[0]) == pytest.approx(0.0, abs=1e-9 * one)
        assert float(got[1]) == pytest.approx(4 * one, rel=1e-9)


@pytest.mark.parametrize("branch", [True, False], ids=["gram", "materialized"])
@pytest.mark.parametrize("name", ["dlrm-cat", "sequence", "grid"])
@pytest.mark.parametrize("grouping", ["mixed", "whole-batch", "singletons"])
def test_both_ways_to_the_linear_group_norm_agree(name, grouping, branch, monkeypatch):
    taken = []
    monkeypatch.setattr(dg, "linear_group_uses_gram", lambda rows, i, o: taken.append(branch) or branch)
    model = build(name)
    pooled, dense, labels = inputs(name, seed=1)
    groups, U = GROUPINGS[grouping]
    want = reference_group_sq_norms(model, pooled, dense, labels, groups, U)
    torch.testing.assert_close(GhostGradients(model, pooled, dense, labels).group_sq_norms(groups, U), want,
                               rtol=1e-5, atol=1e-9)
    assert taken and set(taken) == {branch}


def test_the_flop_rule_picks_gram_for_few_rows_and_wide_layers_and_the_product_otherwise(monkeypatch):
    assert dg.linear_group_uses_gram(1, 16, 16)  # one example per group: (a·a)(g·g)
    assert dg.linear_group_uses_gram(4, 64, 64)
    assert not dg.linear_group_uses_gram(36, 8, 5)  # 36²·14 > 37·40
    assert not dg.linear_group_uses_gram(64, 16, 1)
    # On the sequence model with singleton groups both occur in one call, and agree: per_feature
    # (rows 1·4, 8 -> 5: 4²·14 > 5·40) forms the product, head (rows 1, 20 -> 1: 22 <= 40) the Gram.
    real, seen = dg.linear_group_uses_gram, []
    monkeypatch.setattr(dg, "linear_group_uses_gram", lambda rows, i, o: seen.append(real(rows, i, o)) or seen[-1])
    model, (pooled, dense, labels) = build("sequence"), batch(2)
    groups, U = GROUPINGS["singletons"]
    got = GhostGradients(model, pooled, dense, labels).group_sq_norms(groups, U)
    assert sorted(seen) == [False, True]
    torch.testing.assert_close(got, reference_group_sq_norms(model, pooled, dense, labels, groups, U),
                               rtol=1e-5, atol=1e-9)


def test_group_layouts_pad_each_size_class_to_its_largest():
    groups, U = GROUPINGS["skewed"]  # sizes 6, 0, 1, 1, 0, 1
    layouts = dg.group_layouts(groups, U)
    assert [layout.group_ids.tolist() for layout in layouts] == [[2, 3, 5], [0]]
    assert [layout.max_size for layout in layouts] == [1, 6]  # 9 slots for 9 examples; one grid: 4 × 6
    x = torch.randn(B, 3)
    for layout in layouts:
        padded = layout.pad(x)
        for r, u in enumerate(layout.group_ids.tolist()):
            members = x[groups == u]
            assert torch.equal(padded[r, :len(members)], members) and (padded[r, len(members):] == 0).all()
        want = torch.stack([x[groups == u].sum(0) for u in layout.group_ids.tolist()])
        torch.testing.assert_close(layout.segment_sum(x), want)
    groups, U = GROUPINGS["mixed"]  # sizes 2, 0, 4, 2, 1, 0: classes 1, 2, 4
    assert [layout.group_ids.tolist() for layout in dg.group_layouts(groups, U)] == [[4], [0, 3], [2]]
    assert sum(layout.num_groups * layout.max_size for layout in dg.group_layouts(groups, U)) == B


def test_group_norms_come_before_the_clipped_sum_and_leave_it_unchanged():
    model = build("dlrm-cat")
    pooled, dense, labels = batch()
    groups, U = GROUPINGS["mixed"]
    factors = torch.rand(B, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = PerExampleGradients(model, pooled, dense, labels)
    want = ref.clipped_sum(factors)
    for cls in (GhostGradients, PerExampleGradients):
        grads = cls(model, pooled, dense, labels)
        first = grads.group_sq_norms(groups, U)
        torch.testing.assert_close(grads.group_sq_norms(groups, U), first)  # repeatable
        got = grads.clipped_sum(factors)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
        with pytest.raises(RuntimeError, match="group_sq_norms must come before clipped_sum"):
            grads.group_sq_norms(groups, U)


def test_group_norms_after_the_per_example_clamped_sum_are_refused_too():
    grads = PerExampleGradients(build("dlrm-cat"), *batch())
    grads.clamped_sum(torch.ones(B, dtype=torch.float64), 0.1)
    with pytest.raises(RuntimeError, match="before clipped_sum"):
        grads.group_sq_norms(torch.zeros(B, dtype=torch.int64), 1)


@pytest.mark.parametrize("groups, num_groups, match", [
    (torch.zeros(B - 1, dtype=torch.int64), 1, r"shape \[B\] = \[9\].*got \[8\]"),
    (torch.zeros(B, 1, dtype=torch.int64), 1, r"shape \[B\] = \[9\].*got \[9, 1\]"),
    (torch.full((B,), 3), 3, r"\[0, 3\), got 3"),
    (torch.tensor([0, 1, -1, 0, 1, 0, 1, 0, 1]), 3, r"\[0, 3\), got -1"),
    (torch.zeros(B), 1, "integer .* got dtype torch.float32"),
    (torch.zeros(B, dtype=torch.bool), 1, "integer .* got dtype torch.bool"),
    (torch.zeros(B, dtype=torch.int64), -1, "num_groups must be an int >= 0, got -1"),
    (torch.zeros(B, dtype=torch.int64), 1.0, "num_groups must be an int >= 0, got 1.0"),
    (torch.zeros(B, dtype=torch.int64), 0, r"\[0, 0\), got 0"),
])
def test_bad_groups_are_refused(groups, num_groups, match):
    for cls in (GhostGradients, PerExampleGradients):
        with pytest.raises(ValueError, match=match):
            cls(build("dlrm-cat"), *batch()).group_sq_norms(groups, num_groups)


def test_integer_groups_of_other_types_are_accepted():
    grads = GhostGradients(build("dlrm-cat"), *batch())
    want = grads.group_sq_norms(GROUPINGS["mixed"][0], 6)
    torch.testing.assert_close(grads.group_sq_norms(GROUPINGS["mixed"][0].int(), 6), want)
    torch.testing.assert_close(grads.group_sq_norms(GROUPINGS["mixed"][0].numpy().astype(np.int32), 6), want)


def test_a_layer_without_a_ghost_group_norm_names_itself_and_grouped_auto_uses_the_reference(monkeypatch):
    monkeypatch.setattr(dg, "_GHOST_GROUP_NORMS", {})
    model, data = build("dlrm-cat"), batch()
    ghost = dense_gradients(model, *data)
    assert isinstance(ghost, GhostGradients)  # supports_ghost is unchanged
    with pytest.raises(ValueError, match=r"no ghost group norm registered for \['Linear'\]"):
        ghost.group_sq_norms(torch.zeros(B, dtype=torch.int64), 1)
    assert isinstance(dense_gradients(model, *data, grouped=True), PerExampleGradients)
    with pytest.raises(ValueError, match=r"no ghost group norm registered for \['Linear'\]"):
        dense_gradients(model, *data, "ghost", grouped=True)


def test_grouped_auto_uses_the_ghost_path_for_the_shipped_models():
    assert isinstance(dense_gradients(build("dlrm-cat"), *batch(), grouped=True), GhostGradients)


def test_registry_refuses_a_second_ghost_group_norm_for_a_layer_type():
    with pytest.raises(ValueError, match="already registered"):
        dg.register_ghost_group_norm(nn.Linear)(lambda layer, a, g, layout: g)


def test_an_empty_batch_has_zero_group_norms():
    model = build("dlrm-cat")
    pooled, dense, labels = (t[:0] for t in batch())
    got = GhostGradients(model, pooled, dense, labels).group_sq_norms(torch.zeros(0, dtype=torch.int64), 3)
    assert torch.equal(got, torch.zeros(3, dtype=torch.float64))
