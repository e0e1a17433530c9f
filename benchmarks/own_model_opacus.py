"""The own-model examples under Opacus: the same user model through Opacus `make_private`
beside widedp's `make_private` and the plain-PyTorch floor, in one run.

Four examples (examples/):

  sasrec_sequential  the SASRec-style ranker (`SASRecRanker`) on `widedp synth logs` click logs
                     (examples/own_model_common.py `click_logs`): one item table (history and ad),
                     campaign and device bags (sum-pooled), 16 wide
  dcn_ranking        the DCN-v2 ranker (`DCNv2`) over an EmbeddingBagCollection, bags only, on the same
                     click logs: the item table shared by ad and history (MEAN-pooled), campaign and
                     device (sum-pooled), 16 wide
  two_tower_retrieval  the two-tower model (`TwoTower`: user tower history, device, dense; item tower
                     ad, campaign; dot-product logit) over the same EmbeddingBagCollection layout and
                     click logs
  transformer_lm     the small transformer LM (`TinyTransformerLM`): input_words [V, 32],
                     output_words [V, 32] (targets and negatives), output_bias [V, 1]; the public
                     text of benchmarks/text_large.py (`--quick`: the example's `synthetic_text`)

For each, a plain-PyTorch `nn.Module` holds the example's tables as `nn.Embedding` (one per table,
its TorchRec module's starting weights copied) and the example's own dense module, and turns a
batch into the dense module's `emb` / `lengths` dicts as widedp does: a sequence feature's first L
ids, zeros after; a bag the sum (or mean, as its config says) of its rows. The lookups are done in
its `forward` from padded id tensors [B, W] and masks [B, W] passed as inputs — one lookup per
table, its features' ids side by side (a table shared by two features is looked up once, so Opacus
sees no reused layer) — so Opacus gets per-example inputs with the batch first. The dense module is
called as widedp calls it: `(emb, dense, lengths)` with sequence features, `(emb, dense)` without.
Before timing, the twin's outputs on the test split are checked against the TorchRec path (the
example's own modules on the test KJT — EmbeddingBagCollection pooled bags, EmbeddingCollection
sequences padded to L — into the same dense module): they must agree (rtol 1e-4, atol 1e-5); the
largest difference is recorded.

Timed in one process, the systems in turn within each round (median over `--timing-steps` after
`--warmup`), at one batch size (`--batch`, default 256 examples; `--quick` 64):

  floor          plain PyTorch: forward, mean loss, backward, SGD step (non-private)
  opacus-ghost   Opacus 1.6 `PrivacyEngine().make_private(..., grad_sample_mode="ghost")`: ghost clipping
                 (GradSampleModuleFastGradientClipping + DPLossFastGradientClipping: two backward passes),
                 noise multiplier σ, max_grad_norm 1.0, SGD
  opacus-hooks   the same with grad_sample_mode="hooks" (per-sample gradients materialized: [B, V, D] per
                 table), skipped with a message when their estimated size is above a third of the memory
                 available; a failure is caught and recorded
  widedp-sparse / widedp-dpsgd
                 `widedp.make_private(...)` on the same example, modes "sparse" and "dpsgd", the example's
                 settings, example-level privacy at the same expected batch size; `trainer.step()` timed

Opacus's batches here are fixed (poisson_sampling=False: the same batch every step, for timing);
widedp Poisson-samples its own (expected size the same). Opacus's DP-SGD adds noise to every row of
every table each step (its optimizer noises each parameter's whole gradient); widedp's dpsgd mode
does too, its sparse mode only on privately selected rows.

Then an Opacus utility run: `make_private_with_epsilon` at ε = 8 (δ = widedp's rule min(1/(10n),
n^-1.1)), Poisson sampling ON, ghost clipping, `--steps` steps (default 100; `--quick` 5), the
example's DP-SGD optimizer settings (not tuned for Opacus), and the example's held-out metric
computed from the plain module's tables copied back into the example's TorchRec modules: SASRec
the click AUC of the test split and the example's `ranking_metrics` (hit-rate@10, NDCG@10); DCN the
click AUC; two-tower the click AUC and the example's `recall_at` (recall@10 of each clicked test
example's ad among it and 99 ads of other test examples); the LM the full-softmax perplexity
(`perplexity`) of the test lines.

No timing asserts: ratios are of medians measured in the same run.

    python benchmarks/own_model_opacus.py [--quick] [--examples sasrec_sequential,dcn_ranking,two_tower_retrieval,transformer_lm]
        [--threads 1]

(`--threads 1` on a machine busy with other work: two intra-op threads on two cores shared with other
processes make every small op wait on a descheduled thread — the floor step was ~100× slower so.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

from _common import DATA_DIR, announce_machine, format_table, mem_info, write_results  # noqa: E402

EXAMPLES = ("sasrec_sequential", "dcn_ranking", "two_tower_retrieval", "transformer_lm")
CLICK_LOG_EXAMPLES = ("sasrec_sequential", "dcn_ranking", "two_tower_retrieval")
SYSTEMS = ("floor", "opacus-ghost", "opacus-hooks", "widedp-sparse", "widedp-dpsgd")
LABELS = {
    "floor": "plain PyTorch (non-private floor)",
    "opacus-ghost": "Opacus ghost clipping",
    "opacus-hooks": "Opacus hooks (per-sample gradients)",
    "widedp-sparse": "widedp sparse",
    "widedp-dpsgd": "widedp DP-SGD",
}
CLIP = 1.0  # Opacus's max_grad_norm in the timing run
SIGMA = 1.0  # Opacus's noise multiplier in the timing run (the step's cost does not depend on it)
UTILITY_EPSILON = 8.0


# ---- the plain-PyTorch model ------------------------------------------------------------------------

def _configs(module):
    """(config, weight) of each table of a TorchRec EmbeddingCollection / EmbeddingBagCollection."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, EmbeddingCollection):
        return [(c, module.embeddings[c.name].weight, None) for c in module.embedding_configs()]
    if isinstance(module, EmbeddingBagCollection):
        return [(c, module.embedding_bags[c.name].weight, c.pooling) for c in module.embedding_bag_configs()]
    raise TypeError(f"not a TorchRec embedding module: {type(module).__name__}")


