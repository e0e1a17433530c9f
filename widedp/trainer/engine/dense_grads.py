"""Per-example gradient norms and the clipped gradient sum of the dense part, two ways.

The step needs, for each example j of a batch: its loss ℓ_j, the gradient of ℓ_j with respect
to its pooled embeddings (the shards turn that into row gradients), the squared norm of ∇_θ ℓ_j
over the dense parameters θ (for the clip factor c_j = min(1, S1/‖g_j‖), docs/DESIGN.md §2),
and then Σ_j c_j ∇_θ ℓ_j. Neighbouring relation and sensitivity are the step's: each clipped
example contributes at most S1 in ℓ2 over embeddings and dense parameters together; nothing
here adds noise or changes what one example can contribute.

- `PerExampleGradients` (the reference): torch.func `vmap(grad)` materializes every ∇_θ ℓ_j
  ([B, *θ.shape] per parameter); the clipped sum is Σ_j c_j ∇_θ ℓ_j by a contraction.
- `GhostGradients` (the fast path, the two passes of Opacus's ghost clipping; Li et al. 2022,
  "Large language models can be strong differentially private learners", §4): pass 1, one
  ordinary forward and backward, gives ℓ_j, ∂ℓ_j/∂pooled_j and, for every layer, its input
  activations a_j and output gradients g_j = ∂ℓ_j/∂out_j; a registered *ghost norm* turns
  those into ‖∇_θ ℓ_j‖² for the layer's parameters without forming the per-example gradient
  (for nn.Linear: ‖g_j a_jᵀ‖_F² = ‖a_j‖²‖g_j‖² when the input has no sequence dimension).
  Pass 2 needs no second backward when every such layer also has a registered *ghost sum*
  (the book-keeping of Bu et al. 2023, "Differentially private optimization on large model at
  small cost", §3): from the same a_j, g_j, Σ_j c_j ∇_W ℓ_j = Σ_j c_j g_j a_jᵀ = Gᵀ diag(c) A
  for nn.Linear, one matmul per layer; otherwise pass 2 is one backward of Σ_j c_j ℓ_j through
  the graph kept from pass 1. Either way it is Σ_j c_j ∇_θ ℓ_j, and nothing of size B × |θ| is
  formed except where it is the cheaper way to a norm: a sequence Linear's [B, out, in] when
  its Gram matrices would cost more, and LayerNorm's per-example gradients (one position's size).

Registered (ghost norm, ghost sum and ghost group norm each; t runs over the positions between
the batch dimension and the features, flattened):
- nn.Linear, input [B, in] or [B, ..., in]: ∇_W ℓ_j = Σ_t g_jt a_jtᵀ, by the Gram form
  Σ_{t,s} (a_jt·a_js)(g_jt·g_js) or by forming [B, out, in], whichever is cheaper per call
  (`linear_norm_uses_gram`); ∇_b ℓ_j = Σ_t g_jt.
- nn.LayerNorm with affine parameters (bias or not): ∇_weight ℓ_j = Σ_t g_jt ⊙ x̂_jt with x̂ the
  normalized input recomputed from the captured one, ∇_bias ℓ_j = Σ_t g_jt (both [B, N], formed).
- nn.Embedding inside the dense part, ids [B] or [B, ...]: row v of ∇_W ℓ_j is Σ_{t: id_jt = v}
  g_jt, so ‖∇_W ℓ_j‖² = Σ_{t,s: id_jt = id_js} g_jt·g_js (positions keyed by (example, id) and
  summed before squaring); padding_idx gets no gradient; max_norm, sparse and
  scale_grad_by_freq are refused (`ghost_refusal`).
- nn.Conv1d with groups=1 (any stride, padding, 'same', dilation, padding_mode): the Linear over
  the unfolded input patches [B, L_out, C_in·k].
Lookups are by exact type, so a subclass of a registered type is not registered.
nn.MultiheadAttention is not supported: it owns its in-projection and applies its out_proj's
parameters (a NonDynamicallyQuantizableLinear, an nn.Linear subclass, not called as a module)
inside F.multi_head_attention_forward, where no hook sees the activations; a model with one uses
the reference (attention written with nn.Linear q/k/v/out projections takes the ghost path, as does
trainer/private/layers.py's LinearMultiheadAttention, which replace_multihead_attention swaps in). So does a model with a
parameter owned by two modules (tied weights); a forward that calls a layer twice, changes a
captured tensor in place, uses a layer's parameter without calling the layer, or applies a
layer to a tensor whose dimension 0 is not the batch is refused by `GhostGradients`
(`GhostUnsupported`). What is not detected: a called layer's parameter used a second time
outside its module (its ghost norm sees only the module's own use).

User-level privacy: `group_sq_norms(groups, num_groups)` (before `clipped_sum`) gives, for each
group u, ‖Σ_{j: groups_j = u} ∇_θ ℓ_j‖², the squared norm of the *sum* of the group's
per-example gradients (not the sum of their norms). With groups = users the neighbouring
relation is per user (data sets differ in all examples of one user) and so is the sensitivity
statement: the step adds this to the user's squared embedding-gradient norm, clips the user's
sum with c_u = min(1, S1/‖Σ_{j∈u} ∇ℓ_j‖), and passes c_{u(j)} to every example j of u, so that
`clipped_sum` gives Σ_u c_u Σ_{j∈u} ∇_θ ℓ_j: each clipped user's sum contributes at most S1.
The reference segment-sums the materialized per-example gradients; the ghost path generalizes
the Gram identity within a group (a registered *ghost group norm* per layer type; for nn.Linear
`_linear_ghost_group_norm`) over grids of groups of one size class each, padded to the class's
largest (`group_layouts`): no Python loop runs over groups, only over ≤ log2(B) + 1 classes.

Both rely on the model treating examples independently (`DenseModel`'s contract: no batch
statistics), so ∂(Σ_k ℓ_k)/∂x_j = ∂ℓ_j/∂x_j for every per-example tensor x. `dense_gradients`
picks the ghost path when every module that owns parameters has a registered ghost norm (and,
with `grouped=True`, a ghost group norm) that accepts its configuration, and the reference
otherwise, saying so by one logging warning per model class and reason; tests hold the two to
agreement on every model here (tests/test_dense_grads.py, test_dense_group_norms.py,
test_ghost_layers.py).
"""

