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
  formed.

Both rely on the model treating examples independently (`DenseModel`'s contract: no batch
statistics), so ∂(Σ_k ℓ_k)/∂x_j = ∂ℓ_j/∂x_j for every per-example tensor x. `dense_gradients`
picks the ghost path when every module that owns parameters has a registered ghost norm and
the reference otherwise; tests hold the two to agreement on every model here.
"""

from __future__ import annotations

import abc
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


@register_ghost_norm(nn.Linear)
def _linear_ghost_norm(layer: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """∇_W ℓ_j = Σ_t g_jt a_jtᵀ, ∇_b ℓ_j = Σ_t g_jt (t over a sequence dimension, if any).
    Without one: ‖∇_W‖² = ‖a_j‖²‖g_j‖². With one: ‖Σ_t g_t a_tᵀ‖_F² = Σ_{t,s} (a_t·a_s)(g_t·g_s),
    i.e. ⟨A Aᵀ, G Gᵀ⟩ over the T × T Gram matrices (Li et al. 2022, eq. 4)."""
    a, g = a.double(), g.double()
    if a.dim() == 2:
        sq = a.pow(2).sum(1) * g.pow(2).sum(1)
        bias_grad = g
    else:
        a, g = a.flatten(1, -2), g.flatten(1, -2)  # [B, T, in], [B, T, out]
        sq = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
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


# ---- the two implementations -----------------------------------------------------------------------
class DenseGradients(abc.ABC):
    """Pass 1 at construction; `clipped_sum(factors)` is pass 2 (once)."""

    losses: torch.Tensor  # [B]
    pooled_grads: torch.Tensor  # [B, F, D]: ∂ℓ_j/∂pooled_j
    sq_norms: torch.Tensor  # [B] float64: ‖∇_θ ℓ_j‖² over every dense parameter

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

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: torch.tensordot(factors.to(g.dtype), g, dims=1).double() for n, g in self.per_example.items()}

    def clamped_sum(self, factors: torch.Tensor, bound: float) -> dict[str, torch.Tensor]:
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
        try:
            with torch.enable_grad():
                pooled_leaf = pooled.detach().requires_grad_(True)
                self._losses: Optional[torch.Tensor] = model.loss(model(pooled_leaf, dense), labels)
                _check_captures(captured)
                outputs = [out for _, _, out, _ in captured]
                grads = torch.autograd.grad(self._losses.sum(), [pooled_leaf, *outputs],
                                            retain_graph=not self._book_keeping, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        B = pooled.shape[0]
        self.losses = self._losses.detach()
        self.pooled_grads = grads[0] if grads[0] is not None else torch.zeros_like(pooled)
        sq = torch.zeros(B, dtype=torch.float64)
        self._captures = []  # (layer, a, g) for the ghost sums
        for (layer, a, _, _), g in zip(captured, grads[1:]):
            if g is not None:  # an output that does not reach the loss has zero gradient
                sq = sq + _GHOST_NORMS[type(layer)](layer, a.detach(), g.detach())
                self._captures.append((layer, a.detach(), g.detach()))
        self.sq_norms = sq
        if self._book_keeping:
            self._losses = None  # no second backward: the graph can go now
        self._used = False

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


def _check_captures(captured) -> None:
    """Each layer once per forward (a shared layer's per-example gradient is a sum over its
    calls, whose norm is not the sum of the calls' norms), and no captured input or output
    changed in place afterwards (the activations or the gradient would be the changed tensor's)."""
    seen = set()
    for layer, inp, out, versions in captured:
        if id(layer) in seen:
            raise GhostUnsupported(f"{type(layer).__name__} is called more than once per forward")
        seen.add(id(layer))
        if (inp._version, out._version) != versions:
            raise GhostUnsupported(f"the input or output of a {type(layer).__name__} is modified in place")


def _parameterized_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that own parameters with elements (recurse=False)."""
    return [m for m in model.modules() if any(p.numel() for p in m.parameters(recurse=False))]


def supports_ghost(model: nn.Module) -> bool:
    """Whether every module that owns parameters has a registered ghost norm. (What only a
    forward shows — a layer called twice, an output changed in place — `GhostGradients`
    checks and refuses with `GhostUnsupported`.)"""
    return all(ghost_norm_for(m) is not None for m in _parameterized_layers(model))


def dense_gradients(model: DenseModel, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor,
                    method: str = "auto") -> DenseGradients:
    """Pass 1 of the dense part by `method`: "ghost", "per_example" (the reference), or "auto"
    (ghost when `supports_ghost(model)` and the forward allows it, else the reference)."""
    if method not in ("auto", "ghost", "per_example"):
        raise ValueError(f"dense gradient method must be 'auto', 'ghost' or 'per_example', got {method!r}")
    explicit = method == "ghost"
    if method == "auto":
        method = "ghost" if supports_ghost(model) else "per_example"
    if method == "ghost":
        if not supports_ghost(model):
            missing = sorted({type(m).__name__ for m in _parameterized_layers(model) if ghost_norm_for(m) is None})
            raise ValueError(f"no ghost norm registered for {missing} (trainer.dense_grads.register_ghost_norm)")
        try:
            return GhostGradients(model, pooled, dense, labels)
        except GhostUnsupported:
            if explicit:
                raise
    return PerExampleGradients(model, pooled, dense, labels)
