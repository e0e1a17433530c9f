"""A SASRec-style sequential recommender over your own TorchRec EmbeddingCollection — the
user's item history read as a sequence (item + position embeddings, one self-attention block
with LayerNorm and a feed-forward layer), the candidate ad attending over it — trained with
user-level DP by `widedp.make_private` on click logs with users: sparse (noise only on
privately selected rows), DP-SGD and non-private.

The history is an id list consumed position by position (`max_sequence_length`), not pooled:
each position's gradient adds into its item's row, and an item a user saw twice contributes the
sum once. The loss is each example's own (the logistic loss of its logged click). Held out:
hit-rate@10 and NDCG@10 of each clicked test example's ad ranked among it and 99 ads of other
test examples (a public seed), and the click AUC; median [min, max] over seeds.

    .venv/bin/python examples/sasrec_sequential.py            # 3,000 users, ε ∈ {1, 8}, 2 seeds
    .venv/bin/python examples/sasrec_sequential.py --quick    # a smoke run (what make test runs)
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

import widedp
from own_model_common import arguments, sweep

DIM, HISTORY = 16, 20  # the logs keep each user's last 20 views, most recent first


class SelfAttention(nn.Module):
    """One head of masked self-attention written with Linear layers (ghost norms apply to each)."""

    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x [B, L, D], mask [B, L]
        scores = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~mask[:, None, :], -1e9)
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x))


class SASRecRanker(nn.Module):
    def __init__(self, num_dense: int, hidden: int = 32):
        super().__init__()
        self.position = nn.Embedding(HISTORY, DIM)
        self.attention = SelfAttention(DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, DIM))
        self.head = nn.Sequential(nn.Linear(5 * DIM + num_dense, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def encode(self, history: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The history [B, L, D] and its lengths [B] -> (encoded [B, L, D], mask [B, L])."""
        B = history.shape[0]
        mask = torch.arange(HISTORY).expand(B, HISTORY) < length[:, None]
        x = history + self.position(torch.arange(HISTORY).repeat(B, 1))
        x = self.norm1(x + self.attention(x, mask))
        x = self.norm2(x + self.ffn(x))
        return x * mask[..., None].to(x.dtype), mask

    def score(self, encoded, mask, ad, campaign, device, dense) -> torch.Tensor:
        """The click logit of candidate (ad, campaign) [B, D] for each encoded history."""
        weights = torch.softmax(((encoded * ad[:, None, :]).sum(-1) / math.sqrt(DIM)).masked_fill(~mask, -1e9), -1)
        summary = (weights[..., None] * encoded).sum(1) * mask.any(1, keepdim=True).to(ad.dtype)
        return self.head(torch.cat([summary, ad, summary * ad, campaign, device, dense], 1)).squeeze(-1)

    def forward(self, emb: dict, dense: torch.Tensor, lengths: dict) -> torch.Tensor:
        encoded, mask = self.encode(emb["history"], lengths["history"])
        return self.score(encoded, mask, emb["ad"][:, 0], emb["campaign"], emb["device"], dense)


def embedding_modules(sizes: dict) -> list:
    items = EmbeddingCollection(tables=[EmbeddingConfig(name="item", embedding_dim=DIM, num_embeddings=sizes["item"],
                                                        feature_names=["history", "ad"])])  # one item table
    context = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="campaign", embedding_dim=DIM, num_embeddings=sizes["campaign"],
                           feature_names=["campaign"]),
        EmbeddingBagConfig(name="device", embedding_dim=DIM, num_embeddings=sizes["device"], feature_names=["device"]),
    ])
    return [items, context]


def bce(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")


@torch.no_grad()
def ranking_metrics(modules, model: SASRecRanker, test, k: int = 10, candidates: int = 100, seed: int = 0) -> dict:
    """Plain PyTorch over the released modules: of the clicked test examples, hit-rate@k and
    NDCG@k of the logged ad among it and `candidates - 1` ads (with their campaigns) of other
    test examples."""
    items, context = modules
    every = np.arange(len(test))
    batch = test.take(every)
    seq = items(test.with_features(["history", "ad"]).take(every).sparse)  # {feature: JaggedTensor}
    history = seq["history"].to_padded_dense(HISTORY)  # the first 20 ids: the 20 most recent views
    length = seq["history"].lengths().clamp(max=HISTORY)
    bags = context(test.with_features(["campaign", "device"]).take(every).sparse).to_dict()
    ad, campaign = seq["ad"].to_padded_dense(1)[:, 0], bags["campaign"]
    clicked = torch.nonzero(batch.labels > 0.5).flatten()
    others = torch.from_numpy(np.random.default_rng(seed).integers(0, len(test), (len(clicked), candidates - 1)))
    encoded, mask = model.encode(history[clicked], length[clicked])
    true = model.score(encoded, mask, ad[clicked], campaign[clicked], bags["device"][clicked], batch.dense[clicked])
    beaten = torch.zeros(len(clicked), dtype=torch.long)
    for c in range(candidates - 1):
        pick = others[:, c]
        s = model.score(encoded, mask, ad[pick], campaign[pick], bags["device"][clicked], batch.dense[clicked])
        beaten += (s > true).long()
    hit = beaten < k
    return {"hit@10": float(hit.double().mean()),
            "ndcg@10": float(torch.where(hit, 1.0 / torch.log2(beaten.double() + 2.0), 0.0).mean())}


def train_one(train, test, sizes, mode, epsilon, args, settings) -> dict:
    modules, model = embedding_modules(sizes), SASRecRanker(train.num_dense)
    with widedp.make_private(modules, model, bce, train, mode=mode, target_epsilon=epsilon or 8.0,
                             batch_size=args.batch_size, steps=args.steps, config=settings,
                             max_sequence_length={"history": HISTORY, "ad": 1},
                             logit_layer=model.head[-1]) as trainer:
        trainer.train()  # then train.recalibrate: private Platt scaling folded into the head's last layer
        metrics = trainer.evaluate(test)
        state = trainer.embedding_state_dict()  # the released tables, back in the user's modules
        modules[0].load_state_dict({k: v for k, v in state.items() if k.startswith("embeddings.")})
        modules[1].load_state_dict({k: v for k, v in state.items() if k.startswith("embedding_bags.")})
        return {**ranking_metrics(modules, model, test), "auc": metrics["auc"], "logloss": metrics["logloss"],
                "epsilon": trainer.epsilon()}


if __name__ == "__main__":
    sweep(arguments(__doc__.splitlines()[0]), train_one)