from __future__ import annotations

import abc
import logging
import math
import operator
from typing import Callable, Optional

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from widedp.trainer.models.base import DenseModel

# ---- ghost norms: per-example squared gradient norms of one layer's own parameters ---------------
GhostNorm = Callable[..., torch.Tensor]  # (layer, activations, output gradients) -> [B]
_GHOST_NORMS: dict[type, GhostNorm] = {}


def register_ghost_norm(*layer_types: type) -> Callable[[GhostNorm], GhostNorm]:
    """Register `fn(layer, activations, backprops) -> [B]` squared norms of the per-example
    gradients of `layer`'s own parameters (recurse=False). Refuses to overwrite a registration:
    two ghost norms for one layer type would make the choice depend on import order."""

    def decorator(fn: GhostNorm) -> GhostNorm:
        for t in layer_types:
            if t in _GHOST_NORMS:
                raise ValueError(f"a ghost norm for {t.__name__} is already registered "
                                 f"({_GHOST_NORMS[t].__qualname__})")
            _GHOST_NORMS[t] = fn
        return fn

    return decorator


def ghost_norm_for(layer: nn.Module):
    """The registered ghost norm of `layer`'s exact type, or None."""
    return _GHOST_NORMS.get(type(layer))


def linear_norm_uses_gram(positions: int, in_features: int, out_features: int) -> bool:
    """Whether the Gram form is the cheaper way to one example's squared weight-gradient norm
    of an nn.Linear over `positions` sequence positions, counting multiply-adds: the two T × T
    Gram matrices and their inner product cost T²·(in + out + 1); forming Σ_t g_t a_tᵀ
    [out, in] and its squared norm costs (T + 1)·in·out (the trade-off of mixed ghost clipping,
    Bu et al. 2022; `linear_group_uses_gram` is the same count for a group's rows)."""
    return positions * positions * (in_features + out_features + 1) <= (positions + 1) * in_features * out_features


def _sequence_weight_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """[B] ‖Σ_t g_bt a_btᵀ‖_F² for a [B, T, in], g [B, T, out] (float64): by the Gram form
    Σ_{t,s} (a_t·a_s)(g_t·g_s) or by forming the [B, out, in] gradient, whichever
    `linear_norm_uses_gram` says is cheaper."""
    if linear_norm_uses_gram(a.shape[1], a.shape[2], g.shape[2]):
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))


@register_ghost_norm(nn.Linear)
def _linear_ghost_norm(layer: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """∇_W ℓ_j = Σ_t g_jt a_jtᵀ, ∇_b ℓ_j = Σ_t g_jt (t over the positions of any dimensions
    between the batch and the features, flattened). Without them: ‖∇_W‖² = ‖a_j‖²‖g_j‖². With
    them: ‖Σ_t g_t a_tᵀ‖_F² = Σ_{t,s} (a_t·a_s)(g_t·g_s), i.e. ⟨A Aᵀ, G Gᵀ⟩ over the T × T Gram
    matrices (Li et al. 2022, eq. 4), or the norm of the formed [out, in] gradient when that is
    cheaper (`linear_norm_uses_gram`); ‖∇_b‖² = ‖Σ_t g_t‖²."""
    a, g = a.double(), g.double()
    if a.dim() == 2:
        sq = a.pow(2).sum(1) * g.pow(2).sum(1)
        bias_grad = g
    else:
        a, g = a.flatten(1, -2), g.flatten(1, -2)  # [B, T, in], [B, T, out]
        sq = _sequence_weight_sq(a, g)
        bias_grad = g.sum(1)
    if layer.bias is not None:
        sq = sq + bias_grad.pow(2).sum(1)
    return sq


# ---- ghost sums: Σ_j c_j ∇ℓ_j of one layer's own parameters from pass 1's captures ---------------
GhostSum = Callable[..., dict]  # (layer, activations, output gradients, factors [B]) -> {name: tensor}
_GHOST_SUMS: dict[type, GhostSum] = {}


def register_ghost_sum(*layer_types: type) -> Callable[[GhostSum], GhostSum]:
    """Register `fn(layer, activations, backprops, factors) -> {parameter name (recurse=False):
    Σ_j factors_j ∇ℓ_j, float64}`. Refuses to overwrite a registration, like the ghost norms."""

    def decorator(fn: GhostSum) -> GhostSum:
        for t in layer_types:
            if t in _GHOST_SUMS:
                raise ValueError(f"a ghost sum for {t.__name__} is already registered ({_GHOST_SUMS[t].__qualname__})")
            _GHOST_SUMS[t] = fn
        return fn

    return decorator


@register_ghost_sum(nn.Linear)
def _linear_ghost_sum(layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, factors: torch.Tensor) -> dict:
    """Σ_j c_j Σ_t g_jt a_jtᵀ and Σ_j c_j Σ_t g_jt (t over a sequence dimension, if any), in
    the activations' precision (as the backward it replaces), returned as float64."""
    c = factors.to(a.dtype)
    if a.dim() > 2:
        a, g = a.flatten(1, -2), g.flatten(1, -2)  # [B, T, in], [B, T, out]
        weighted = g * c[:, None, None]
        out = {"weight": torch.einsum("bto,bti->oi", weighted, a).double()}
        bias = weighted.sum((0, 1))
    else:
        weighted = g * c[:, None]
        out = {"weight": (weighted.T @ a).double()}
        bias = weighted.sum(0)
    if layer.bias is not None:
        out["bias"] = bias.double()
    return out


# ---- ghost group norms: ‖Σ_{j∈u} ∇ℓ_j‖² per group u of one layer's own parameters -----------------
def check_groups(groups, num_groups, batch_size: int) -> tuple[torch.Tensor, int]:
    """`groups` as an int64 tensor [batch_size] with values in [0, num_groups), and num_groups as
    an int >= 0; anything else is a ValueError that says what is wrong."""
    if isinstance(num_groups, bool):
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    try:
        num_groups = operator.index(num_groups)
    except TypeError:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}") from None
    if num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups}")
    if not isinstance(groups, torch.Tensor):
        groups = torch.as_tensor(groups)
    if groups.dtype == torch.bool or groups.dtype.is_floating_point or groups.dtype.is_complex:
        raise ValueError(f"groups must be an integer (int64) tensor, got dtype {groups.dtype}")
    if tuple(groups.shape) != (batch_size,):
        raise ValueError(f"groups must have shape [B] = [{batch_size}] (one group per example), "
                         f"got {list(groups.shape)}")
    groups = groups.to(torch.int64)
    if batch_size:
        low, high = int(groups.min()), int(groups.max())
        if low < 0 or high >= num_groups:
            bad = low if low < 0 else high
            raise ValueError(f"groups must lie in [0, num_groups) = [0, {num_groups}), got {bad}")
    return groups, num_groups


