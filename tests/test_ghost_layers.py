"""Ghost norms, ghost sums and ghost group norms beyond the sequence-free nn.Linear
(trainer/engine/dense_grads.py), each held to the torch.func reference.

Layers: nn.Linear over one or more sequence dimensions (both ways to the weight norm: the Gram
form and the formed gradient), nn.LayerNorm (with and without bias, one- and two-dimensional
normalized shapes, with and without positions), nn.Embedding inside the dense part (ids [B] and
[B, T], repeated ids within an example, padding_idx) and nn.Conv1d (stride, padding, 'same',
dilation, padding modes, no bias), alone and mixed in a small transformer-like block. For each:
losses, pooled-output gradients, per-example squared norms and clipped sums with random factors
agree with the reference in float32 (rtol 1e-5) and float64 (rtol 1e-10), and the group norms
agree with one backward per group for uneven groups (a singleton, groups of different sizes,
an empty group). Each formula has a broken twin (the norm of the sum taken as a sum of norms,
x instead of x̂, repeated ids not merged, a permuted patch layout, padding rows not skipped)
that the same checks reject. What the ghost path cannot follow — nn.MultiheadAttention, refused
configurations, tied weights, a parameter used without its module, a layer applied across the
batch dimension — falls back to the reference, and "auto" says so once per model class."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from torch import nn

import widedp.trainer.engine.dense_grads as dg
from widedp.trainer.engine.dense_grads import GhostGradients, GhostUnsupported, PerExampleGradients, dense_gradients
from test_dense_group_norms import _Binary  # the binary loss every model here shares
from widedp.trainer.models.dlrm import DLRM

B, F, D, V = 9, 6, 8, 5  # batch, sequence positions (features), embedding width, vocabulary of ids
LOGGER = "widedp.trainer.engine.dense_grads"


def batch(seed=0, dtype=torch.float32):
    """pooled [B, F, D]; dense [B, 13] holding small integers in [0, V) (ids for the Embedding
    models, repeated within an example), as floats; binary labels."""
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(B, F, D, generator=g, dtype=dtype)
    dense = torch.randint(0, V, (B, 13), generator=g).to(dtype)
    labels = torch.randint(0, 2, (B,), generator=g).to(dtype)
    return pooled, dense, labels


class SeqLinear(_Binary):
    """A Linear over the F positions, a bias-free Linear over two sequence dimensions [B, 2, F/2, h]."""

    def __init__(self, hidden=5, bias=True):
        super().__init__()
        self.proj = nn.Linear(D, hidden, bias=bias)
        self.mix = nn.Linear(hidden, 3, bias=False)
        self.head = nn.Linear(3 * F, 1)

    def forward(self, pooled, dense):
        h = torch.tanh(self.proj(pooled)).unflatten(1, (2, F // 2))
        return self.head(torch.tanh(self.mix(h)).flatten(1)).squeeze(-1)


class Norms(_Binary):
    """LayerNorm over positions (with bias, then without), over a 2-d normalized shape, and
    without positions ([B, h])."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.proj = nn.Linear(D, 4)
        self.ln_nobias = nn.LayerNorm(4, bias=False, eps=1e-3)
        self.ln_2d = nn.LayerNorm((F, 4))
        self.flat = nn.Linear(F * 4, 7)
        self.ln_flat = nn.LayerNorm(7)
        self.head = nn.Linear(7, 1)

    def forward(self, pooled, dense):
        h = torch.tanh(self.proj(self.ln(pooled * 3 + 1)))
        h = self.ln_2d(torch.tanh(self.ln_nobias(h)))
        return self.head(torch.tanh(self.ln_flat(self.flat(h.flatten(1))))).squeeze(-1)