def padded(jt, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A JaggedTensor of ids -> (its first `width` ids per example, zeros after [B, W] int64,
    mask [B, W] float)."""
    lengths = jt.lengths().long()
    values = jt.values().long()
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    pos = torch.arange(width)
    valid = pos[None, :] < lengths[:, None]
    if values.numel() == 0:
        return torch.zeros(lengths.numel(), width, dtype=torch.long), valid.float()
    at = (offsets[:-1, None] + pos[None, :]).clamp(max=values.numel() - 1)
    return torch.where(valid, values[at], torch.zeros((), dtype=torch.long)), valid.float()


class PlainModel(nn.Module):
    """The example's tables as `nn.Embedding` and its dense module; `forward(ids_1, mask_1, ...,
    ids_T, mask_T, dense)` — per table its features' padded ids side by side — builds the dense
    module's `emb` / `lengths` as widedp does and calls it."""

    def __init__(self, modules: list, dense_module: nn.Module, sequence_length: dict, bag_width: dict):
        super().__init__()
        from torchrec.modules.embedding_configs import PoolingType

        self.tables = nn.ModuleDict()
        self.layout: list = []  # per table: (name, [(feature, width, kind, pooling)])
        for module in modules:
            for cfg, weight, pooling in _configs(module):
                table = nn.Embedding(cfg.num_embeddings, cfg.embedding_dim)
                table.weight.data.copy_(weight.detach())
                self.tables[cfg.name] = table
                feats = []
                for f in cfg.feature_names:
                    if pooling is None:
                        feats.append((f, int(sequence_length[f]), "sequence", None))
                    else:
                        feats.append((f, int(bag_width[f]), "bag", "mean" if pooling == PoolingType.MEAN else "sum"))
                self.layout.append((cfg.name, feats))
        self.dense_module = dense_module
        # widedp calls the dense module with `lengths` only when there are sequence features
        self.sequences = any(kind == "sequence" for _, feats in self.layout for _, _, kind, _ in feats)

    def features(self) -> list[str]:
        return [f for _, feats in self.layout for f, *_ in feats]

    def inputs(self, batch) -> list[torch.Tensor]:
        """A widedp `Batch` (KJT, dense, labels) -> the forward's inputs."""
        jts = batch.sparse.to_dict()
        out = []
        for _, feats in self.layout:
            parts = [padded(jts[f], width) for f, width, _, _ in feats]
            out += [torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)]
        return out + [batch.dense.float()]

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        dense = args[-1]
        emb, lengths = {}, {}
        for i, (name, feats) in enumerate(self.layout):
            ids, mask = args[2 * i], args[2 * i + 1]
            rows = self.tables[name](ids) * mask[..., None]
            start = 0
            for f, width, kind, pooling in feats:
                part, m = rows[:, start:start + width], mask[:, start:start + width]
                if kind == "sequence":
                    emb[f], lengths[f] = part, m.sum(1).round().long()
                else:
                    s = part.sum(1)
                    emb[f] = s / m.sum(1, keepdim=True).clamp(min=1.0) if pooling == "mean" else s
                start += width
        return self.dense_module(emb, dense, lengths) if self.sequences else self.dense_module(emb, dense)

    def copy_tables_to(self, modules: list) -> None:
        """The tables back into the example's TorchRec modules (for its own metrics)."""
        with torch.no_grad():
            for module in modules:
                for cfg, weight, _ in _configs(module):
                    weight.copy_(self.tables[cfg.name].weight)


class Criterion(nn.Module):
    """The example's per-example loss as a criterion with a `reduction` (what Opacus's ghost
    clipping wrapper switches to "none")."""

    def __init__(self, fn: Callable, reduction: str = "mean"):
        super().__init__()
        self.fn, self.reduction = fn, reduction

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.fn(outputs, labels)
        return loss.mean() if self.reduction == "mean" else loss.sum() if self.reduction == "sum" else loss


@torch.no_grad()
def torchrec_outputs(modules: list, dense_module: nn.Module, data, seq: dict, batch: int = 4096) -> torch.Tensor:
    """The dense module's outputs on every example of `data` through the example's own TorchRec
    modules, as widedp feeds it: an EmbeddingBagCollection's pooled bags; an EmbeddingCollection's
    sequences padded to their L (the first L ids, zeros after) with their lengths clamped to L."""
    from torchrec import EmbeddingBagCollection

    outs = []
    for start in range(0, len(data), batch):
        idx = np.arange(start, min(start + batch, len(data)))
        emb, lengths, dense = {}, {}, None
        for module in modules:
            b = data.with_features([f for c, _, _ in _configs(module) for f in c.feature_names]).take(idx)
            dense = b.dense.float()
            if isinstance(module, EmbeddingBagCollection):
                emb.update(module(b.sparse).to_dict())
            else:
                for f, jt in module(b.sparse).items():
                    emb[f] = jt.to_padded_dense(int(seq[f]))
                    lengths[f] = jt.lengths().clamp(max=int(seq[f])).long()
        outs.append(dense_module(emb, dense, lengths) if lengths else dense_module(emb, dense))
    return torch.cat(outs)


@torch.no_grad()
def twin_check(plain: PlainModel, modules: list, data, seq: dict) -> dict:
    """The plain twin's outputs on `data` against the TorchRec path (`torchrec_outputs`) with the
    same weights; raises when they differ."""
    was = plain.training
    plain.eval()
    t = tensors_of(plain, data)
    ours = plain(*t[:-1])
    theirs = torchrec_outputs(modules, plain.dense_module, data, seq)
    plain.train(was)
    if ours.shape != theirs.shape:
        raise RuntimeError(f"the plain twin's outputs {tuple(ours.shape)} are not the TorchRec path's "
                           f"{tuple(theirs.shape)}")
    diff = float((ours - theirs).abs().max()) if ours.numel() else 0.0
    scale = float(theirs.abs().max()) if theirs.numel() else 0.0
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"the plain twin's outputs differ from the TorchRec path: max |diff| {diff:.3g} "
                           f"(outputs up to {scale:.3g})")
    return {"examples": len(data), "max_abs_diff": diff, "max_abs_output": scale}


def bag_widths(data, features) -> dict:
    batch = data.with_features(list(features)).take(np.arange(len(data)))
    return {f: max(1, int(jt.lengths().max())) for f, jt in batch.sparse.to_dict().items()}


def tensors_of(plain: PlainModel, data) -> list[torch.Tensor]:
    """Every example of `data` as the forward's inputs, then its labels."""
    batch = data.with_features(plain.features()).take(np.arange(len(data)))
    return plain.inputs(batch) + [batch.labels.float()]


# ---- the examples -------------------------------------------------------------------------------------

def delta_of(n: int) -> float:
    """widedp's privacy.delta = "auto": min(1/(10n), n^-1.1)."""
    return min(1.0 / (10 * n), n ** -1.1)


_CLICK_LOGS: dict = {}


def click_data(args) -> tuple:
    """(train, test, sizes) of the click logs the click-log examples share (built once a run,
    cached on disk under runs/bench_data)."""
    import own_model_common as common

    root = Path(args.data) if args.data else DATA_DIR / f"own_model_opacus_logs_u{args.users}_d{args.days}"
    if root not in _CLICK_LOGS:
        _CLICK_LOGS[root] = common.click_logs(root, args.users, args.days)
    return _CLICK_LOGS[root]


def widths_of(train, test, features) -> dict:
    """Each bag feature's widest bag over train and test (the padded width: nothing cut)."""
    a, b = bag_widths(train, features), bag_widths(test, features)
    return {f: max(a[f], b[f]) for f in features}


def click_widedp_settings(mode: str, seed: int) -> list:
    """The click-log examples' tuned settings (own_model_common COMMON + BY_MODE) at example level."""
    import own_model_common as common

    common_ = [s for s in common.COMMON if not s.startswith(("privacy.unit", "privacy.max_examples_per_user"))]
    return [*common_, "privacy.unit=example", *common.BY_MODE[mode], f"train.seed={seed}"]


# the click-log examples' DP-SGD settings (configs/logs_dpsgd.toml, own_model_common BY_MODE["dpsgd"]): SGD, clip 3
CLICK_UTILITY_OPTIM = {"optimizer": "sgd", "lr": 0.52, "dense_lr": 0.174, "clip": 3.0}


def click_note(args) -> str:
    return f"`widedp synth logs` click logs, {args.users:,} users, {args.days} days, the last day held out"


def plain_auc(plain: "PlainModel", data) -> float:
    from widedp.trainer.models.auc import binary_auc

    was = plain.training
    plain.eval()
    with torch.no_grad():
        t = tensors_of(plain, data)
        scores = plain(*t[:-1])
    plain.train(was)
    return binary_auc(scores, t[-1])


def sasrec_case(args) -> dict:
    import sasrec_sequential as sas

    train, test, sizes = click_data(args)
    widths = widths_of(train, test, ["campaign", "device"])
    seq = {"history": sas.HISTORY, "ad": 1}

    def build(seed: int = 0):
        torch.manual_seed(seed)
        modules, model = sas.embedding_modules(sizes), sas.SASRecRanker(train.num_dense)
        return modules, model

    widedp_settings = click_widedp_settings

    def evaluate(plain: PlainModel, modules) -> dict:
        from widedp.trainer.models.auc import binary_auc

        plain.eval()
        with torch.no_grad():
            t = tensors_of(plain, test)
            scores = plain(*t[:-1])
        plain.copy_tables_to(modules)
        ranking = sas.ranking_metrics(modules, plain.dense_module, test)
        plain.train()
        return {"auc": binary_auc(scores, t[-1]), **ranking}

    return {"name": "sasrec_sequential", "train": train, "test": test, "sizes": dict(sizes), "build": build,
            "loss": sas.bce, "seq": seq, "bags": widths, "widedp_settings": widedp_settings,
            "widedp_kwargs": {"max_sequence_length": seq},
            "utility_optim": dict(CLICK_UTILITY_OPTIM), "evaluate": evaluate, "data_note": click_note(args)}


def dcn_case(args) -> dict:
    import dcn_ranking as dcn

    train, test, sizes = click_data(args)
    widths = widths_of(train, test, list(dcn.FEATURES))

    def build(seed: int = 0):
        torch.manual_seed(seed)
        return [dcn.embedding_tables(sizes)], dcn.DCNv2(train.num_dense)

    def evaluate(plain: PlainModel, modules) -> dict:
        plain.copy_tables_to(modules)
        return {"auc": plain_auc(plain, test)}

    return {"name": "dcn_ranking", "train": train, "test": test, "sizes": dict(sizes), "build": build,
            "loss": dcn.bce, "seq": {}, "bags": widths, "widedp_settings": click_widedp_settings,
            "widedp_kwargs": {}, "utility_optim": dict(CLICK_UTILITY_OPTIM), "evaluate": evaluate,
            "data_note": click_note(args)}


def two_tower_case(args) -> dict:
    import two_tower_retrieval as tt

    train, test, sizes = click_data(args)
    widths = widths_of(train, test, ["ad", "history", "campaign", "device"])

    def build(seed: int = 0):
        torch.manual_seed(seed)
        return [tt.embedding_tables(sizes)], tt.TwoTower(train.num_dense)

    def evaluate(plain: PlainModel, modules) -> dict:
        plain.copy_tables_to(modules)
        plain.eval()
        recall = tt.recall_at(modules[0], plain.dense_module, test)  # the example's own ranking
        plain.train()
        return {"auc": plain_auc(plain, test), "recall@10": recall}

    return {"name": "two_tower_retrieval", "train": train, "test": test, "sizes": dict(sizes), "build": build,
            "loss": tt.bce, "seq": {}, "bags": widths, "widedp_settings": click_widedp_settings,
            "widedp_kwargs": {}, "utility_optim": dict(CLICK_UTILITY_OPTIM), "evaluate": evaluate,
            "data_note": click_note(args)}


def lm_case(args) -> dict:
    import transformer_lm as lm

    if args.quick:
        words = lm.vocabulary(None, args.vocab)
        lines = lm.synthetic_text(1000, words)
        source = "the example's synthetic_text (1,000 lines)"
    else:
        if args.corpus:
            corpus, vocab_file = Path(args.corpus), Path(args.vocab_file) if args.vocab_file else None
        else:
            from text_large import build_corpus

            root = build_corpus()
            corpus, vocab_file = root / "corpus.txt", root / "vocab_public.txt"
        words = lm.vocabulary(vocab_file, args.vocab)
        lines = corpus.read_text(encoding="utf-8").splitlines()
        source = f"`{corpus.relative_to(HERE.parent) if corpus.is_relative_to(HERE.parent) else corpus}`"
    order = np.random.default_rng(0).permutation(len(lines))  # the example's public split
    held = set(order[:args.test_lines].tolist())
    train, _ = lm.examples([x for i, x in enumerate(lines) if i not in held], words, seed=1)
    test, _ = lm.examples([x for i, x in enumerate(lines) if i in held], words, seed=2)
    V = len(words)
    seq = {"tokens": lm.L, "targets": lm.L, "negatives": lm.K, "target_bias": lm.L, "negative_bias": lm.K}

    def build(seed: int = 0):
        torch.manual_seed(seed)  # the example's public initialization
        return lm.embedding_modules(V), lm.TinyTransformerLM()

    def widedp_settings(mode: str, seed: int) -> list:
        return [*lm.SETTINGS[mode], f"train.seed={seed}", f"privacy.k={max(1, int(0.4 * V))}"]

    def evaluate(plain: PlainModel, modules) -> dict:
        plain.copy_tables_to(modules)
        plain.eval()
        out = {"perplexity": lm.perplexity(modules, plain.dense_module, test)}
        plain.train()
        return out

    return {"name": "transformer_lm", "train": train, "test": test, "sizes": {"vocabulary": V}, "build": build,
            "loss": lm.sampled_softmax_loss, "seq": seq, "bags": {}, "widedp_settings": widedp_settings,
            "widedp_kwargs": {"max_sequence_length": seq, "metrics_fn": lambda out, y: {
                "sampled_loss": float(lm.sampled_softmax_loss(out, y).mean())}},
            # the example's settings (SETTINGS["dpsgd"]): Adam 0.01 / 0.002, clip 1
            "utility_optim": {"optimizer": "adam", "lr": 0.01, "dense_lr": 0.002, "clip": 1.0},
            "evaluate": evaluate, "data_note": f"{source}, vocabulary {V:,} words, {args.test_lines:,} lines held out"}


CASES = {"sasrec_sequential": sasrec_case, "dcn_ranking": dcn_case, "two_tower_retrieval": two_tower_case,
         "transformer_lm": lm_case}


# ---- the steps -----------------------------------------------------------------------------------------

def plain_model(case) -> tuple[PlainModel, list]:
    modules, dense = case["build"](0)
    return PlainModel(modules, dense, case["seq"], case["bags"]), modules


def floor_step(case, inputs, labels) -> Callable[[], None]:
    model, _ = plain_model(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = case["loss"]

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(*inputs), labels).mean().backward()
        opt.step()
    return step


class ContiguousIds(nn.Module):
    """An `nn.Embedding` whose ids are made contiguous before the lookup (the same table and
    parameters): Opacus 1.6's ghost-clipping norm of an embedding calls `.view` on the ids it
    saw, which fails for an expanded position index (`torch.arange(L).expand(B, L)`)."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids.contiguous())


def contiguous_ids(model: nn.Module) -> list[str]:
    """Wrap every `nn.Embedding` of the dense module in `ContiguousIds`; the names wrapped."""
    names = []
    for parent_name, parent in list(model.dense_module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Embedding:
                setattr(parent, child_name, ContiguousIds(child))
                names.append(f"{parent_name}.{child_name}".lstrip("."))
    return names


def grad_sample_bytes(model: nn.Module, batch: int) -> int:
    return 4 * batch * sum(p.numel() for p in model.parameters())


def opacus_step(case, inputs, labels, loader, mode: str, fix_ids: bool = False) -> Callable[[], None]:
    """Opacus make_private (fixed batches: poisson_sampling=False), σ = SIGMA, clip CLIP, SGD;
    `fix_ids`: the dense module's embeddings wrapped in `ContiguousIds` first."""
    from opacus import PrivacyEngine

    model, _ = plain_model(case)
    if fix_ids:
        contiguous_ids(model)
    B = int(labels.shape[0])
    if mode == "hooks":
        need, avail = grad_sample_bytes(model, B), mem_info().get("MemAvailable", 0)
        if avail and 3 * need > avail:
            raise MemoryError(f"skipped: the per-sample gradients would take {need / 2**30:.1f} GiB "
                              f"([B = {B}] × {sum(p.numel() for p in model.parameters()):,} parameters, fp32), "
                              f"more than a third of the {avail / 2**30:.1f} GiB available")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = Criterion(case["loss"])
    engine = PrivacyEngine()
    if mode == "ghost":
        wrapped, dp_opt, dp_loss, _ = engine.make_private(module=model, optimizer=opt, criterion=criterion,
                                                          data_loader=loader, noise_multiplier=SIGMA,
                                                          max_grad_norm=CLIP, poisson_sampling=False,
                                                          grad_sample_mode="ghost")
    else:
        wrapped, dp_opt, _ = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                 noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
                                                 grad_sample_mode="hooks")
        dp_loss = criterion

    def step():
        dp_opt.zero_grad(set_to_none=True)
        dp_loss(wrapped(*inputs), labels).backward()
        dp_opt.step()
    return step


class WidedpStep:
    """An open `widedp.make_private` trainer; calling it takes one `trainer.step()`."""

    def __init__(self, case, mode: str, batch: int, steps: int):
        import widedp

        modules, dense = case["build"](0)
        self._ctx = widedp.make_private(modules, dense, case["loss"], case["train"], mode=mode, target_epsilon=8.0,
                                        batch_size=batch, steps=steps, config=case["widedp_settings"](mode, 0),
                                        **case["widedp_kwargs"])
        self.trainer = self._ctx.__enter__()

    def __call__(self):
        if self.trainer.step() is None:
            raise RuntimeError("widedp stopped before the planned steps")

    def close(self):
        self._ctx.__exit__(None, None, None)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:400]


def measure(case, args) -> dict:
    """Every system's step time (ms) on the case, taken in turn within each round."""
    from torch.utils.data import DataLoader, TensorDataset

    train = case["train"]
    B = min(args.batch, len(train))
    probe, probe_modules = plain_model(case)
    check = twin_check(probe, probe_modules, case["test"], case["seq"])
    print(f"  the plain twin's outputs on the {check['examples']:,} test examples equal the TorchRec path's "
          f"(max |diff| {check['max_abs_diff']:.2g})", flush=True)
    data = tensors_of(probe, train)
    idx = torch.from_numpy(np.random.default_rng(0).choice(len(train), B, replace=False))
    fixed = [t[idx] for t in data]
    inputs, labels = fixed[:-1], fixed[-1]
    loader = DataLoader(TensorDataset(*data), batch_size=B, shuffle=True)
    row: dict = {"example": case["name"], "batch": B, "examples": {"train": len(train), "test": len(case["test"])},
                 "sizes": case["sizes"], "data": case["data_note"],
                 "tables": {name: list(t.weight.shape) for name, t in probe.tables.items()},
                 "parameters": {"tables": sum(t.weight.numel() for t in probe.tables.values()),
                                "dense": sum(p.numel() for p in probe.dense_module.parameters())},
                 "widths": {"sequences": case["seq"], "bags": case["bags"]}, "twin_check": check}
    steps_by: dict = {}
    errors: dict = {}
    as_written: dict = {}  # what failed on the model as the example wrote it
    fixes: dict = {}  # and what was changed for it to run
    closers = []
    planned = args.warmup + args.timing_steps + 2
    for system in SYSTEMS:
        if system == "opacus-hooks" and args.no_hooks:
            errors[system] = "not run (--no-hooks)"
            continue
        t0 = time.perf_counter()
        try:
            if system == "floor":
                step = floor_step(case, inputs, labels)
            elif system.startswith("opacus"):
                mode = system.split("-")[1]
                try:
                    step = opacus_step(case, inputs, labels, loader, mode)
                    step()
                except Exception as exc:  # the model as written failed: once more with contiguous ids
                    if mode != "ghost":
                        raise
                    as_written[system] = _error(exc)
                    print(f"  {system} on the model as written: {as_written[system]}; again with the dense "
                          "module's embedding ids made contiguous", flush=True)
                    step = opacus_step(case, inputs, labels, loader, mode, fix_ids=True)
                    fixes[system] = ("the dense module's nn.Embedding layers wrapped to make their ids contiguous "
                                     "(the same tables and parameters)")
            else:
                step = WidedpStep(case, system.split("-")[1], B, planned)
                closers.append(step)
            step()  # a first call: catches what fails only when run
            steps_by[system] = step
        except Exception as exc:  # an Opacus (or widedp) failure is a result, not a crash
            if system == "floor":
                raise
            errors[system] = _error(exc)
            print(f"  {system} could not run: {errors[system]}", flush=True)
        print(f"  {system}: set up and first step in {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict = {s: [] for s in steps_by}
    for i in range(args.warmup + args.timing_steps - 1):  # the first call above was warm-up step 1
        for system, step in list(steps_by.items()):
            t0 = time.perf_counter()
            try:
                step()
            except Exception as exc:
                errors[system] = _error(exc)
                steps_by.pop(system)
                times.pop(system)
                continue
            if i >= args.warmup - 1:
                times[system].append(1e3 * (time.perf_counter() - t0))
    for c in closers:
        c.close()
    row["step_ms"] = {s: statistics.median(t) for s, t in times.items() if t}
    row["step_ms_min"] = {s: min(t) for s, t in times.items() if t}
    row["errors"] = errors
    row["as_written_errors"], row["workarounds"] = as_written, fixes
    floor = row["step_ms"]["floor"]
    row["ratios"] = {s: ms / floor for s, ms in row["step_ms"].items()}
    return row


#: the utility runs' steps per example without --steps: the examples' own full size
#: (benchmarks/own_model.py: FULL_ARGS' 300 for the click logs, LM_ARGS' 500 for the LM)
UTILITY_STEPS = {"transformer_lm": 500}
UTILITY_STEPS_DEFAULT = 300


def utility_steps(case, args) -> int:
    return int(args.steps or UTILITY_STEPS.get(case["name"], UTILITY_STEPS_DEFAULT))


def widedp_utility(case, args, mode: str) -> dict:
    """widedp's `make_private` on the same model, data, batch, steps and ε as Opacus's utility
    run (example level, no recalibration: the same release), held out by the same metric."""
    import widedp

    modules, dense = case["build"](0)
    B = min(args.batch, len(case["train"]))
    steps = utility_steps(case, args)
    t0 = time.perf_counter()
    with widedp.make_private(modules, dense, case["loss"], case["train"], mode=mode, target_epsilon=UTILITY_EPSILON,
                             batch_size=B, steps=steps, config=case["widedp_settings"](mode, 0),
                             **case["widedp_kwargs"]) as trainer:
        taken = trainer.train()
        epsilon, delta = trainer.epsilon(), float(trainer.privacy.delta)
        state = trainer.embedding_state_dict()
    seconds = time.perf_counter() - t0
    for module in modules:
        module.load_state_dict({k: state[k] for k in module.state_dict()})
    metrics = case["evaluate"](PlainModel(modules, dense, case["seq"], case["bags"]), modules)
    return {"system": f"widedp-{mode}", "target_epsilon": UTILITY_EPSILON, "epsilon": epsilon, "delta": delta,
            "steps": taken, "expected_batch": B, "train_seconds": seconds, "metrics": metrics}


def utility(case, args, fix_ids: bool = False) -> dict:
    """Opacus make_private_with_epsilon at ε = 8, Poisson sampling, ghost clipping, the
    example's full-size steps; the example's held-out metric from the trained tables."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    train = case["train"]
    B = min(args.batch, len(train))
    plain, modules = plain_model(case)
    fixed = contiguous_ids(plain) if fix_ids else []
    data = tensors_of(plain, train)
    loader = DataLoader(TensorDataset(*data), batch_size=B, shuffle=True)
    o = case["utility_optim"]
    groups = [{"params": list(plain.tables.parameters()), "lr": o["lr"]},
              {"params": list(plain.dense_module.parameters()), "lr": o["dense_lr"]}]
    opt = torch.optim.Adam(groups) if o["optimizer"] == "adam" else torch.optim.SGD(groups)
    n = len(train)
    delta = delta_of(n)
    engine = PrivacyEngine()
    steps = utility_steps(case, args)
    epochs = (steps + 0.5) / len(loader)  # int(epochs / sample_rate) = the planned steps
    wrapped, dp_opt, dp_loss, dp_loader = engine.make_private_with_epsilon(
        module=plain, optimizer=opt, criterion=Criterion(case["loss"]), data_loader=loader,
        target_epsilon=UTILITY_EPSILON, target_delta=delta, epochs=epochs, max_grad_norm=o["clip"],
        poisson_sampling=True, grad_sample_mode="ghost")
    taken, t0 = 0, time.perf_counter()
    while taken < steps:
        for batch in dp_loader:
            if taken >= steps:
                break
            dp_opt.zero_grad(set_to_none=True)
            dp_loss(wrapped(*batch[:-1]), batch[-1]).backward()
            dp_opt.step()
            taken += 1
    seconds = time.perf_counter() - t0
    metrics = case["evaluate"](plain, modules)
    return {"system": "opacus-ghost", "contiguous_ids": fixed, "target_epsilon": UTILITY_EPSILON,
            "epsilon": float(engine.get_epsilon(delta)),
            "delta": delta, "sigma": float(dp_opt.noise_multiplier), "steps": taken, "expected_batch": B,
            "sample_rate": 1 / len(loader), "clip": o["clip"], "optimizer": o["optimizer"], "lr": o["lr"],
            "dense_lr": o["dense_lr"], "train_seconds": seconds, "metrics": metrics}


# ---- RESULTS ---------------------------------------------------------------------------------------------

def _x(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _ms(v: Optional[float]) -> str:
    return "–" if v is None else (f"{v:.1f}" if v < 100 else f"{v:,.0f}")


NAMES = {"sasrec_sequential": "SASRec-style ranker (`examples/sasrec_sequential.py`)",
         "dcn_ranking": "DCN-v2 ranker (`examples/dcn_ranking.py`)",
         "two_tower_retrieval": "two-tower retrieval model (`examples/two_tower_retrieval.py`)",
         "transformer_lm": "transformer LM (`examples/transformer_lm.py`)"}
METRICS = {"auc": "click AUC", "hit@10": "hit-rate@10", "ndcg@10": "NDCG@10", "recall@10": "recall@10",
           "perplexity": "perplexity (full softmax)"}


def speed_goal(doc: dict) -> Optional[tuple]:
    """The one goal row: widedp's sparse step faster than Opacus ghost clipping on the LM
    (Opacus ghost / widedp sparse > 1), from the medians of one run."""
    r = doc.get("rows", {}).get("transformer_lm")
    if not r or "widedp-sparse" not in r["step_ms"] or "opacus-ghost" not in r["step_ms"]:
        return None
    ms = r["step_ms"]
    ratio = ms["opacus-ghost"] / ms["widedp-sparse"]
    why = (f"{_ms(ms['widedp-sparse'])} ms against {_ms(ms['opacus-ghost'])} ms a step at B = {r['batch']:,}, "
           f"{r['parameters']['tables']:,} table parameters (the floor: {_ms(ms['floor'])} ms); Opacus noises every "
           "row of every table")
    return ("widedp sparse step faster than Opacus ghost clipping on the transformer LM",
            f"Opacus ghost / widedp sparse = {ratio:.2f}×", "**met**" if ratio > 1.0 else "**missed**", why)


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section (benchmarks/make_results.py): per example the median step time
    and its ratio to the floor for each system, what Opacus could not run, the Opacus utility
    run; one goal row."""
    s = doc["setting"]
    rows = doc["rows"]
    names = [n for n in EXAMPLES if n in rows] + [n for n in rows if n not in EXAMPLES]
    clicks = [n for n in names if n in CLICK_LOG_EXAMPLES]
    user_level = ("" if not clicks else
                  f"The click-log example{'s' if len(clicks) > 1 else ''} "
                  f"({', '.join(NAMES.get(n, n).split(' (')[0] for n in clicks)}) "
                  f"{'train' if len(clicks) > 1 else 'trains'} at user level (64 expected users a step); "
                  "here every system takes examples, B of them a step. ")
    lines = ["The own-model examples' models in plain PyTorch — the example's tables as `nn.Embedding`, its dense "
             "module unchanged, the lookups in `forward` from padded ids and masks (a sequence's first L ids, zeros "
             "after; a bag the sum or mean of its rows, as its config says; one lookup per table, a shared table's "
             "features side by side) — under Opacus " + str(s.get("opacus_version", ""))
             + " `make_private`, beside `widedp.make_private` on the same example and the non-private floor. Median of "
             f"{s['timing_steps']} steps after {s['warmup']} warm-up, the systems in turn within each round, one "
             "process. *Floor*: forward, mean loss, backward, SGD step. Opacus: noise multiplier "
             f"{s['sigma']:g}, max_grad_norm {s['clip']:g}, SGD, **fixed batches** (poisson_sampling=False, for "
             "timing); ghost clipping (two backward passes) and hooks (per-sample gradients materialized). widedp: "
             "the example's settings, example-level privacy, Poisson-sampled batches of the same expected size, "
             "`trainer.step()` timed. " + user_level + "Opacus's DP-SGD noises every row of every table "
             "each step, as widedp's DP-SGD does; widedp's sparse mode noises only the privately selected rows. "
             f"torch threads: {s.get('torch_threads', '–')}.", ""]
    for name in names:
        r = rows[name]
        ms, x = r["step_ms"], r["ratios"]
        p = r["parameters"]
        tables = ", ".join(f"{t} [{a:,} × {b}]" for t, (a, b) in r["tables"].items())
        lines += [f"**{NAMES.get(name, name)}**: {r['data']}; {r['examples']['train']:,} training examples, "
                  f"B = {r['batch']:,}; tables {tables}: {p['tables']:,} table parameters, {p['dense']:,} dense."]
        c = r.get("twin_check")
        if c:
            lines[-1] += (f" The plain twin's outputs on the {c['examples']:,} test examples equal the TorchRec "
                          f"path's (max |diff| {c['max_abs_diff']:.2g}).")
        lines += ["", "| system | ms / step | / floor |", "|---|---:|---:|"]
        for system in SYSTEMS:
            if system in ms:
                lines.append(f"| {LABELS[system]} | {_ms(ms[system])} | {_x(x.get(system))} |")
            elif system in r.get("errors", {}):
                lines.append(f"| {LABELS[system]} | – | – (see below) |")
        errs = r.get("errors", {})
        if errs:
            lines += [""] + [f"- {LABELS.get(k, k)} could not run: `{v}`" for k, v in errs.items()]
        for system, e in r.get("as_written_errors", {}).items():
            lines += ["", f"{LABELS.get(system, system)} failed on the model as the example wrote it: `{e}` — "
                      "Opacus's `nn.Embedding` norm sampler calls `.view(-1, 1)` on the ids it saw, and the dense "
                      "module's position lookup passes `torch.arange(L).expand(B, L)`, which is not contiguous. "
                      + (f"Timed (and the utility run trained) with {r['workarounds'][system]}."
                         if system in r.get("workarounds", {}) else "")]
        if name == "transformer_lm":
            lines += ["", f"The LM has {p['tables'] + p['dense']:,} parameters, {p['tables']:,} of them in its three "
                      "tables; Opacus's DP-SGD adds noise to all of them every step — every row of every table, "
                      "whichever rows the batch touched."]
        u = r.get("utility")
        if u and "metrics" in u:
            cells = ", ".join(f"{METRICS.get(k, k)} {v:.3f}" if k != "perplexity" else f"{METRICS[k]} {v:,.1f}"
                              for k, v in u["metrics"].items())
            lines += ["", f"Opacus utility run (ghost clipping, `make_private_with_epsilon`, **Poisson sampling on**): "
                      f"ε = {u['epsilon']:.2f} at δ = {u['delta']:.2g} (target {u['target_epsilon']:g}), σ = "
                      f"{u['sigma']:.3g}, {u['steps']:,} steps at expected batch {u['expected_batch']:,}, clip "
                      f"{u['clip']:g}, {u['optimizer']} lr {u['lr']:g} (tables) / {u['dense_lr']:g} (dense) — the "
                      f"example's DP-SGD settings, not tuned for Opacus: held out, {cells}."]
        elif u and "error" in u:
            lines += ["", f"Opacus utility run could not run: `{u['error']}`"]
        w = r.get("widedp_utility") or {}
        done = {m: x for m, x in w.items() if "metrics" in x}
        if done:
            parts = []
            for mode, x in done.items():
                cells = ", ".join(f"{METRICS.get(k, k)} {v:.3f}" if k != "perplexity" else f"{METRICS[k]} {v:,.1f}"
                                  for k, v in x["metrics"].items())
                parts.append(f"{'sparse' if mode == 'sparse' else 'DP-SGD'} {cells} (ε = {x['epsilon']:.2f}, "
                             f"{x['steps']:,} steps)")
            lines += ["", "widedp on the same model, data, expected batch, steps and target ε (example level, no "
                      "recalibration): " + "; ".join(parts) + "."]
        for mode, x in w.items():
            if "error" in x:
                lines += ["", f"widedp {mode} utility run could not run: `{x['error']}`"]
        lines.append("")
    goal = speed_goal(doc)
    return lines, [goal] if goal else []


# ---- main --------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="200 users / 2 days, the LM on synthetic text (600 words), B = 64, 1 + 3 timed steps, "
                             "5 utility steps")
    parser.add_argument("--examples", default=",".join(EXAMPLES),
                        help=f"comma-separated, of {', '.join(EXAMPLES)} (default: all)")
    parser.add_argument("--batch", type=int, default=None, help="examples per step (default 256; --quick 64)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 3; --quick 1)")
    parser.add_argument("--timing-steps", type=int, default=None, help="timed rounds (default 20; --quick 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="utility-run steps (default: the example's full-size steps, 300 for the click-log "
                             "examples and 500 for the LM; --quick 5)")
    parser.add_argument("--no-hooks", action="store_true", help="skip Opacus's hooks mode")
    parser.add_argument("--no-utility", action="store_true", help="skip the Opacus utility runs")
    parser.add_argument("--users", type=int, default=None,
                        help="SASRec, DCN, two-tower: users of the click logs (default 3000)")
    parser.add_argument("--days", type=int, default=None,
                        help="SASRec, DCN, two-tower: days of the click logs (default 4)")
    parser.add_argument("--data", default="",
                        help="SASRec, DCN, two-tower: where the logs go (default: cached under runs/bench_data)")
    parser.add_argument("--corpus", default="", help="LM: a text file (default: benchmarks/text_large.py's corpus)")
    parser.add_argument("--vocab-file", default="", help="LM: the public vocabulary file")
    parser.add_argument("--vocab", type=int, default=None, help="LM: vocabulary size (default 50000; --quick 600)")
    parser.add_argument("--test-lines", type=int, default=None, help="LM: held-out lines (default 3000; --quick 100)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); 1 on a machine busy with other work")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    args.batch = args.batch or (64 if q else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    args.warmup = max(1, args.warmup)
    args.timing_steps = args.timing_steps or (3 if q else 20)
    args.steps = args.steps or (5 if q else None)
    args.users, args.days = args.users or (200 if q else 3000), args.days or (2 if q else 4)
    args.vocab, args.test_lines = args.vocab or (600 if q else 50000), args.test_lines or (100 if q else 3000)
    names = args.examples.split(",")
    unknown = set(names) - set(EXAMPLES)
    if unknown:
        parser.error(f"--examples: unknown {sorted(unknown)} (choose from {', '.join(EXAMPLES)})")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    started = time.time()
    machine = announce_machine()
    import opacus

    rows = {}
    for name in names:
        t0 = time.perf_counter()
        print(f"{name}: building the data", flush=True)
        case = CASES[name](args)
        print(f"{name}: {len(case['train']):,} training examples ({time.perf_counter() - t0:.1f} s)", flush=True)
        row = measure(case, args)
        if not args.no_utility:
            try:
                row["utility"] = utility(case, args, fix_ids="opacus-ghost" in row["workarounds"])
            except Exception as exc:
                row["utility"] = {"error": _error(exc)}
            print(f"{name}: Opacus utility run {row['utility']}", flush=True)
            row["widedp_utility"] = {}
            for mode in ("sparse", "dpsgd"):
                try:
                    row["widedp_utility"][mode] = widedp_utility(case, args, mode)
                except Exception as exc:
                    row["widedp_utility"][mode] = {"error": _error(exc)}
                print(f"{name}: widedp {mode} utility run {row['widedp_utility'][mode]}", flush=True)
        row["seconds"] = time.perf_counter() - t0
        rows[name] = row
        print(format_table(["system", "ms/step", "/ floor"],
                           [[LABELS[s], row["step_ms"][s], _x(row["ratios"][s])] for s in SYSTEMS
                            if s in row["step_ms"]]), flush=True)
        if name == "transformer_lm":
            p = row["parameters"]
            print(f"{name}: {p['tables'] + p['dense']:,} parameters ({p['tables']:,} in the tables); Opacus's "
                  "DP-SGD noises every row of every table each step", flush=True)
        print(flush=True)
    setting = {"batch": args.batch, "warmup": args.warmup, "timing_steps": args.timing_steps,
               "utility_steps": args.steps or {**{n: UTILITY_STEPS_DEFAULT for n in names}, **UTILITY_STEPS}, "sigma": SIGMA, "clip": CLIP, "utility_epsilon": UTILITY_EPSILON,
               "opacus_poisson_sampling": {"timing": False, "utility": True}, "users": args.users, "days": args.days,
               "vocab": args.vocab, "test_lines": args.test_lines, "opacus_version": opacus.__version__,
               "torch_threads": torch.get_num_threads(),
               "examples": names}
    doc = {"setting": setting, "rows": rows}
    write_results("own_model_opacus", doc, quick=args.quick, machine=machine, out=args.out, started=started)
    for line in results_section(doc)[0]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