class GroupLayout:
    """Some groups' examples in a grid [num_groups, max_size] (num_groups = len(group_ids), the
    groups this grid holds): row r holds group group_ids[r]'s examples in batch order from the
    left, then padding. `pad(x)` puts rows of a per-example tensor x [B, ...] (the whole batch's)
    into the grid with zeros in the padding, so a sum over a group is a sum over a grid row and
    padding adds nothing to it, nor to any Gram entry (a zero row is orthogonal to every row).
    Shared by every layer's ghost group norm; `group_layouts` makes them."""

    def __init__(self, groups: torch.Tensor, num_groups: int, group_ids: torch.Tensor):
        self.group_ids, self.num_groups = group_ids, int(group_ids.numel())
        row_of = torch.full((num_groups,), -1, dtype=torch.int64, device=groups.device)
        row_of[group_ids] = torch.arange(self.num_groups, device=groups.device)
        rows = row_of[groups]
        self._examples = (rows >= 0).nonzero().flatten()  # this grid's examples, in batch order
        self._rows = rows[self._examples]
        order = torch.argsort(self._rows, stable=True)
        self._source = self._examples[order]  # by row, then batch order
        sorted_rows = self._rows[order]
        sizes = torch.bincount(self._rows, minlength=self.num_groups)
        self.max_size = int(sizes.max()) if self._rows.numel() else 0
        rank = torch.arange(order.numel(), device=groups.device) - (torch.cumsum(sizes, 0) - sizes)[sorted_rows]
        self._slots = (sorted_rows, rank)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, *rest] -> [num_groups, max_size, *rest], zeros in the padding."""
        out = x.new_zeros(self.num_groups, self.max_size, *x.shape[1:])
        out[self._slots] = x[self._source]
        return out

    def segment_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, *rest] -> [num_groups, *rest]: Σ_{j∈u} x_j for each group u of the grid."""
        return x.new_zeros(self.num_groups, *x.shape[1:]).index_add_(0, self._rows, x[self._examples])


def group_layouts(groups: torch.Tensor, num_groups: int) -> list[GroupLayout]:
    """The non-empty groups by size class, one grid per class: sizes in (2^(k-1), 2^k] for
    k = 0, 1, 2, ... A grid pads its groups to its largest, under twice any of theirs, so all
    grids together hold fewer than 2B example slots however uneven the sizes (one grid padded to
    the largest group would hold num_groups × max size), at ≤ log2(B) + 1 grids. Empty groups are
    in none (their norm is 0)."""
    sizes = torch.bincount(groups, minlength=num_groups)
    present = sizes.nonzero().flatten()
    size_class = torch.ceil(torch.log2(sizes[present].double())).long()  # exact at powers of two
    return [GroupLayout(groups, num_groups, present[size_class == k]) for k in torch.unique(size_class).tolist()]


GhostGroupNorm = Callable[..., torch.Tensor]  # (layer, activations, output gradients, layout) -> [layout.num_groups]
_GHOST_GROUP_NORMS: dict[type, GhostGroupNorm] = {}


def register_ghost_group_norm(*layer_types: type) -> Callable[[GhostGroupNorm], GhostGroupNorm]:
    """Register `fn(layer, activations, backprops, layout: GroupLayout) -> [layout.num_groups]`
    float64: for each group u of the grid, ‖Σ_{j∈u} ∇ℓ_j‖² over `layer`'s own parameters
    (recurse=False); activations and backprops are the whole batch's. Refuses to
    overwrite a registration, like the ghost norms."""

    def decorator(fn: GhostGroupNorm) -> GhostGroupNorm:
        for t in layer_types:
            if t in _GHOST_GROUP_NORMS:
                raise ValueError(f"a ghost group norm for {t.__name__} is already registered "
                                 f"({_GHOST_GROUP_NORMS[t].__qualname__})")
            _GHOST_GROUP_NORMS[t] = fn
        return fn

    return decorator