class Embeds(_Binary):
    """ids from `dense`: an Embedding over [B, F] ids (with a padding_idx), one over [B] ids."""

    def __init__(self, padding_idx=2):
        super().__init__()
        self.tokens = nn.Embedding(V, D, padding_idx=padding_idx)
        self.kind = nn.Embedding(V, 3)
        self.head = nn.Linear(F * D + 3, 1)

    def forward(self, pooled, dense):
        ids = dense[:, :F].long()
        h = torch.tanh(self.tokens(ids) + pooled)
        return self.head(torch.cat([h.flatten(1), self.kind(dense[:, F].long())], 1)).squeeze(-1)


class Convs(_Binary):
    """A Conv1d over the F positions (channels D), then a second Conv1d."""

    def __init__(self, **conv):
        super().__init__()
        self.conv = nn.Conv1d(D, 5, **conv)
        self.conv2 = nn.Conv1d(5, 3, kernel_size=2)
        with torch.no_grad():
            length = self.conv2(self.conv(torch.zeros(1, D, F))).shape[-1]
        self.head = nn.Linear(3 * length, 1)

    def forward(self, pooled, dense):
        h = torch.tanh(self.conv(pooled.transpose(1, 2)))
        return self.head(torch.tanh(self.conv2(h)).flatten(1)).squeeze(-1)


class Block(_Binary):
    """Transformer-like: token embeddings from ids added to the pooled vectors, a pre-LN
    attention block with q/k/v/out nn.Linear projections, a pre-LN 4×-wide MLP, a Conv1d over
    the positions, mean-pooled to a logit."""

    def __init__(self, width=D, heads=2):
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(V, width, padding_idx=0)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width, bias=False)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.conv = nn.Conv1d(width, 4, kernel_size=3, padding=1)
        self.head = nn.Linear(4, 1)

    def forward(self, pooled, dense):
        x = pooled + self.tokens(dense[:, :F].long())
        h = self.ln1(x)
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v
        x = x + self.out(att.transpose(1, 2).flatten(2))
        x = x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
        return self.head(torch.tanh(self.conv(x.transpose(1, 2))).mean(-1)).squeeze(-1)


CONVS = {
    "k3-p1": dict(kernel_size=3, padding=1),
    "k2-s2": dict(kernel_size=2, stride=2),
    "k3-p2-d2": dict(kernel_size=3, padding=2, dilation=2),
    "same-k4-d2": dict(kernel_size=4, padding="same", dilation=2),  # 6 = 3 left + 3 right
    "same-k2": dict(kernel_size=2, padding="same"),  # 1 = 0 left + 1 right
    "reflect": dict(kernel_size=3, padding=1, padding_mode="reflect"),
    "circular-s2": dict(kernel_size=3, padding=2, stride=2, padding_mode="circular"),
    "nobias": dict(kernel_size=3, bias=False),
}


def build(name):
    torch.manual_seed(0)
    if name.startswith("conv-"):
        return Convs(**CONVS[name[5:]])
    return {
        "seq-linear": SeqLinear,
        "seq-linear-nobias": lambda: SeqLinear(bias=False),
        "wide-seq-linear": lambda: SeqLinear(hidden=64),
        "layer-norm": Norms,
        "embedding": Embeds,
        "embedding-nopad": lambda: Embeds(padding_idx=None),
        "block": Block,
    }[name]()


MODELS = ["seq-linear", "seq-linear-nobias", "wide-seq-linear", "layer-norm", "embedding", "embedding-nopad",
          "block", *(f"conv-{c}" for c in CONVS)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float64: dict(rtol=1e-10, atol=1e-13)}
GROUPINGS = {
    # sizes 2, 4, 1, 2, 0: uneven, one singleton, one empty group, examples interleaved
    "uneven": (torch.tensor([1, 0, 1, 2, 1, 3, 3, 1, 0]), 5),
    # sizes 5, 1, 3: three size classes
    "skewed": (torch.tensor([0, 0, 2, 0, 1, 2, 0, 2, 0]), 3),
    "singletons": (torch.tensor([3, 7, 0, 8, 1, 5, 2, 6, 4]), B),
    "whole-batch": (torch.zeros(B, dtype=torch.int64), 1),
}


