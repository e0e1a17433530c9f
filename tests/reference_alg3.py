"""A slow, obvious reference implementation of one training step (seed Algorithm 3, at row
granularity) — the test oracle for trainer/engine/engine.py.

Everything is dense and in plain torch: the embedding tables are whole tensors, pooling is
done by indexing the tables with each bag's ids, per-example gradients come from a Python loop
of `torch.autograd.grad` over each example's loss (with respect to the *whole* tables and the
dense parameters, so repeated ids and rows shared by several features add up by autograd, not
by any bookkeeping of ours), the first clip is over the full per-example gradient, and the
update is written as `W[r] -= lr · Δ̃[r]` for the selected rows only.

Privacy semantics reproduced (docs/DESIGN.md §1): add/remove-one neighbours, sums normalized by the
expected batch size b; utility of a row for em / noisy-max / svt is min(‖G_r‖₂, S0) with
sensitivity min(S1/b, S0); threshold counts come from `selection.contribution_counts` over each
example's distinct global rows; the Gaussian noise std is σ·min(S1/b, 2·S2) (σ·S1/b without S2)
on the selected rows and on every dense parameter.

To be comparable bit-for-bit in its random choices, it takes the engine's streams from the
same reproducible root (`PrivacyRandomness.from_seed(seed)`): its selection rng, its noise
generator (draw order: the selected rows sorted by global id as one [k, D] draw, then each
dense parameter in `named_parameters` order), DP-SGD table noise
`row_block_normal(dpsgd_noise_key, "dpsgd", step, t, 0, V_t, D, std)`, tables
initialized with `row_block_normal(public_key(seed), "init", 0, t, 0, V_t, D, init_std)`.
Noise: the keyed Gaussian stream's next standard normals (float32) times std. The selectors
themselves are the library's (they have their own reference tests); they receive the scores
computed here.

The global row id of row r of table t is offset_t + r, tables concatenated in the order of
`ds.meta.table_sizes`.

User level (`example_units`: a unit per example of `ds`): the unit's gradient is the sum of its
step examples' autograd gradients (a Python sum of whole-table gradients), clipped as one
vector; the count selectors count each unit's distinct rows once; DP-FEST counts each unit's
rows (its examples' rows in example order) as one example's.

Per-table policy (sparse mode, `dense_tables`): a dense table is treated exactly as DP-SGD treats
every table (all its rows get G + the DP-SGD table noise, in the S2 norm); the selectors see
only the rows of the other tables, numbered 0, 1, ... in global-id order (a Python list here).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import numpy as np
import torch

from widedp import selection
from widedp.trainer.engine.layout import public_key, row_block_normal
from widedp.trainer.engine.randomness import PrivacyRandomness



class ReferenceAlg3:
    def __init__(self, ds, model: torch.nn.Module, *, mode: str, plan=None, expected_batch_size: float,
                 lr: float, dense_lr: float, seed: int, dim: int, init_std: float, dense_tables=(),
                 ema_decay: float = 0.0, example_units=None):
        """`model` is copied (pass the engine's dense model before it takes a step, or an
        identically initialized one); `plan` is a trainer.engine.PrivacyPlan (None for
        nonprivate). `ema_decay` β > 0: also keep ema = β·ema + (1-β)·w of every row of every
        table and every dense parameter after each step, the obvious dense way (`averaged_state`)."""
        if mode not in ("sparse", "dpsgd", "nonprivate"):
            raise ValueError(mode)
        self.ds, self.mode, self.plan = ds, mode, plan
        self.example_units = None if example_units is None else [int(u) for u in example_units]
        self.b, self.lr, self.dense_lr, self.seed, self.dim = float(expected_batch_size), lr, dense_lr, seed, dim
        self.model = copy.deepcopy(model)
        meta = ds.meta
        self.table_names = list(meta.table_sizes)
        self.table_rows = [int(meta.table_sizes[t]) for t in self.table_names]
        self.offsets = np.concatenate([[0], np.cumsum(self.table_rows)]).astype(np.int64)
        self.V = int(self.offsets[-1])
        self.features = list(meta.features)
        self.feature_table = [self.table_names.index(meta.feature_tables[f]) for f in self.features]
        self.tables = [row_block_normal(public_key(seed), "init", 0, t, 0, rows, dim, init_std).clone()
                       for t, rows in enumerate(self.table_rows)]
        randomness = PrivacyRandomness.from_seed(seed)
        self.selection_rng = randomness.selection_rng()
        self.noise_gen = randomness.noise_generator()
        self.dpsgd_key = randomness.dpsgd_noise_key()
        self.step_count = 0
        self.ema_decay = ema_decay
        self.ema = self.state() if ema_decay > 0 else None
        self.fixed_rows: Optional[np.ndarray] = None
        all_tables = list(range(len(self.table_rows)))
        self.dense_tables = {"dpsgd": all_tables, "nonprivate": []}.get(mode, sorted(dense_tables))
        # The selectors' rows: every row of the sparse tables, position = the selector's id.
        self.candidates = [int(self.offsets[t] + r) for t in all_tables if t not in self.dense_tables
                           for r in range(self.table_rows[t])]
        self.candidate_index = {g: i for i, g in enumerate(self.candidates)}

    # ---- the model, one example at a time ------------------------------------------------------
    def example_loss(self, i: int, tables: list[torch.Tensor]) -> torch.Tensor:
        pooled = []
        for f, t in zip(self.features, self.feature_table):
            ids = torch.tensor(self.ds.bags[f][i], dtype=torch.int64)
            rows = tables[t][ids]  # [n, D] (n = 0 for an empty bag)
            if ids.numel() == 0:
                pooled.append(torch.zeros(self.dim))
            elif self.ds.meta.pooling[f] == "mean":
                pooled.append(rows.mean(0))
            else:
                pooled.append(rows.sum(0))
        pooled = torch.stack(pooled).unsqueeze(0)  # [1, F, D]
        dense = torch.from_numpy(np.asarray(self.ds.dense[i], dtype=np.float32)).reshape(1, -1)
        label = torch.tensor([float(self.ds.labels[i])])
        return self.model.loss(self.model(pooled, dense), label).sum()

    def example_grad(self, i: int):
        """(per-table gradients [V_t, D] float64, {dense name: gradient float64}, loss) of example i."""
        leaves = [w.detach().clone().requires_grad_(True) for w in self.tables]
        names = [n for n, _ in self.model.named_parameters()]
        params = [p for _, p in self.model.named_parameters()]
        loss = self.example_loss(i, leaves)
        grads = torch.autograd.grad(loss, leaves + params, allow_unused=True)
        full = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves + params)]
        table_grads = [g.double() for g in full[: len(leaves)]]
        dense_grads = {n: g.double() for n, g in zip(names, full[len(leaves):])}
        return table_grads, dense_grads, float(loss.detach())

    def example_sq_norms(self, indices):
        """Per-example squared ℓ2 norms: (embedding part [B], dense part [B]), by autograd."""
        emb, dense = [], []
        for i in indices:
            tg, dg, _ = self.example_grad(int(i))
            emb.append(sum(float((g ** 2).sum()) for g in tg))
            dense.append(sum(float((g ** 2).sum()) for g in dg.values()))
        return np.array(emb), np.array(dense)

    def example_global_rows(self, i: int) -> list[int]:
        """Example i's global row ids in feature order (repeats kept)."""
        return [int(self.offsets[t] + r) for f, t in zip(self.features, self.feature_table) for r in self.ds.bags[f][i]]

    def groups(self, indices) -> list[list[int]]:
        """The step's contributors: one example each, or (user level) each unit's examples
        among `indices`, units in increasing order, examples in index order."""
        if self.example_units is None:
            return [[int(i)] for i in indices]
        by_unit: dict[int, list[int]] = {}
        for i in sorted(int(i) for i in indices):
            by_unit.setdefault(self.example_units[i], []).append(i)
        return [by_unit[u] for u in sorted(by_unit)]

    def group_global_rows(self, group) -> list[int]:
        return [r for i in group for r in self.example_global_rows(i)]

    # ---- DP-FEST: the one-time selection -----------------------------------------------------------
    def prepare_fest(self) -> None:
        n = len(self.ds.labels)
        rows = [[self.candidate_index[r] for r in self.group_global_rows(g) if r in self.candidate_index]
                for g in self.groups(range(n))]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        ids = np.array([r for ex in rows for r in ex], dtype=np.int64)
        sp = self.plan.selection_params
        sigma = sp.fest_noise_multiplier if self.plan.selection == "fest-threshold" else sp.noise_multiplier
        self.fixed_rows = selection.fest_top_k(offsets, ids, len(self.candidates), sp.k, sigma,
                                               sp.max_rows_per_example, self.selection_rng).ids

    # ---- one step -------------------------------------------------------------------------------
    def step(self, indices, lr_scale: float = 1.0) -> dict:
        """One step on the examples `indices`, with learning rates lr·lr_scale and dense_lr·lr_scale."""
        indices = [int(i) for i in np.asarray(indices).reshape(-1)]
        lr, dense_lr = self.lr * lr_scale, self.dense_lr * lr_scale
        private = self.mode != "nonprivate"
        p = self.plan
        per_example = [self.example_grad(i) for i in indices]
        losses = [loss for _, _, loss in per_example]
        if self.example_units is not None:  # user level: each unit's summed gradient is one contribution
            grads = {i: g for i, g in zip(indices, per_example)}
            per_example = [([sum(grads[i][0][t] for i in group) for t in range(len(self.tables))],
                            {n: sum(grads[i][1][n] for i in group) for n in grads[group[0]][1]}, 0.0)
                           for group in self.groups(indices)]

        # 1. first clip, over all embedding rows + dense params of each example (unit)
        norms, factors = [], []
        for tg, dg, _ in per_example:
            norm = math.sqrt(sum(float((g ** 2).sum()) for g in tg) + sum(float((g ** 2).sum()) for g in dg.values()))
            norms.append(norm)
            factors.append(min(1.0, p.clip_norm / norm) if private and norm > 0 else 1.0)

        # 2. G = Σ_j ĝ_j / b
        G = [torch.zeros(rows, self.dim, dtype=torch.float64) for rows in self.table_rows]
        G_dense = {n: torch.zeros(q.shape, dtype=torch.float64) for n, q in self.model.named_parameters()}
        for (tg, dg, _), c in zip(per_example, factors):
            for t in range(len(G)):
                G[t] += c * tg[t]
            for n in G_dense:
                G_dense[n] += c * dg[n]
        G = [g / self.b for g in G]
        G_dense = {n: g / self.b for n, g in G_dense.items()}

        touched = sorted({r for i in indices for r in self.example_global_rows(i)})
        touched = np.array(touched, dtype=np.int64)

        # 3. selection (global row ids, sorted) over the sparse tables' rows; dpsgd: none (every
        # table is dense)
        if self.mode == "sparse" and self.candidates:
            chosen = self._select(indices, [r for r in touched if r in self.candidate_index], G)
            selected = np.unique(np.array([self.candidates[int(c)] for c in chosen], dtype=np.int64))
        elif self.mode == "nonprivate":
            selected = touched
        else:
            selected = np.zeros(0, dtype=np.int64)

        # 4. Δ = G ⊙ M, second clip (over Δ, the dense tables' G and the dense params), noise
        delta = torch.stack([self._row(G, r) for r in selected]) if selected.size else torch.zeros(0, self.dim, dtype=torch.float64)
        delta_sq = float((delta ** 2).sum()) + sum(float((G[t] ** 2).sum()) for t in self.dense_tables)
        scale, std = 1.0, 0.0
        if private:
            s2 = p.second_clip_norm
            if s2:
                total = math.sqrt(delta_sq + sum(float((g ** 2).sum()) for g in G_dense.values()))
                scale = min(1.0, s2 / total) if total > 0 else 1.0
            sensitivity = p.clip_norm / self.b if not s2 else min(p.clip_norm / self.b, 2.0 * s2)
            std = p.noise_multiplier * sensitivity

        noisy = (delta * scale).float()
        if private:
            noisy = noisy + self.noise_gen.standard_normal(noisy.numel()).view(noisy.shape) * std
        with torch.no_grad():
            for r, row in zip(selected, noisy):
                t, local = self._table_of(r)
                self.tables[t][local] -= lr * row
            for t in self.dense_tables:  # every row of a dense table (dpsgd: of every table)
                noise = row_block_normal(self.dpsgd_key, "dpsgd", self.step_count, t, 0, self.table_rows[t], self.dim, std)
                self.tables[t] -= lr * ((G[t] * scale).float() + noise)

        with torch.no_grad():
            for n, param in self.model.named_parameters():
                g = (G_dense[n] * scale).float()
                if private:
                    g = g + self.noise_gen.standard_normal(g.numel()).view(g.shape) * std
                param -= dense_lr * g
        self.step_count += 1
        if self.ema is not None:
            beta = self.ema_decay
            for part_ema, part_now in zip(self.ema, self.state()):
                for name in part_ema:
                    part_ema[name] = beta * part_ema[name] + (1 - beta) * part_now[name]
        rows_noised = selected.size + sum(self.table_rows[t] for t in self.dense_tables)
        return {"selected": selected, "rows_noised": rows_noised, "touched": touched, "norms": np.array(norms), "factors": np.array(factors),
                "scale": scale, "std": std, "G": G, "losses": losses}

    def _table_of(self, r: int) -> tuple[int, int]:
        t = int(np.searchsorted(self.offsets, r, side="right") - 1)
        return t, int(r - self.offsets[t])

    def _row(self, G, r: int) -> torch.Tensor:
        t, local = self._table_of(r)
        return G[t][local]

    def _select(self, indices, touched, G) -> np.ndarray:
        """The selector's choice among the candidates (positions in `self.candidates`);
        `touched`: the touched candidate rows (global ids)."""
        p, rng, V = self.plan, self.selection_rng, len(self.candidates)
        sp = p.selection_params  # the selector's own Params (selection.selectors.*)
        cand = self.candidate_index
        if p.selection == "random":
            return selection.random_rows(V, sp.k, rng).ids
        if p.selection == "fest":
            return self.fixed_rows
        if p.selection in ("threshold", "fest-threshold"):
            distinct = [sorted({cand[r] for r in self.group_global_rows(g) if r in cand}) for g in self.groups(indices)]
            offsets = np.concatenate([[0], np.cumsum([len(d) for d in distinct])]).astype(np.int64)
            ids = np.array([r for d in distinct for r in d], dtype=np.int64)
            rows, counts = selection.contribution_counts(offsets, ids, sp.contribution_clip, V)
            passed = selection.gaussian_threshold(rows, counts, V, sp.threshold, sp.noise_multiplier,
                                                  sp.contribution_clip, rng).ids
            return np.union1d(self.fixed_rows, passed) if p.selection == "fest-threshold" else passed
        if p.selection in ("em-count", "noisy-max-count"):
            # utility: how many of the batch's examples touch the row (sensitivity 1)
            per_row: dict[int, int] = {}
            for g in self.groups(indices):
                for r in {cand[r] for r in self.group_global_rows(g) if r in cand}:
                    per_row[r] = per_row.get(r, 0) + 1
            rows = np.array(sorted(per_row), dtype=np.int64)
            counts = np.array([float(per_row[r]) for r in rows])
            mechanism = selection.exponential_top_k if p.selection == "em-count" else selection.noisy_max_top_k
            return mechanism(rows, counts, V, sp.k, sp.epsilon_per_draw, 1.0, rng).ids
        scores = np.array([min(float(torch.linalg.vector_norm(self._row(G, r))), sp.score_clip) for r in touched])
        sensitivity = min(p.clip_norm / self.b, sp.score_clip)
        touched = np.array([cand[r] for r in touched], dtype=np.int64)
        if p.selection == "em":
            return selection.exponential_top_k(touched, scores, V, sp.k, sp.epsilon_per_draw, sensitivity, rng).ids
        if p.selection == "noisy-max":
            return selection.noisy_max_top_k(touched, scores, V, sp.k, sp.epsilon_per_draw, sensitivity, rng).ids
        if p.selection == "svt":
            return selection.numeric_sparse(touched, scores, V, sp.threshold, sp.max_answers, sp.epsilon,
                                            sp.delta, sensitivity, rng, release_values=False).ids
        raise ValueError(f"unknown selection {p.selection!r}")

    # ---- read-out ---------------------------------------------------------------------------------
    def averaged_state(self):
        """Like `state()`, for the moving average of the iterates."""
        assert self.ema is not None, "built without ema_decay"
        return tuple({n: v.clone() for n, v in part.items()} for part in self.ema)

    def state(self) -> dict:
        """{table name: [V_t, D]} and {dense param name: tensor}, detached copies."""
        return ({n: w.detach().clone() for n, w in zip(self.table_names, self.tables)},
                {n: q.detach().clone() for n, q in self.model.named_parameters()})
