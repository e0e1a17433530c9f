"""Layers that keep a user's dense module on the ghost-norm path.

`nn.MultiheadAttention` applies its parameters inside `F.multi_head_attention_forward`, where no
module hook sees the activations, so a model with one falls back to torch.func per-example
gradients (trainer/engine/dense_grads.py). `LinearMultiheadAttention` computes the same function
with four `nn.Linear` projections (q, k, v, out), each of which has a ghost norm (the Gram form
of a Linear over a sequence dimension); `replace_multihead_attention(module)` swaps it in for
every `nn.MultiheadAttention` of a module, weights copied — as Opacus's `ModuleValidator.fix`
swaps in its DPMultiheadAttention. The state-dict keys stay nn.MultiheadAttention's
(`in_proj_weight`, `in_proj_bias`, `out_proj.*`), so checkpoints load either way.

Privacy assumption: none of its own (a reparametrization of the same function: the per-example
gradient over (q, k, v) weights is the in-projection's, split in three, so its norm is the same).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class LinearMultiheadAttention(nn.Module):
    """`nn.MultiheadAttention`'s forward (same arguments and outputs) from nn.Linear parts.

    Args:
        embed_dim, num_heads, bias, batch_first, kdim, vdim: as nn.MultiheadAttention's.
        dropout: must be 0 (attention dropout would make the loss random per example in a way the
            coupling probe cannot tell from coupling; not supported yet).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, kdim: Optional[int] = None, vdim: Optional[int] = None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        if dropout:
            raise ValueError("LinearMultiheadAttention: attention dropout is not supported (dropout must be 0)")
        self.embed_dim, self.num_heads, self.batch_first = int(embed_dim), int(num_heads), bool(batch_first)
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._same_dims = kdim in (None, embed_dim) and vdim in (None, embed_dim)
        self._register_state_dict_hook(_as_multihead_keys)
        self._register_load_state_dict_pre_hook(_from_multihead_keys, with_module=True)

    @classmethod
    def from_multihead(cls, mha: nn.MultiheadAttention) -> "LinearMultiheadAttention":
        """The same attention, weights copied. Refuses what it does not compute: dropout,
        bias_k / bias_v, add_zero_attn."""
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("LinearMultiheadAttention: add_bias_kv and add_zero_attn are not supported")
        out = cls(mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None, mha.batch_first,
                  mha.kdim, mha.vdim)
        out = out.to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
        out.load_state_dict(mha.state_dict())
        return out

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        if not self.batch_first:  # [L, B, E] -> [B, L, E]: the projections see the batch first
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        B, Lq, _ = query.shape
        S = key.shape[1]
        H, hd = self.num_heads, self.head_dim
        q = self.q_proj(query).view(B, Lq, H, hd).transpose(1, 2)
        k = self.k_proj(key).view(B, S, H, hd).transpose(1, 2)
        v = self.v_proj(value).view(B, S, H, hd).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # [B, H, Lq, S]
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(Lq, S, dtype=torch.bool, device=query.device).triu(1)
        if attn_mask is not None:
            mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(B, H, Lq, S)
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if key_padding_mask is not None:
            pad = key_padding_mask[:, None, None, :]
            scores = scores.masked_fill(pad, float("-inf")) if pad.dtype == torch.bool else scores + pad
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, Lq, self.embed_dim)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, weights.mean(1) if average_attn_weights else weights


def _as_multihead_keys(module, state: dict, prefix: str, local_metadata) -> dict:
    """State-dict hook: q/k/v projections under nn.MultiheadAttention's names."""
    if not module._same_dims:
        return state
    names = ("q_proj", "k_proj", "v_proj")
    state[prefix + "in_proj_weight"] = torch.cat([state.pop(f"{prefix}{n}.weight") for n in names])
    if f"{prefix}q_proj.bias" in state:
        state[prefix + "in_proj_bias"] = torch.cat([state.pop(f"{prefix}{n}.bias") for n in names])
    return state


def _from_multihead_keys(module, state: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: nn.MultiheadAttention's keys into the q/k/v projections."""
    names = ("q_proj", "k_proj", "v_proj")
    if prefix + "in_proj_weight" in state:
        for n, w in zip(names, state.pop(prefix + "in_proj_weight").chunk(3)):
            state[f"{prefix}{n}.weight"] = w
    for n, attr in zip(names, ("q_proj_weight", "k_proj_weight", "v_proj_weight")):
        if prefix + attr in state:  # kdim / vdim differ: separate projection weights
            state[f"{prefix}{n}.weight"] = state.pop(prefix + attr)
    if prefix + "in_proj_bias" in state:
        for n, b in zip(names, state.pop(prefix + "in_proj_bias").chunk(3)):
            state[f"{prefix}{n}.bias"] = b


def replace_multihead_attention(module: nn.Module) -> list[str]:
    """Swap every `nn.MultiheadAttention` inside `module` for an equal `LinearMultiheadAttention`
    (in place; weights copied); returns the swapped submodules' names. Call it before handing
    the module to `make_private` (and before building its optimizer, if you keep one)."""
    swapped = []
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.MultiheadAttention:
                setattr(child, attr, LinearMultiheadAttention.from_multihead(sub))
                swapped.append(f"{name}.{attr}" if name else attr)
    return swapped


__all__ = ["LinearMultiheadAttention", "replace_multihead_attention"]