def factors_for(seed=1):
    return torch.rand(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_agree(model, pooled, dense, labels, factors, tol):
    ref = PerExampleGradients(model, pooled, dense, labels)
    ghost = GhostGradients(model, pooled, dense, labels)
    torch.testing.assert_close(ghost.losses, ref.losses, **tol)
    torch.testing.assert_close(ghost.pooled_grads, ref.pooled_grads, **tol)
    torch.testing.assert_close(ghost.sq_norms, ref.sq_norms, rtol=tol["rtol"], atol=1e-12)
    want, got = ref.clipped_sum(factors), ghost.clipped_sum(factors)
    assert got.keys() == want.keys() == dict(model.named_parameters()).keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)
    return ref, ghost


def reference_group_sq_norms(model, pooled, dense, labels, groups, num_groups):
    """The specification: ‖∇_θ Σ_{j∈u} ℓ_j‖² by one backward per group (0 for an empty group)."""
    params = list(model.parameters())
    out = torch.zeros(num_groups, dtype=torch.float64)
    for u in range(num_groups):
        idx = (groups == u).nonzero().flatten()
        if idx.numel():
            grads = torch.autograd.grad(model.loss(model(pooled[idx], dense[idx]), labels[idx]).sum(), params,
                                        allow_unused=True)
            out[u] = sum((g.double().pow(2).sum() for g in grads if g is not None), torch.tensor(0.0, dtype=torch.float64))
    return out


