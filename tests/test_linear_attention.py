"""`LinearMultiheadAttention` (trainer/private/layers.py): nn.MultiheadAttention's function from
four nn.Linear projections, so a model with attention takes the ghost-norm path — equal outputs
and attention weights for every mask form, nn.MultiheadAttention's state-dict keys both ways,
and ghost norms / clipped sums held to the torch.func reference (the un-swapped model falls
back, the swapped one does not)."""

import logging

import pytest
import torch
from torch import nn

from test_dense_group_norms import _Binary
from widedp.trainer.engine.dense_grads import GhostGradients, PerExampleGradients, dense_gradients, supports_ghost
from widedp.trainer.private.layers import LinearMultiheadAttention, replace_multihead_attention

E, H, B, Lq, S = 8, 2, 5, 4, 6


def _inputs(batch_first, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda L: (B, L, E)) if batch_first else (lambda L: (L, B, E))
    return torch.randn(shape(Lq), generator=g), torch.randn(shape(S), generator=g), torch.randn(shape(S), generator=g)


def _masks():
    g = torch.Generator().manual_seed(1)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    pad[3, 0] = True
    causal = torch.ones(Lq, S, dtype=torch.bool).triu(1)
    return {"none": {}, "key_padding": {"key_padding_mask": pad}, "bool_mask": {"attn_mask": causal},
            "float_mask": {"attn_mask": torch.randn(Lq, S, generator=g)},
            "per_head_mask": {"attn_mask": torch.randn(B * H, Lq, S, generator=g)},
            "float_padding": {"key_padding_mask": torch.randn(B, S, generator=g)},
            "both": {"attn_mask": causal, "key_padding_mask": pad}}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", list(_masks()))
@pytest.mark.parametrize("average", [True, False])
def test_it_computes_multihead_attention(batch_first, masks, average):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    ours = LinearMultiheadAttention.from_multihead(mha)
    q, k, v = _inputs(batch_first)
    want, want_w = mha(q, k, v, average_attn_weights=average, **_masks()[masks])
    got, got_w = ours(q, k, v, average_attn_weights=average, **_masks()[masks])
    # (a query whose every key is masked is NaN in both, as in torch: equal_nan)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ours(q, k, v, need_weights=False, **_masks()[masks])[1] is None


def test_state_dicts_keep_multihead_attentions_keys_both_ways():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    ours = LinearMultiheadAttention.from_multihead(mha)
    assert set(ours.state_dict()) == set(mha.state_dict())
    for key, value in mha.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=0, atol=0)
    other = nn.MultiheadAttention(E, H, batch_first=True)
    other.load_state_dict(ours.state_dict())
    q, k, v = _inputs(True)
    torch.testing.assert_close(other(q, k, v)[0], mha(q, k, v)[0], rtol=0, atol=0)


def test_what_it_does_not_compute_is_refused():
    with pytest.raises(ValueError, match="attention dropout is not supported"):
        LinearMultiheadAttention.from_multihead(nn.MultiheadAttention(E, H, dropout=0.1))
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn are not supported"):
        LinearMultiheadAttention.from_multihead(nn.MultiheadAttention(E, H, add_bias_kv=True))


class Block(_Binary):
    """A pre-LN encoder block over the pooled features as a sequence, nn.MultiheadAttention inside."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.att = nn.MultiheadAttention(E, H, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(E, 16), nn.ReLU(), nn.Linear(16, E))
        self.head = nn.Linear(E, 1)

    def forward(self, pooled, dense):
        x = self.norm(pooled)
        x = x + self.att(x, x, x, need_weights=False)[0]
        return self.head((x + self.ffn(x)).mean(1)).squeeze(-1)


def test_the_swapped_block_takes_the_ghost_path_with_the_references_norms(caplog):
    torch.manual_seed(0)
    model = Block()
    g = torch.Generator().manual_seed(3)
    pooled, dense = torch.randn(7, 5, E, generator=g), torch.zeros(7, 0)
    labels = (torch.rand(7, generator=g) > 0.5).float()
    assert not supports_ghost(model)
    reference = dense_gradients(model, pooled, dense, labels, "per_example")
    want = model(pooled, dense).detach()
    assert replace_multihead_attention(model) == ["att"]
    assert supports_ghost(model)
    torch.testing.assert_close(model(pooled, dense), want, rtol=1e-5, atol=1e-6)  # the same function
    with caplog.at_level(logging.WARNING):
        ghost = dense_gradients(model, pooled, dense, labels, "auto")
    assert isinstance(ghost, GhostGradients) and not [r for r in caplog.records if "per-example reference" in r.message]
    assert isinstance(reference, PerExampleGradients)
    torch.testing.assert_close(ghost.sq_norms, reference.sq_norms, rtol=1e-4, atol=1e-8)
    factors = torch.rand(7, generator=g, dtype=torch.float64)
    got, ref = ghost.clipped_sum(factors), reference.clipped_sum(factors)
    # the reference's in-projection is the swapped q/k/v projections stacked
    q_k_v = torch.cat([got["att.q_proj.weight"], got["att.k_proj.weight"], got["att.v_proj.weight"]])
    torch.testing.assert_close(q_k_v, ref["att.in_proj_weight"], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got["att.out_proj.weight"], ref["att.out_proj.weight"], rtol=1e-4, atol=1e-7)
