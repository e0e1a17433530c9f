"""A small transformer language model over a 50,000-word vocabulary, its word tables in your own
TorchRec EmbeddingCollections, trained with example-level DP (one line of text = one example)
by `widedp.make_private`: sparse (noise only on privately selected rows), DP-SGD and
non-private.

The model reads each line's first L words as a sequence (input word + position embeddings, one
causal self-attention block with LayerNorm and a feed-forward layer) and predicts each next
word. Training uses a sampled softmax per position over the true next word and K negatives that
were drawn for that example from a PUBLIC distribution (Zipf over the public vocabulary's rank,
seed 0), with the logQ correction: each example's loss is its own — a softmax over the other
examples' words (in-batch negatives) would couple the examples and is refused. The output word
vectors and their biases are two more tables (the bias table one column wide: tables of
different widths). Held out: the perplexity of the full softmax over all 50,000 words plus the
unknown-word token, from the released tables in plain PyTorch.

Corpus: any text file, one example per line (`--corpus`), and a PUBLIC vocabulary file, one word
per line in order (`--vocab-file`; never computed from the training text). `benchmarks/own_model.py`
passes WordNet's glosses and the King James Bible (Debian packages, fetched once by
benchmarks/text_large.py) with WordNet's lemma index as the vocabulary; English function words
(a fixed list below) come first, since WordNet has none. `--quick` makes a tiny synthetic text.

    .venv/bin/python examples/transformer_lm.py --corpus corpus.txt --vocab-file words.txt
    .venv/bin/python examples/transformer_lm.py --quick        # a smoke run (what make test runs)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

import widedp
from own_model_common import summarize

UNK, BOS = 0, 1
#: A fixed list of English function words (public; not derived from any corpus).
FUNCTION_WORDS = """the of and to a in that is was he for it with as his on be at by i this had not are but from or
have an they which one you were her all she there would their we him been has when who will more no if out so
said what up its about into than them can only other new some could time these two may then do first any my now
such like our over me even most made after also did many before must through back years where much your way well
down should because each just those people how too little us state good very make world still own see men work
long get here between both life being under never day same another know while last might great old year off come
since against go came right used take three unto thou thee thy ye shall hath lord upon""".split()

L, K, DIM = 24, 32, 32  # words read per line, negatives per example, width of the word vectors


def tokens(line: str) -> list[str]:
    return re.findall(r"[a-z]+", line.lower())


def vocabulary(vocab_file: Path | None, size: int) -> list[str]:
    """[<unk>, <bos>, function words, then the vocabulary file's words in order], `size` words."""
    words = ["<unk>", "<bos>"]
    seen = set(words)
    listed = vocab_file.read_text().split() if vocab_file is not None else []
    for w in [*FUNCTION_WORDS, *listed]:
        if w not in seen and re.fullmatch(r"[a-z]+", w):
            words.append(w)
            seen.add(w)
        if len(words) == size:
            break
    return words


def synthetic_text(lines: int, words: list[str], seed: int = 0) -> list[str]:
    """A smoke-size text over `words` with a learnable next-word rule (word i is often followed
    by word i + 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        w = int(rng.integers(2, len(words) - 12))
        seq = [w + int(k) for k in np.cumsum(rng.integers(0, 2, rng.integers(4, 16)))]
        out.append(" ".join(words[i] for i in seq))
    return out


def examples(lines: list[str], words: list[str], seed: int = 0):
    """A `widedp.KJTDataset` of the lines: features tokens (<bos> + the first L - 1 words),
    targets (the first L words: each position's next word), negatives (K public draws), and the
    bias features of targets and negatives; the dense features are the logQ corrections of the
    targets [L] and negatives [K]. Lines without a word are skipped (a rule on each line alone).
    Also the out-of-vocabulary rate of the targets (report it for held-out lines only: of the
    training lines it is an un-noised statistic of the training data)."""
    index = {w: i for i, w in enumerate(words)}
    V = len(words)
    # the public sampling distribution: Zipf by rank over the real words (not <unk>, <bos>)
    q = np.zeros(V)
    q[2:] = 1.0 / np.arange(1, V - 1)
    q /= q.sum()
    log_kq = np.log(K * np.maximum(q, 1e-30)).astype(np.float32)
    rng = np.random.default_rng(seed)
    seqs = [[index.get(t, UNK) for t in tokens(line)][:L] for line in lines]
    seqs = [s for s in seqs if s]
    n = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    targets = np.concatenate(seqs).astype(np.int64)
    inputs = np.concatenate([[BOS, *s[:-1]] for s in seqs]).astype(np.int64)
    negatives = rng.choice(V, size=(n, K), p=q).astype(np.int64)
    dense = np.zeros((n, L + K), dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for j in range(n):
        dense[j, :lengths[j]] = log_kq[targets[starts[j]:starts[j] + lengths[j]]]
    dense[:, L:] = log_kq[negatives]
    neg_len = np.full(n, K, dtype=np.int64)
    kjt = KeyedJaggedTensor(
        keys=["tokens", "targets", "negatives", "target_bias", "negative_bias"],
        values=torch.from_numpy(np.concatenate([inputs, targets, negatives.ravel(), targets, negatives.ravel()])),
        lengths=torch.from_numpy(np.concatenate([lengths, lengths, neg_len, lengths, neg_len]).astype(np.int32)))
    data = widedp.KJTDataset(kjt, torch.zeros(n), dense=torch.from_numpy(dense))
    return data, float((targets == UNK).mean())


def embedding_modules(V: int) -> list:
    words = EmbeddingCollection(tables=[EmbeddingConfig(name="input_words", embedding_dim=DIM, num_embeddings=V,
                                                        feature_names=["tokens"])])
    outputs = EmbeddingCollection(tables=[EmbeddingConfig(name="output_words", embedding_dim=DIM, num_embeddings=V,
                                                          feature_names=["targets", "negatives"])])
    bias = EmbeddingCollection(tables=[EmbeddingConfig(name="output_bias", embedding_dim=1, num_embeddings=V,
                                                       feature_names=["target_bias", "negative_bias"])])
    for table in (*words.embeddings.values(), *outputs.embeddings.values()):
        nn.init.normal_(table.weight, std=0.05)
    bias.embeddings["output_bias"].weight.data.zero_()
    return [words, outputs, bias]  # TorchRec's EmbeddingCollection holds one width: the bias table is its own


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x [B, L, D], mask [B, L, L]
        scores = (self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])).masked_fill(~mask, -1e9)
        return self.o(torch.softmax(scores, -1) @ self.v(x))


class TinyTransformerLM(nn.Module):
    """Embeddings in, a hidden state per position out; `forward` scores the example's sampled
    candidates, `hidden` is what the full softmax of the evaluation uses."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.position = nn.Embedding(L, DIM)
        self.attention = CausalSelfAttention(DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, DIM))

    def hidden(self, words: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        B = words.shape[0]
        pos = torch.arange(L)
        valid = pos.expand(B, L) < length[:, None]
        mask = (pos[None, :, None] >= pos[None, None, :]) & valid[:, None, :]
        x = words + self.position(pos.repeat(B, 1))
        x = self.norm1(x + self.attention(x, mask))
        return self.norm2(x + self.ffn(x))

    def forward(self, emb: dict, dense: torch.Tensor, lengths: dict) -> torch.Tensor:
        """[B, L, 1 + K] corrected logits of (the next word, the K negatives) per position;
        positions past the line's length are masked by the loss."""
        h = self.hidden(emb["tokens"], lengths["tokens"])
        true = (h * emb["targets"]).sum(-1) + emb["target_bias"][..., 0] - dense[:, :L]
        neg = h @ emb["negatives"].transpose(1, 2) + (emb["negative_bias"][..., 0] - dense[:, L:])[:, None, :]
        valid = (torch.arange(L).expand(h.shape[0], L) < lengths["tokens"][:, None]).to(h.dtype)
        return torch.cat([true[..., None], neg, valid[..., None]], -1)  # the mask travels in the last slot


def sampled_softmax_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each example's mean over its positions of −log softmax(corrected logits)[next word]."""
    logits, valid = outputs[..., :-1], outputs[..., -1]
    nll = torch.logsumexp(logits, -1) - logits[..., 0]
    return (nll * valid).sum(1) / valid.sum(1).clamp(min=1.0)


@torch.no_grad()
def perplexity(modules, model: TinyTransformerLM, test, batch: int = 64) -> float:
    """exp(mean −log p(next word)) under the full softmax over every word, in plain PyTorch."""
    words, outputs, bias = modules
    W = outputs.embeddings["output_words"].weight
    b = bias.embeddings["output_bias"].weight[:, 0]
    total, count = 0.0, 0
    for start in range(0, len(test), batch):
        idx = np.arange(start, min(start + batch, len(test)))
        seq = words(test.with_features(["tokens"]).take(idx).sparse)["tokens"]
        tgt = test.with_features(["targets"]).take(idx).sparse["targets"]
        length = seq.lengths().clamp(max=L)
        h = model.hidden(seq.to_padded_dense(L), length)  # [B, L, D]: the first L words, zeros after
        logp = torch.log_softmax(h @ W.T + b, -1)  # [B, L, V]
        target = tgt.to_padded_dense(L).long()
        valid = torch.arange(L).expand(len(idx), L) < length[:, None]
        total += float(-(logp.gather(-1, target[..., None])[..., 0] * valid).sum())
        count += int(valid.sum())
    return math.exp(total / max(count, 1))


SETTINGS = {  # not tuned for this model: Adam at widedp's non-private defaults, clipping at 1
    "sparse": ["train.optimizer=adam", "train.lr=0.01", "train.dense_lr=0.002", "privacy.clip_norm=1.0",
               "train.selection=fest-threshold", "privacy.selection_fraction=0.1",
               "privacy.fest_max_rows_per_example=64"],
    "dpsgd": ["train.optimizer=adam", "train.lr=0.01", "train.dense_lr=0.002", "privacy.clip_norm=1.0"],
    "nonprivate": ["train.optimizer=adam", "train.lr=0.01", "train.dense_lr=0.002"],
}


def train_one(train, test, V, mode, epsilon, args, seed) -> dict:
    torch.manual_seed(seed)  # the public initialization
    modules, model = embedding_modules(V), TinyTransformerLM()
    with widedp.make_private(modules, model, sampled_softmax_loss, train, mode=mode, target_epsilon=epsilon or 8.0,
                             batch_size=args.batch_size, steps=args.steps,
                             config=[*SETTINGS[mode], f"train.seed={seed}",
                                     f"privacy.k={max(1, int(0.4 * V))}"],  # DP-FEST: 0.4·V of the 3·V rows
                             max_sequence_length={"tokens": L, "targets": L, "negatives": K, "target_bias": L,
                                                  "negative_bias": K},
                             metrics_fn=lambda out, y: {"sampled_loss": float(sampled_softmax_loss(out, y).mean())}
                             ) as trainer:
        trainer.train()
        state = trainer.embedding_state_dict()  # the released tables, back in the user's modules
        for module in modules:
            module.load_state_dict({k: state[k] for k in module.state_dict()})
        return {"perplexity": perplexity(modules, model, test), "epsilon": trainer.epsilon()}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="a text file, one example per line")
    parser.add_argument("--vocab-file", type=Path, help="a public vocabulary, one word per line, in order")
    parser.add_argument("--vocab", type=int, default=50000)
    parser.add_argument("--test-lines", type=int, default=3000, help="lines held out (a public seed picks them)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epsilons", default="1,8")
    parser.add_argument("--modes", default="sparse,dpsgd,nonprivate")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a synthetic text, 3 steps, ε = 8")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.test_lines, args.steps, args.batch_size, args.epsilons, args.seeds = 600, 100, 3, 64, "8", "0"
    words = vocabulary(args.vocab_file, args.vocab)
    if args.quick or args.corpus is None:
        if not args.quick:
            parser.error("--corpus is required without --quick")
        lines = synthetic_text(1000, words)
    else:
        lines = args.corpus.read_text(encoding="utf-8").splitlines()
    order = np.random.default_rng(0).permutation(len(lines))  # the public split
    held = set(order[:args.test_lines].tolist())
    train, _ = examples([line for i, line in enumerate(lines) if i not in held], words, seed=1)
    test, test_oov = examples([line for i, line in enumerate(lines) if i in held], words, seed=2)
    results: dict = {"examples": {"train": len(train), "test": len(test)}, "vocabulary": len(words),
                     # the held-out lines' unknown-word rate only: the training text's is an un-noised statistic
                     "out_of_vocabulary": {"test": test_oov}, "steps": args.steps, "runs": {}}
    for mode in args.modes.split(","):
        for eps in (["inf"] if mode == "nonprivate" else args.epsilons.split(",")):
            runs = []
            for seed in map(int, args.seeds.split(",")):
                start = time.perf_counter()
                metrics = train_one(train, test, len(words), mode, None if eps == "inf" else float(eps), args, seed)
                metrics["seconds"] = time.perf_counter() - start
                runs.append(metrics)
            results["runs"].setdefault(mode, {})[eps] = summarize(runs)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