# ---- agreement with the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", MODELS)
def test_ghost_norms_and_sums_equal_the_reference(name, dtype):
    model = build(name).to(dtype)
    pooled, dense, labels = batch(dtype=dtype)
    ref, _ = assert_agree(model, pooled, dense, labels, factors_for(), TOL[dtype])
    assert (ref.sq_norms > 0).all()
    assert isinstance(dense_gradients(model, pooled, dense, labels), GhostGradients)  # no fallback
    assert isinstance(dense_gradients(model, pooled, dense, labels, grouped=True), GhostGradients)


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("name", MODELS)
def test_ghost_group_norms_equal_one_backward_per_group(name, grouping):
    model = build(name).double()
    pooled, dense, labels = batch(2, dtype=torch.float64)
    groups, U = GROUPINGS[grouping]
    want = reference_group_sq_norms(model, pooled, dense, labels, groups, U)
    sizes = torch.bincount(groups, minlength=U)
    assert (want[sizes > 0] > 0).all() and (want[sizes == 0] == 0).all()
    ghost = GhostGradients(model, pooled, dense, labels)
    torch.testing.assert_close(ghost.group_sq_norms(groups, U), want, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(PerExampleGradients(model, pooled, dense, labels).group_sq_norms(groups, U), want,
                               rtol=1e-10, atol=1e-13)
    if grouping == "singletons":
        torch.testing.assert_close(ghost.group_sq_norms(groups, U)[groups], ghost.sq_norms, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["seq-linear", "block"])
def test_group_norms_in_float32_too(name):
    model = build(name)
    pooled, dense, labels = batch(3)
    groups, U = GROUPINGS["uneven"]
    want = reference_group_sq_norms(model, pooled, dense, labels, groups, U)
    torch.testing.assert_close(GhostGradients(model, pooled, dense, labels).group_sq_norms(groups, U), want,
                               rtol=1e-5, atol=1e-9)


# ---- nn.Linear with a sequence dimension: both ways to the norm ----------------------------------------
@pytest.mark.parametrize("gram", [True, False], ids=["gram", "formed"])
@pytest.mark.parametrize("name", ["seq-linear", "seq-linear-nobias", "block", "conv-k3-p2-d2"])
def test_both_ways_to_the_sequence_weight_norm_agree(name, gram, monkeypatch):
    taken = []
    monkeypatch.setattr(dg, "linear_norm_uses_gram", lambda t, i, o: taken.append(gram) or gram)
    model = build(name).double()
    pooled, dense, labels = batch(4, dtype=torch.float64)
    assert_agree(model, pooled, dense, labels, factors_for(5), TOL[torch.float64])
    assert taken and set(taken) == {gram}


def test_the_cost_rule_picks_the_gram_form_for_short_sequences_of_wide_layers(monkeypatch):
    assert dg.linear_norm_uses_gram(1, 4, 4)
    assert dg.linear_norm_uses_gram(32, 128, 128)  # 32²·257 < 33·128²
    assert not dg.linear_norm_uses_gram(6, 8, 5)  # 36·14 > 7·40
    assert not dg.linear_norm_uses_gram(512, 64, 64)
    # SeqLinear(hidden=64): proj (T = 6, 8 -> 64: 36·73 <= 7·512) takes the Gram form, mix (T = 2·3, 64 -> 3)
    # forms the gradient; in one call both occur and the norms agree with the reference.
    real, seen = dg.linear_norm_uses_gram, []
    monkeypatch.setattr(dg, "linear_norm_uses_gram", lambda t, i, o: seen.append(real(t, i, o)) or seen[-1])
    model = build("wide-seq-linear")
    pooled, dense, labels = batch()
    ghost = GhostGradients(model, pooled, dense, labels)
    assert sorted(seen) == [False, True]
    torch.testing.assert_close(ghost.sq_norms, PerExampleGradients(model, pooled, dense, labels).sq_norms,
                               rtol=1e-5, atol=1e-12)


def test_the_sequence_free_linear_norm_is_the_product_of_norms_as_before(monkeypatch):
    """Input [B, in]: ‖a‖²‖g‖² (+ ‖g‖²), the cost rule is never consulted."""
    def refuse(*args):
        raise AssertionError("the cost rule is for sequences only")

    monkeypatch.setattr(dg, "linear_norm_uses_gram", refuse)
    layer = nn.Linear(4, 3)
    a, g = torch.randn(B, 4), torch.randn(B, 3)
    want = a.double().pow(2).sum(1) * g.double().pow(2).sum(1) + g.double().pow(2).sum(1)
    assert torch.equal(dg._linear_ghost_norm(layer, a, g), want)
    model = DLRM([f"f{i}" for i in range(F)], D, bottom_mlp=[16], top_mlp=[16], interaction="cat")
    pooled, dense, labels = batch()
    assert_agree(model, pooled, dense / V, labels, factors_for(), TOL[torch.float32])


# ---- broken twins: each check above can fail ---------------------------------------------------------------
def _fails(model, monkeypatch, registry, layer_type, wrong, seed=0, groups=None):
    """The agreement checks reject `wrong` registered for `layer_type` (the registry is restored
    by monkeypatch afterwards)."""
    monkeypatch.setitem(registry, layer_type, wrong)
    pooled, dense, labels = batch(seed, dtype=torch.float64)
    model = model.double()
    with pytest.raises(AssertionError):
        if groups is None:
            assert_agree(model, pooled, dense, labels, factors_for(), TOL[torch.float64])
        else:
            g, U = groups
            torch.testing.assert_close(GhostGradients(model, pooled, dense, labels).group_sq_norms(g, U),
                                       reference_group_sq_norms(model, pooled, dense, labels, g, U),
                                       rtol=1e-10, atol=1e-13)


def test_a_sum_of_per_position_norms_for_the_sequence_linear_is_caught(monkeypatch):
    """Σ_t ‖a_t‖²‖g_t‖² is the norm of the per-position gradients, not of their sum."""
    def per_position(layer, a, g):
        a = a.double().unsqueeze(1) if a.dim() == 2 else a.double().flatten(1, -2)
        g = g.double().unsqueeze(1) if g.dim() == 2 else g.double().flatten(1, -2)
        sq = (a.pow(2).sum(-1) * g.pow(2).sum(-1)).sum(1)
        return sq + g.pow(2).sum((1, 2)) if layer.bias is not None else sq

    _fails(build("seq-linear"), monkeypatch, dg._GHOST_NORMS, nn.Linear, per_position)
    # the same formula is right without a sequence dimension: the twin is wrong only where it should be
    layer, a, g = nn.Linear(4, 3), torch.randn(B, 1, 4), torch.randn(B, 1, 3)
    torch.testing.assert_close(per_position(layer, a, g), dg._linear_ghost_norm(layer, a, g))


def test_a_layer_norm_on_the_raw_input_is_caught(monkeypatch):
    def raw(layer, x, g):
        N = math.prod(layer.normalized_shape)
        gw = (g.double() * x.double()).reshape(x.shape[0], -1, N).sum(1)
        gb = g.double().reshape(x.shape[0], -1, N).sum(1)
        return gw.pow(2).sum(1) + (gb.pow(2).sum(1) if layer.bias is not None else 0)

    _fails(build("layer-norm"), monkeypatch, dg._GHOST_NORMS, nn.LayerNorm, raw)


def test_a_layer_norm_group_norm_as_a_sum_of_norms_is_caught(monkeypatch):
    def sum_of_norms(layer, x, g, layout):
        return layout.segment_sum(dg._layer_norm_ghost_norm(layer, x, g).unsqueeze(1)).squeeze(1)

    _fails(build("layer-norm"), monkeypatch, dg._GHOST_GROUP_NORMS, nn.LayerNorm, sum_of_norms,
           groups=GROUPINGS["uneven"])


def test_repeated_ids_not_merged_are_caught(monkeypatch):
    """Σ_t ‖g_t‖² treats every position as its own row; ids repeat within examples here."""
    def unmerged(layer, ids, g):
        ids, g = dg._embedding_rows(layer, ids, g)
        return g.double().pow(2).sum((1, 2))

    ids = batch()[1][:, :F].long()
    assert any(len(set(row.tolist())) < F for row in ids)
    _fails(build("embedding"), monkeypatch, dg._GHOST_NORMS, nn.Embedding, unmerged)


def test_an_embedding_sum_that_fills_the_padding_row_is_caught(monkeypatch):
    def fills_padding(layer, ids, g, factors):
        weighted = g * factors.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
        return {"weight": g.new_zeros(layer.weight.shape).index_add_(0, ids.flatten().long(),
                                                                      weighted.flatten(0, -2)).double()}

    _fails(build("embedding"), monkeypatch, dg._GHOST_SUMS, nn.Embedding, fills_padding)


def test_a_conv_sum_with_the_patch_layout_transposed_is_caught(monkeypatch):
    """Patches flattened kernel-major against a channel-major weight: the norms (invariant to
    the order of a weight's columns) still agree, the sum does not."""
    def transposed(layer, x, g, factors):
        a, g = dg._conv1d_as_linear(layer, x, g)
        C, k = layer.in_channels, layer.kernel_size[0]
        a = a.unflatten(-1, (C, k)).transpose(-1, -2).flatten(-2)
        weighted = g * factors.to(g.dtype)[:, None, None]
        out = {"weight": torch.einsum("bto,bti->oi", weighted, a).reshape(layer.weight.shape).double()}
        if layer.bias is not None:
            out["bias"] = weighted.sum((0, 1)).double()
        return out

    model = build("conv-k3-p1").double()
    pooled, dense, labels = batch(dtype=torch.float64)
    torch.testing.assert_close(GhostGradients(model, pooled, dense, labels).sq_norms,
                               PerExampleGradients(model, pooled, dense, labels).sq_norms, rtol=1e-10, atol=1e-13)
    _fails(model, monkeypatch, dg._GHOST_SUMS, nn.Conv1d, transposed)


def test_a_conv_norm_without_the_padding_is_caught(monkeypatch):
    def unpadded(layer, x, g):
        a = x.double().unfold(2, layer.kernel_size[0], 1).permute(0, 2, 1, 3).flatten(2)
        g = g.double().transpose(1, 2)[:, :a.shape[1]]
        return dg._sequence_weight_sq(a, g) + g.sum(1).pow(2).sum(1)

    _fails(build("conv-k3-p1"), monkeypatch, dg._GHOST_NORMS, nn.Conv1d, unpadded)


# ---- layer details -----------------------------------------------------------------------------------------
def test_the_padding_row_gets_no_gradient_and_a_repeated_id_counts_once():
    model = build("embedding").double()
    pooled, dense, labels = batch(dtype=torch.float64)
    ghost = GhostGradients(model, pooled, dense, labels)
    sums = ghost.clipped_sum(torch.ones(B, dtype=torch.float64))
    assert (sums["tokens.weight"][2] == 0).all() and (sums["tokens.weight"][[0, 1, 3, 4]] != 0).any(1).all()
    # one example, all of whose ids are one id: its gradient row is the sum of the positions' gradients
    layer = nn.Embedding(V, 3).double()
    g = torch.randn(1, 4, 3, dtype=torch.float64)
    got = dg._embedding_ghost_norm(layer, torch.full((1, 4), 1), g)
    torch.testing.assert_close(got, g.sum(1).pow(2).sum(1))


def test_layer_norm_without_affine_parameters_is_not_a_layer_to_measure():
    class Plain(SeqLinear):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(D, elementwise_affine=False)

        def forward(self, pooled, dense):
            return super().forward(self.ln(pooled), dense)

    model = Plain()
    assert model.ln not in dg._parameterized_layers(model)
    assert_agree(model, *batch(), factors_for(), TOL[torch.float32])


@pytest.mark.parametrize("config, named", [
    (dict(max_norm=1.0), "Embedding(max_norm)"),
    (dict(sparse=True), "Embedding(sparse)"),
    (dict(scale_grad_by_freq=True), "Embedding(scale_grad_by_freq)"),
])
def test_refused_embedding_configurations_name_themselves(config, named):
    class Refused(Embeds):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(V, D, **config)

    model = Refused()
    assert not dg.supports_ghost(model) and not dg.supports_ghost_groups(model)
    with pytest.raises(ValueError, match=r"no ghost norm registered for \['" + re.escape(named)):
        dense_gradients(model, *batch(), "ghost")


def test_a_grouped_conv_is_refused_and_auto_uses_the_reference():
    class Grouped(Convs):
        def __init__(self):
            super().__init__(kernel_size=3)
            self.conv, self.conv2 = nn.Conv1d(D, 6, kernel_size=3, groups=2), nn.Conv1d(6, 3, kernel_size=2)

    model = Grouped()
    with pytest.raises(ValueError, match=r"Conv1d\(groups=2\)"):
        dense_gradients(model, *batch(), "ghost")
    assert isinstance(dense_gradients(model, *batch()), PerExampleGradients)


# ---- what the ghost path cannot follow falls back -------------------------------------------------------
class WithAttention(_Binary):
    """nn.MultiheadAttention owns in_proj_weight itself and calls its out_proj (a
    NonDynamicallyQuantizableLinear) through F.multi_head_attention_forward, never through the
    out_proj's forward: no ghost norm is registered for either, so the reference runs."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(F * D, 1)

    def forward(self, pooled, dense):
        h, _ = self.att(pooled, pooled, pooled, need_weights=False)
        return self.head(h.flatten(1)).squeeze(-1)


class Tied(Embeds):
    """The token embedding's weight also scores the output (weight tying)."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(D, V, bias=False)
        self.score.weight = self.tokens.weight
        self.head = nn.Linear(F * V + 3, 1)

    def forward(self, pooled, dense):
        h = self.score(torch.tanh(self.tokens(dense[:, :F].long()) + pooled))
        return self.head(torch.cat([h.flatten(1), self.kind(dense[:, F].long())], 1)).squeeze(-1)


class Functional(SeqLinear):
    """Uses mix's weight through F.linear without calling mix."""

    def forward(self, pooled, dense):
        h = torch.tanh(self.proj(pooled)).unflatten(1, (2, F // 2))
        return self.head(torch.tanh(nn.functional.linear(h, self.mix.weight)).flatten(1)).squeeze(-1)


class AcrossTheBatch(SeqLinear):
    """Applies proj to [F, B, D]: dimension 0 is not the example."""

    def forward(self, pooled, dense):
        h = torch.tanh(self.proj(pooled.transpose(0, 1))).transpose(0, 1).unflatten(1, (2, F // 2))
        return self.head(torch.tanh(self.mix(h)).flatten(1)).squeeze(-1)


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    monkeypatch.setattr(dg, "_FALLBACKS_SAID", set())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    # another test's CLI run may have stopped the "widedp" logger propagating: listen on this one
    logger = logging.getLogger(LOGGER)
    names = LOGGER.split(".")
    blocked = any(not logging.getLogger(".".join(names[:i])).propagate for i in range(1, len(names) + 1))
    if blocked:
        logger.addHandler(caplog.handler)
    yield caplog
    if blocked:
        logger.removeHandler(caplog.handler)


def _said(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_multihead_attention_falls_back_to_the_reference_and_says_so_once(fresh_warnings):
    model = WithAttention()
    pooled, dense, labels = batch()
    for _ in range(3):
        grads = dense_gradients(model, pooled, dense, labels)
        assert isinstance(grads, PerExampleGradients)
    said = _said(fresh_warnings)
    assert len(said) == 1
    assert "WithAttention" in said[0] and "['MultiheadAttention', 'NonDynamicallyQuantizableLinear']" in said[0]
    # the reference is right for it: its norms are those of one backward per example
    groups = torch.arange(B)
    torch.testing.assert_close(grads.sq_norms, reference_group_sq_norms(model, pooled, dense, labels, groups, B),
                               rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="MultiheadAttention"):
        dense_gradients(model, pooled, dense, labels, "ghost")


def test_fallback_is_said_once_per_model_class_and_not_for_supported_models(fresh_warnings):
    for name in MODELS:
        dense_gradients(build(name), *batch())
        dense_gradients(build(name), *batch(), grouped=True)
    assert _said(fresh_warnings) == []
    for _ in range(2):
        dense_gradients(Tied(), *batch())
        dense_gradients(Functional(), *batch())
    said = _said(fresh_warnings)
    assert len(said) == 2
    assert "Tied" in said[0] and "Embedding(shared parameter)" in said[0] and "Linear(shared parameter)" in said[0]
    assert "Functional" in said[1] and "used without calling the module" in said[1]


def test_grouped_fallback_names_the_missing_group_norm(fresh_warnings, monkeypatch):
    monkeypatch.delitem(dg._GHOST_GROUP_NORMS, nn.LayerNorm)
    model = build("layer-norm")
    assert isinstance(dense_gradients(model, *batch()), GhostGradients)
    assert _said(fresh_warnings) == []
    for _ in range(2):
        assert isinstance(dense_gradients(model, *batch(), grouped=True), PerExampleGradients)
    said = _said(fresh_warnings)
    assert len(said) == 1 and "no ghost group norm for ['LayerNorm']" in said[0]


def test_tied_weights_fall_back_to_a_reference_that_counts_both_uses():
    model = Tied()
    pooled, dense, labels = batch()
    assert not dg.supports_ghost(model)
    grads = dense_gradients(model, pooled, dense, labels)
    assert isinstance(grads, PerExampleGradients)
    torch.testing.assert_close(grads.sq_norms, reference_group_sq_norms(model, pooled, dense, labels,
                                                                        torch.arange(B), B), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("cls, match", [
    (Functional, "Linear is used without calling the module"),
    (AcrossTheBatch, r"does not have the batch \(9\) as its first dimension"),
])
def test_forwards_the_captures_cannot_account_for_are_refused(cls, match):
    model = cls()
    assert dg.supports_ghost(model)  # only the forward shows it
    with pytest.raises(GhostUnsupported, match=match):
        dense_gradients(model, *batch(), "ghost")
    assert isinstance(dense_gradients(model, *batch()), PerExampleGradients)