def ghost_group_norm_for(layer: nn.Module):
    """The registered ghost group norm of `layer`'s exact type, or None."""
    return _GHOST_GROUP_NORMS.get(type(layer))


def linear_group_uses_gram(rows: int, in_features: int, out_features: int) -> bool:
    """Whether the Gram form is the cheaper way to an nn.Linear's group norms, counting
    multiply-adds per group of `rows` = (the grid's largest group) × (sequence positions) rows:
    the two Gram matrices and their inner product cost rows²·(in + out + 1); forming the group's
    weight gradient Σ g aᵀ [out, in] and its squared norm costs (rows + 1)·in·out. Both scale
    with the number of groups alike, so that drops out. (The per-layer choice of mixed ghost
    clipping, Bu et al. 2022, ghost norm iff 2T² < in·out, is the same trade-off for one example.)"""
    return rows * rows * (in_features + out_features + 1) <= (rows + 1) * in_features * out_features


@register_ghost_group_norm(nn.Linear)
def _linear_ghost_group_norm(layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """Group u's weight gradient is Σ_{j∈u} Σ_t g_jt a_jtᵀ (t over a sequence dimension, if any;
    none is T = 1): the group's positions together are one sequence of |u|·T rows, so
    ‖·‖_F² = Σ_{(j,t),(k,s)} (a_jt·a_ks)(g_jt·g_ks) = ⟨A_u A_uᵀ, G_u G_uᵀ⟩ (Li et al. 2022, eq. 4,
    over the group's rows), or, when `linear_group_uses_gram` says that is dearer, the norm of
    G_uᵀ A_u formed outright. The bias gradient is Σ_{j∈u} Σ_t g_jt."""
    a = a.unsqueeze(1) if a.dim() == 2 else a.flatten(1, -2)  # [B, T, in]
    g = g.unsqueeze(1) if g.dim() == 2 else g.flatten(1, -2)  # [B, T, out]
    return _sequence_group_sq(a, g, layout, layer.bias is not None)


def _sequence_group_sq(a: torch.Tensor, g: torch.Tensor, layout: GroupLayout, bias: bool) -> torch.Tensor:
    """[layout.num_groups] float64 ‖Σ_{j∈u} Σ_t g_jt a_jtᵀ‖_F² (+ ‖Σ_{j∈u} Σ_t g_jt‖² with `bias`)
    for a [B, T, in], g [B, T, out]: `_linear_ghost_group_norm`'s computation."""
    rows = layout.max_size * a.shape[1]
    A = layout.pad(a).double().reshape(layout.num_groups, rows, a.shape[-1])  # [U, m·T, in]
    G = layout.pad(g).double().reshape(layout.num_groups, rows, g.shape[-1])  # [U, m·T, out]
    if linear_group_uses_gram(rows, a.shape[-1], g.shape[-1]):
        sq = (torch.bmm(A, A.transpose(1, 2)) * torch.bmm(G, G.transpose(1, 2))).sum((1, 2))
    else:
        sq = torch.bmm(G.transpose(1, 2), A).pow(2).sum((1, 2))
    if bias:
        sq = sq + G.sum(1).pow(2).sum(1)  # padding rows are zero
    return sq


# ---- per-layer refusals: a registered layer type whose configuration the ghost path cannot follow -----
GhostRefusal = Callable[[nn.Module], Optional[str]]  # layer -> None, or what in its configuration is refused
_GHOST_REFUSALS: dict[type, GhostRefusal] = {}


def ghost_refusal(layer: nn.Module) -> Optional[str]:
    """Why the ghost path refuses `layer` although its type is registered (e.g. an nn.Embedding
    with max_norm), or None."""
    check = _GHOST_REFUSALS.get(type(layer))
    return check(layer) if check is not None else None


# ---- nn.LayerNorm ------------------------------------------------------------------------------------
def _layer_norm_example_grads(layer: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor):
    """Per-example (∇_weight ℓ_j, ∇_bias ℓ_j), each [B, N] float64 (N = the normalized_shape's
    size): Σ_t g_jt ⊙ x̂_jt and Σ_t g_jt, t over the positions before the normalized dimensions,
    x̂ the normalized input recomputed from the captured one with the layer's eps (the bias
    entry is None without a bias). Cheap to form: one position's size per example."""
    shape = tuple(layer.normalized_shape)
    x_hat = nn.functional.layer_norm(x.detach(), shape, None, None, layer.eps)
    B, N = x.shape[0], math.prod(shape)
    T = math.prod(x.shape[1:x.dim() - len(shape)])
    g = g.double().reshape(B, T, N)
    weight = (g * x_hat.double().reshape(B, T, N)).sum(1) if layer.weight is not None else None
    bias = g.sum(1) if layer.bias is not None else None
    return weight, bias


@register_ghost_norm(nn.LayerNorm)
def _layer_norm_ghost_norm(layer: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """‖Σ_t g_t ⊙ x̂_t‖² + ‖Σ_t g_t‖² per example (`_layer_norm_example_grads`)."""
    return sum((p.pow(2).sum(1) for p in _layer_norm_example_grads(layer, x, g) if p is not None),
               torch.zeros(x.shape[0], dtype=torch.float64, device=x.device))


@register_ghost_sum(nn.LayerNorm)
def _layer_norm_ghost_sum(layer: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor, factors: torch.Tensor) -> dict:
    """Σ_j c_j Σ_t g_jt ⊙ x̂_jt and Σ_j c_j Σ_t g_jt, shaped as the parameters, float64."""
    weight, bias = _layer_norm_example_grads(layer, x, g)
    c = factors.to(device=x.device, dtype=torch.float64)
    out = {}
    if weight is not None:
        out["weight"] = (c @ weight).reshape(layer.normalized_shape)
    if bias is not None:
        out["bias"] = (c @ bias).reshape(layer.normalized_shape)
    return out


@register_ghost_group_norm(nn.LayerNorm)
def _layer_norm_ghost_group_norm(layer: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor,
                                 layout: GroupLayout) -> torch.Tensor:
    """‖Σ_{j∈u} Σ_t g_jt ⊙ x̂_jt‖² + ‖Σ_{j∈u} Σ_t g_jt‖² per group u of the grid."""
    return sum((layout.segment_sum(p).pow(2).sum(1) for p in _layer_norm_example_grads(layer, x, g) if p is not None),
               torch.zeros(layout.num_groups, dtype=torch.float64, device=x.device))


# ---- nn.Embedding inside the dense part ------------------------------------------------------------
def _embedding_refusal(layer: nn.Module) -> Optional[str]:
    assert isinstance(layer, nn.Embedding)
    refused = [name for name, on in (("max_norm", layer.max_norm is not None), ("sparse", layer.sparse),
                                     ("scale_grad_by_freq", layer.scale_grad_by_freq)) if on]
    return ", ".join(refused) or None


_GHOST_REFUSALS[nn.Embedding] = _embedding_refusal


def _embedding_rows(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor):
    """(ids [B, T] int64, g [B, T, D]) from the captured ids [B, ...] and output gradients
    [B, ..., D], with the gradient of every padding_idx position zeroed (its row gets none)."""
    B = ids.shape[0]
    T = math.prod(ids.shape[1:])
    ids = ids.reshape(B, T).long()
    g = g.reshape(B, T, g.shape[-1])
    if layer.padding_idx is not None:
        g = g * (ids != layer.padding_idx).unsqueeze(-1).to(g.dtype)
    return ids, g


def _embedding_keyed_sq(keys: torch.Tensor, owner: torch.Tensor, g: torch.Tensor, size: int) -> torch.Tensor:
    """[size] float64: Σ over distinct keys k of owner o, ‖Σ_{positions with key k} g‖², added
    into entry o. keys, owner [P] int64 (one owner per key), g [P, D]."""
    out = torch.zeros(size, dtype=torch.float64, device=g.device)
    if not keys.numel():
        return out
    unique, inverse = torch.unique(keys, return_inverse=True)
    summed = g.new_zeros(unique.numel(), g.shape[-1], dtype=torch.float64).index_add_(0, inverse, g.double())
    first = torch.zeros(unique.numel(), dtype=torch.int64, device=g.device).scatter_(0, inverse, owner)
    return out.index_add_(0, first, summed.pow(2).sum(1))


@register_ghost_norm(nn.Embedding)
def _embedding_ghost_norm(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """∇_W ℓ_j has row v = Σ_{t: id_jt = v} g_jt (zero for padding_idx), so
    ‖∇_W ℓ_j‖² = Σ_{t,s: id_jt = id_js} g_jt·g_js: positions that repeat an id are summed before
    squaring (an id repeated within an example counts once, with its summed gradient)."""
    ids, g = _embedding_rows(layer, ids, g)
    B, T = ids.shape
    owner = torch.arange(B, device=ids.device).repeat_interleave(T)
    return _embedding_keyed_sq(owner * layer.num_embeddings + ids.flatten(), owner, g.flatten(0, 1), B)


@register_ghost_sum(nn.Embedding)
def _embedding_ghost_sum(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor, factors: torch.Tensor) -> dict:
    """Σ_j c_j ∇_W ℓ_j: each position's c_j g_jt added into row id_jt (index_add), padding_idx's
    row left zero; in the gradients' precision, returned as float64."""
    ids, g = _embedding_rows(layer, ids, g)
    weighted = (g * factors.to(device=g.device, dtype=g.dtype)[:, None, None]).flatten(0, 1)
    weight = g.new_zeros(layer.weight.shape).index_add_(0, ids.flatten(), weighted)
    return {"weight": weight.double()}


@register_ghost_group_norm(nn.Embedding)
def _embedding_ghost_group_norm(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor,
                                layout: GroupLayout) -> torch.Tensor:
    """Group u's gradient has row v = Σ_{j∈u} Σ_{t: id_jt = v} g_jt: the group's positions keyed
    by (group, id), summed per key, squared (no padding grid needed)."""
    ids, g = _embedding_rows(layer, ids, g)
    examples, rows = layout._examples, layout._rows  # this grid's examples and their grid rows
    T = ids.shape[1]
    owner = rows.repeat_interleave(T)
    keys = owner * layer.num_embeddings + ids[examples].flatten()
    return _embedding_keyed_sq(keys, owner, g[examples].flatten(0, 1), layout.num_groups)


# ---- nn.Conv1d: a Linear over the input's patches ------------------------------------------------------
def _conv1d_refusal(layer: nn.Module) -> Optional[str]:
    assert isinstance(layer, nn.Conv1d)
    return f"groups={layer.groups}" if layer.groups != 1 else None


_GHOST_REFUSALS[nn.Conv1d] = _conv1d_refusal


def _conv1d_as_linear(layer: nn.Conv1d, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches [B, L_out, C_in·k], output gradients [B, L_out, C_out]): the conv is the Linear
    patches @ W.reshape(C_out, C_in·k)ᵀ + b at each output position, so its per-example
    gradients are those of a Linear over the L_out positions. Padding as the layer's forward
    pads (zeros, or its padding_mode; padding='same' split as torch splits it)."""
    if x.dim() != 3:
        raise GhostUnsupported(f"Conv1d without a batch dimension (input of shape {list(x.shape)})")
    (k,), (stride,), (dilation,) = layer.kernel_size, layer.stride, layer.dilation
    if isinstance(layer.padding, str):
        total = dilation * (k - 1) if layer.padding == "same" else 0
        pads = (total // 2, total - total // 2)
    else:
        pads = (layer.padding[0], layer.padding[0])
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    x = nn.functional.pad(x, pads, mode=mode) if any(pads) else x
    span = dilation * (k - 1) + 1
    patches = x.unfold(2, span, stride)[..., ::dilation]  # [B, C_in, L_out, k]
    patches = patches.permute(0, 2, 1, 3).flatten(2)  # [B, L_out, C_in·k], as W.flatten(1)
    return patches, g.transpose(1, 2)


@register_ghost_norm(nn.Conv1d)
def _conv1d_ghost_norm(layer: nn.Conv1d, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`_linear_ghost_norm` of the Linear over the input's patches (`_conv1d_as_linear`)."""
    a, g = (t.double() for t in _conv1d_as_linear(layer, x, g))
    sq = _sequence_weight_sq(a, g)
    if layer.bias is not None:
        sq = sq + g.sum(1).pow(2).sum(1)
    return sq


@register_ghost_sum(nn.Conv1d)
def _conv1d_ghost_sum(layer: nn.Conv1d, x: torch.Tensor, g: torch.Tensor, factors: torch.Tensor) -> dict:
    """Σ_j c_j Σ_t g_jt p_jtᵀ over the patches p, reshaped to [C_out, C_in, k]; Σ_j c_j Σ_t g_jt."""
    a, g = _conv1d_as_linear(layer, x, g)
    weighted = g * factors.to(device=g.device, dtype=g.dtype)[:, None, None]
    out = {"weight": torch.einsum("bto,bti->oi", weighted, a).reshape(layer.weight.shape).double()}
    if layer.bias is not None:
        out["bias"] = weighted.sum((0, 1)).double()
    return out


@register_ghost_group_norm(nn.Conv1d)
def _conv1d_ghost_group_norm(layer: nn.Conv1d, x: torch.Tensor, g: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """`_linear_ghost_group_norm` of the Linear over the input's patches."""
    a, g = _conv1d_as_linear(layer, x, g)
    return _sequence_group_sq(a, g, layout, layer.bias is not None)


# ---- the two implementations -----------------------------------------------------------------------
class DenseGradients(abc.ABC):
    """Pass 1 at construction; `group_sq_norms` (any number of times) comes before
    `clipped_sum(factors)`, which is pass 2 (once)."""

    losses: torch.Tensor  # [B]
    pooled_grads: torch.Tensor  # [B, F, D]: ∂ℓ_j/∂pooled_j
    sq_norms: torch.Tensor  # [B] float64: ‖∇_θ ℓ_j‖² over every dense parameter
    _used: bool = False  # pass 2 has run

    def group_sq_norms(self, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
        """[num_groups] float64: for each group u, ‖Σ_{j: groups_j = u} ∇_θ ℓ_j‖² over every dense
        parameter: the squared norm of the sum of the group's gradients, not the sum of their
        squared norms (0 for an empty group; `sq_norms` when every group has one example).
        `groups`: integer tensor [B], values in [0, num_groups). Only before `clipped_sum`."""
        if self._used:
            raise RuntimeError(f"{type(self).__name__}.group_sq_norms must come before clipped_sum "
                               "(pass 2 may free the activations and gradients it needs)")
        groups, num_groups = check_groups(groups, num_groups, int(self.losses.shape[0]))
        return self._group_sq_norms(groups, num_groups)

    def _group_sq_norms(self, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no group norms")

    @abc.abstractmethod
    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: Σ_j factors_j ∇_θ ℓ_j} (float64) for every named parameter of the model."""

    def clamped_sum(self, factors: torch.Tensor, bound: float) -> dict[str, torch.Tensor]:
        """{name: Σ_j clamp(factors_j ∇_θ ℓ_j, ±bound)}: ModelMix's refined clipping (seed B
        Alg 2) needs every per-example coordinate, so only the per-example reference has it."""
        raise NotImplementedError(f"{type(self).__name__} has no per-example coordinates (use per_example)")


class PerExampleGradients(DenseGradients):
    """The reference: per-example gradients by torch.func, then contractions."""

    def __init__(self, model: DenseModel, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor):
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}

        def loss_one(params, pooled_j, dense_j, label_j):
            out = functional_call(model, (params, buffers), (pooled_j.unsqueeze(0), dense_j.unsqueeze(0)))
            return model.loss(out, label_j.unsqueeze(0)).sum()

        (g_params, g_pooled), losses = vmap(grad_and_value(loss_one, argnums=(0, 1)), in_dims=(None, 0, 0, 0))(
            params, pooled, dense, labels)
        self.losses, self.pooled_grads, self.per_example = losses.detach(), g_pooled.detach(), g_params
        B = pooled.shape[0]
        self.sq_norms = sum((g.reshape(B, -1).double().pow(2).sum(1) for g in g_params.values()),
                            torch.zeros(B, dtype=torch.float64))

    def _group_sq_norms(self, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
        """Segment-sum each parameter's per-example gradients by group, then square and add."""
        out = torch.zeros(num_groups, dtype=torch.float64)
        for g in self.per_example.values():
            g = g.double()
            sq = g.new_zeros(num_groups, *g.shape[1:]).index_add_(0, groups.to(g.device), g).pow(2)
            out = out + (sq.flatten(1).sum(1) if sq.dim() > 1 else sq).cpu()
        return out

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        self._used = True  # nothing is freed here, but the contract is the ghost path's
        return {n: torch.tensordot(factors.to(g.dtype), g, dims=1).double() for n, g in self.per_example.items()}

    def clamped_sum(self, factors: torch.Tensor, bound: float) -> dict[str, torch.Tensor]:
        self._used = True
        out = {}
        for n, g in self.per_example.items():
            scaled = g.double() * factors.double().reshape(-1, *([1] * (g.dim() - 1)))
            out[n] = scaled.clamp(-bound, bound).sum(0)
        return out


class GhostGradients(DenseGradients):
    """The ghost-norm fast path (module docstring). Needs `supports_ghost(model)`."""

    def __init__(self, model: DenseModel, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor):
        self.model = model
        layers = _parameterized_layers(model)
        captured: list[tuple[nn.Module, torch.Tensor, torch.Tensor, tuple[int, int]]] = []

        def capture(layer, inputs, output):
            captured.append((layer, inputs[0], output, (inputs[0]._version, output._version)))

        self._book_keeping = all(type(layer) in _GHOST_SUMS for layer in layers)
        handles = [layer.register_forward_hook(capture) for layer in layers]
        B = pooled.shape[0]
        try:
            with torch.enable_grad():
                pooled_leaf = pooled.detach().requires_grad_(True)
                self._losses: Optional[torch.Tensor] = model.loss(model(pooled_leaf, dense), labels)
                _check_captures(captured, B)
                outputs = [out for _, _, out, _ in captured]
                # The parameters of a layer that was not called must get no gradient: one used
                # without its module's forward (F.linear(x, layer.weight)) has no captures.
                called = {id(layer) for layer, _, _, _ in captured}
                uncalled = [(layer, p) for layer in layers if id(layer) not in called
                            for p in layer.parameters(recurse=False) if p.requires_grad]
                grads = torch.autograd.grad(self._losses.sum(), [pooled_leaf, *outputs, *(p for _, p in uncalled)],
                                            retain_graph=not self._book_keeping, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for (layer, _), g in zip(uncalled, grads[1 + len(outputs):]):
            if g is not None:
                raise GhostUnsupported(f"a parameter of a {type(layer).__name__} is used without calling "
                                       "the module (its forward hook sees nothing)")
        self.losses = self._losses.detach()
        self.pooled_grads = grads[0] if grads[0] is not None else torch.zeros_like(pooled)
        sq = torch.zeros(B, dtype=torch.float64)
        self._captures = []  # (layer, a, g) for the ghost sums
        for (layer, a, _, _), g in zip(captured, grads[1:1 + len(outputs)]):
            if g is not None:  # an output that does not reach the loss has zero gradient
                sq = sq + _GHOST_NORMS[type(layer)](layer, a.detach(), g.detach())
                self._captures.append((layer, a.detach(), g.detach()))
        self.sq_norms = sq
        if self._book_keeping:
            self._losses = None  # no second backward: the graph can go now
        self._used = False

    def _group_sq_norms(self, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
        """The registered ghost group norm of every captured layer, added up (module docstring)."""
        missing = _unsupported_layers(self.model, grouped=True)
        if missing:
            raise ValueError(f"no ghost group norm registered for {missing} "
                             "(trainer.engine.dense_grads.register_ghost_group_norm; or use the per_example method)")
        sq = torch.zeros(num_groups, dtype=torch.float64)
        if self._captures:
            for layout in group_layouts(groups.to(self._captures[0][1].device), num_groups):
                part = sum(_GHOST_GROUP_NORMS[type(layer)](layer, a, g, layout) for layer, a, g in self._captures)
                sq[layout.group_ids.cpu()] = torch.as_tensor(part, dtype=torch.float64).cpu()
        return sq

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._used:
            raise RuntimeError("GhostGradients.clipped_sum runs once (it frees pass 1's graph)")
        self._used = True
        named = [(n, p) for n, p in self.model.named_parameters()]
        trainable = [(n, p) for n, p in named if p.requires_grad and p.numel()]
        sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in named}
        if self._book_keeping:
            prefix = {id(m): (name + "." if name else "") for name, m in self.model.named_modules()}
            wanted = {n for n, _ in trainable}
            for layer, a, g in self._captures:
                for local, value in _GHOST_SUMS[type(layer)](layer, a, g, factors).items():
                    name = prefix[id(layer)] + local
                    if name in wanted:
                        sums[name] = value
            self._captures = []
            return sums
        losses = self._losses
        assert losses is not None
        if trainable and losses.numel():
            grads = torch.autograd.grad(losses, [p for _, p in trainable],
                                        grad_outputs=factors.to(losses.dtype), allow_unused=True)
            for (n, _), g in zip(trainable, grads):
                if g is not None:
                    sums[n] = g.double()
        self._losses = None  # the graph is released with it
        return sums


class GhostUnsupported(ValueError):
    """The forward did something the ghost norms cannot account for exactly."""


def _check_captures(captured, batch_size: int) -> None:
    """Each layer once per forward (a shared layer's per-example gradient is a sum over its
    calls, whose norm is not the sum of the calls' norms), no captured input or output changed
    in place afterwards (the activations or the gradient would be the changed tensor's), and
    every captured input and output a tensor whose first dimension is the batch's (the ghost
    norms read dimension 0 as the example; a layer applied to [T, B, ...] or to a flattened
    [B·T, ...] would mix examples)."""
    seen = set()
    for layer, inp, out, versions in captured:
        name = type(layer).__name__
        if id(layer) in seen:
            raise GhostUnsupported(f"{name} is called more than once per forward")
        seen.add(id(layer))
        if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
            raise GhostUnsupported(f"the input or output of a {name} is not a tensor")
        if (inp._version, out._version) != versions:
            raise GhostUnsupported(f"the input or output of a {name} is modified in place")
        if inp.dim() == 0 or out.dim() == 0 or inp.shape[0] != batch_size or out.shape[0] != batch_size:
            raise GhostUnsupported(f"the input or output of a {name} does not have the batch ({batch_size}) "
                                   f"as its first dimension (shapes {list(inp.shape)} -> {list(out.shape)})")


def _parameterized_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that own parameters with elements (recurse=False)."""
    return [m for m in model.modules() if any(p.numel() for p in m.parameters(recurse=False))]


def _shared_parameter_owners(model: nn.Module) -> set[int]:
    """ids of the modules that own (recurse=False) a parameter another module owns too (tied
    weights): its gradient is a sum over both modules' uses, which no one layer's ghost norm sees."""
    owners: dict[int, list[int]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(id(m))
    return {m for ms in owners.values() if len(ms) > 1 for m in ms}


def _unsupported_layers(model: nn.Module, grouped: bool = False) -> list[str]:
    """Sorted names of what keeps `model` off the ghost path: the types of the modules owning
    parameters without a registered ghost norm (with `grouped`, or ghost group norm), a
    registered type's refused configuration as "Type(what)", and "Type(shared parameter)"."""
    shared = _shared_parameter_owners(model)
    names = set()
    for m in _parameterized_layers(model):
        name = type(m).__name__
        if ghost_norm_for(m) is None or (grouped and ghost_group_norm_for(m) is None):
            names.add(name)
        elif (why := ghost_refusal(m)) is not None:
            names.add(f"{name}({why})")
        elif id(m) in shared:
            names.add(f"{name}(shared parameter)")
    return sorted(names)


def supports_ghost(model: nn.Module) -> bool:
    """Whether every module that owns parameters has a registered ghost norm, in a
    configuration it accepts, and owns no parameter another module owns too. (What only a
    forward shows — a layer called twice, an output changed in place, a parameter used without
    its module — `GhostGradients` checks and refuses with `GhostUnsupported`.)"""
    return not _unsupported_layers(model)


def supports_ghost_groups(model: nn.Module) -> bool:
    """`supports_ghost(model)`, and every module that owns parameters also has a registered ghost
    group norm (what `GhostGradients.group_sq_norms` needs)."""
    return not _unsupported_layers(model, grouped=True)


logger = logging.getLogger(__name__)
_FALLBACKS_SAID: set[tuple[type, str]] = set()


def _say_fallback_once(model: nn.Module, reason: str) -> None:
    """One logging warning per (model class, reason) for the process: "auto" fell back to the
    per-example reference (a step repeats the same fallback every time; once is enough)."""
    key = (type(model), reason)
    if key not in _FALLBACKS_SAID:
        _FALLBACKS_SAID.add(key)
        logger.warning("dense_gradients(method='auto') uses the per-example reference for %s: %s",
                       type(model).__name__, reason)


def dense_gradients(model: DenseModel, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor,
                    method: str = "auto", grouped: bool = False) -> DenseGradients:
    """Pass 1 of the dense part by `method`: "ghost", "per_example" (the reference), or "auto"
    (ghost when `supports_ghost(model)` and the forward allows it, else the reference). With
    `grouped` (the caller will ask for `group_sq_norms`), ghost also needs every layer's ghost
    group norm: "auto" falls back to the reference without one, "ghost" refuses."""
    if method not in ("auto", "ghost", "per_example"):
        raise ValueError(f"dense gradient method must be 'auto', 'ghost' or 'per_example', got {method!r}")
    explicit = method == "ghost"
    if method == "auto":
        missing = _unsupported_layers(model, grouped)
        method = "per_example" if missing else "ghost"
        if missing:
            what = "ghost group norm" if grouped and not _unsupported_layers(model) else "ghost norm"
            hint = ("; widedp.trainer.private.layers.replace_multihead_attention(module) swaps in an equal attention "
                    "of nn.Linear parts that has one") if "MultiheadAttention" in missing else ""
            _say_fallback_once(model, f"no {what} for {missing} (register_ghost_norm / register_ghost_group_norm)"
                               + hint)
    if method == "ghost":
        if not supports_ghost(model):
            raise ValueError(f"no ghost norm registered for {_unsupported_layers(model)} "
                             "(trainer.engine.dense_grads.register_ghost_norm)")
        if grouped and not supports_ghost_groups(model):
            raise ValueError(f"no ghost group norm registered for {_unsupported_layers(model, grouped=True)} "
                             "(trainer.engine.dense_grads.register_ghost_group_norm)")
        try:
            return GhostGradients(model, pooled, dense, labels)
        except GhostUnsupported as e:
            if explicit:
                raise
            _say_fallback_once(model, f"the forward is one the ghost path cannot follow ({e})")
    return PerExampleGradients(model, pooled, dense, labels)
