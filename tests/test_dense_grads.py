"""The ghost-norm dense part (trainer/engine/dense_grads.py) against the torch.func reference.

Each model the trainer ships, plus layers the DLRM does not use (a Linear without bias, a
Linear over a sequence dimension), gives the same losses, pooled-output gradients, per-example
squared dense-gradient norms and clipped sums both ways; a wrong ghost norm is caught; what
the ghost path cannot do exactly (a shared layer, an unregistered layer, an in-place change
of a captured output) falls back to the reference or is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import widedp.trainer.engine.dense_grads as dg
from widedp.trainer.engine.dense_grads import GhostGradients, GhostUnsupported, PerExampleGradients, dense_gradients
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


class SequenceModel(DenseModel):
    """A Linear applied over the F pooled vectors as a sequence, then a bias-free Linear."""

    def __init__(self):
        super().__init__()
        self.per_feature = nn.Linear(D, 5)
        self.head = nn.Linear(5 * F, 1, bias=False)

    def forward(self, pooled, dense):
        return self.head(torch.tanh(self.per_feature(pooled)).flatten(1)).squeeze(-1)

    def loss(self, outputs, labels):
        return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")

    def metrics(self, outputs, labels):
        return {}


class SharedLayerModel(SequenceModel):
    """One Linear called twice: its per-example gradient is the sum over both calls."""

    def forward(self, pooled, dense):
        h = self.per_feature(pooled[:, 0]) + self.per_feature(pooled[:, 1])
        return h.sum(-1)


class InPlaceModel(SequenceModel):
    def forward(self, pooled, dense):
        h = self.per_feature(pooled).relu_()
        return self.head(h.flatten(1)).squeeze(-1)


def models():
    torch.manual_seed(0)
    names = [f"f{i}" for i in range(F)]
    return {
        "dlrm-cat": DLRM(names, D, bottom_mlp=[16], top_mlp=[16, 8], interaction="cat"),
        "dlrm-dot": DLRM(names, D, bottom_mlp=[16], top_mlp=[16], interaction="dot"),
        "sequence": SequenceModel(),
    }


def assert_agree(model, pooled, dense, labels, factors):
    ref = PerExampleGradients(model, pooled, dense, labels)
    ghost = GhostGradients(model, pooled, dense, labels)
    torch.testing.assert_close(ghost.losses, ref.losses, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ghost.pooled_grads, ref.pooled_grads, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ghost.sq_norms, ref.sq_norms, rtol=1e-5, atol=1e-9)
    want, got = ref.clipped_sum(factors), ghost.clipped_sum(factors)
    assert got.keys() == want.keys() == dict(model.named_parameters()).keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    return ref, ghost


@pytest.mark.parametrize("name", ["dlrm-cat", "dlrm-dot", "sequence"])
def test_ghost_path_equals_the_per_example_reference(name):
    model = models()[name]
    pooled, dense, labels = batch()
    factors = torch.rand(B, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, _ = assert_agree(model, pooled, dense, labels, factors)
    assert (ref.sq_norms > 0).all()  # every example has a dense gradient to measure


def test_ghost_path_equals_the_reference_on_cbow_which_has_no_dense_parameters():
    model = CBOW(["context", "target", "neg_0", "neg_1"], D)
    pooled, dense, labels = batch(features=4, with_dense=False)
    ref, ghost = assert_agree(model, pooled, dense, labels, torch.ones(B, dtype=torch.float64))
    assert (ghost.sq_norms == 0).all()


def test_auto_uses_the_ghost_path_for_the_shipped_models():
    pooled, dense, labels = batch()
    for name in ("dlrm-cat", "dlrm-dot"):
        assert isinstance(dense_gradients(models()[name], pooled, dense, labels), GhostGradients)


def test_a_wrong_ghost_norm_is_caught(monkeypatch):
    """The Opacus-style slip of dropping the bias term (or squaring the wrong factor) changes
    the norms: the agreement check above would fail."""
    monkeypatch.setitem(dg._GHOST_NORMS, nn.Linear, lambda layer, a, g: a.double().pow(2).sum(1)
                        * g.double().pow(2).sum(1))
    pooled, dense, labels = batch()
    with pytest.raises(AssertionError):
        assert_agree(models()["dlrm-cat"], pooled, dense, labels, torch.ones(B, dtype=torch.float64))


def test_a_layer_called_twice_is_refused_by_ghost_and_auto_falls_back():
    model = SharedLayerModel()
    pooled, dense, labels = batch()
    with pytest.raises(GhostUnsupported, match="Linear is called more than once"):
        dense_gradients(model, pooled, dense, labels, "ghost")
    auto = dense_gradients(model, pooled, dense, labels)
    assert isinstance(auto, PerExampleGradients)
    ref = PerExampleGradients(model, pooled, dense, labels)
    torch.testing.assert_close(auto.sq_norms, ref.sq_norms)


def test_an_output_changed_in_place_is_refused():
    with pytest.raises(GhostUnsupported, match="modified in place"):
        dense_gradients(InPlaceModel(), *batch(), "ghost")


def test_an_unregistered_layer_names_itself_and_auto_uses_the_reference():
    class Scaled(DLRM):
        def __init__(self):
            super().__init__([f"f{i}" for i in range(F)], D, interaction="cat")
            self.norm = nn.PReLU(F)

        def forward(self, pooled, dense):
            return super().forward(self.norm(pooled), dense)

    model = Scaled()
    with pytest.raises(ValueError, match=r"no ghost norm registered for \['PReLU'\]"):
        dense_gradients(model, *batch(), "ghost")
    assert isinstance(dense_gradients(model, *batch()), PerExampleGradients)


def test_registry_refuses_a_second_ghost_norm_for_a_layer_type():
    with pytest.raises(ValueError, match="already registered"):
        dg.register_ghost_norm(nn.Linear)(lambda layer, a, g: g)


def test_clipped_sum_runs_once():
    ghost = GhostGradients(models()["dlrm-cat"], *batch())
    ghost.clipped_sum(torch.ones(B, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="runs once"):
        ghost.clipped_sum(torch.ones(B, dtype=torch.float64))


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="'auto', 'ghost' or 'per_example'"):
        dense_gradients(models()["dlrm-cat"], *batch(), "vmap")


@pytest.mark.parametrize("name", ["dlrm-cat", "dlrm-dot", "sequence"])
def test_pass_two_by_a_second_backward_equals_the_reference_too(name, monkeypatch):
    """Without ghost sums (a layer type that has none) pass 2 is a backward of Σ c_j ℓ_j."""
    monkeypatch.setattr(dg, "_GHOST_SUMS", {})
    pooled, dense, labels = batch(2)
    factors = torch.rand(B, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, ghost = assert_agree(models()[name], pooled, dense, labels, factors)
    assert not ghost._book_keeping


def test_the_ghost_sums_take_the_place_of_the_second_backward_for_linear_layers():
    ghost = GhostGradients(models()["dlrm-cat"], *batch())
    assert ghost._book_keeping and ghost._losses is None  # pass 1's graph is already gone


def test_a_wrong_ghost_sum_is_caught(monkeypatch):
    """A ghost sum that forgets the clip factors (the unclipped sum) fails the agreement."""
    real = dg._GHOST_SUMS[nn.Linear]
    monkeypatch.setitem(dg._GHOST_SUMS, nn.Linear, lambda layer, a, g, c: real(layer, a, g, torch.ones_like(c)))
    pooled, dense, labels = batch()
    factors = torch.rand(B, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_agree(models()["sequence"], pooled, dense, labels, factors)


def test_registry_refuses_a_second_ghost_sum_for_a_layer_type():
    with pytest.raises(ValueError, match="already registered"):
        dg.register_ghost_sum(nn.Linear)(lambda layer, a, g, c: {})
