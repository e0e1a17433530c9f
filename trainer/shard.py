"""One embedding shard: local compute over the rows it owns (no Ray here).

Storage is FBGEMM's table-batched embedding (one TBE per table, one feature each: a table's
features are looked up together as bags). The shard computes partial pooled embeddings,
per-example partial squared gradient norms over the *unique* rows of each example (an id
repeated in a bag, or used by several features of one table, contributes the *sum* of its
gradients — the per-example gradient of that row), clipped per-row gradient sums, and applies
optimizer updates to given rows only.

Per-example row gradient (sum pooling with per-id weights w, mean pooling = w = 1/|bag|):
  ∂L_j/∂E[t, r] = Σ_{features f of table t} Σ_{i in bag(j, f), id_i = r} w_i · ∂L_j/∂pooled_{j,f}.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from trainer.layout import ShardInput, ShardLayout, row_block_normal

FUSED_OPTIMIZERS = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
OPTIMIZERS = ("sgd", "adagrad", "adam")
UPDATE_CHUNK = 1 << 16


def _device() -> tuple[torch.device, ComputeDevice, EmbeddingLocation]:
    if torch.cuda.is_available():  # the same code picks the CUDA build and device when present
        return torch.device("cuda"), ComputeDevice.CUDA, EmbeddingLocation.DEVICE
    return torch.device("cpu"), ComputeDevice.CPU, EmbeddingLocation.HOST


class EmbeddingShard:
    def __init__(self, layout: ShardLayout, shard_index: int, optimizer: str = "sgd", lr: float = 0.1,
                 seed: int = 0, init_std: float = 0.01, adam_betas=(0.9, 0.999), eps: float = 1e-8,
                 ema_decay: float = 0.0):
        """`ema_decay` β > 0 keeps an exponential moving average of every row's iterates
        (`averaged_weights`), updated lazily: only rows written in a step cost anything."""
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.layout, self.shard_index, self.optimizer, self.lr = layout, shard_index, optimizer, lr
        self.adam_betas, self.eps = adam_betas, eps
        self._current_lr = lr  # lr · the step's lr_scale (begin_update)
        self.device, compute, location = _device()
        self.ranges = [layout.row_range(t, shard_index) for t in layout.tables]
        self.feature_table = np.array([layout.table_index(f.table) for f in layout.features])
        self.table_features = [np.flatnonzero(self.feature_table == t) for t in range(len(layout.tables))]
        self.table_features_t = [torch.from_numpy(f) for f in self.table_features]
        self.feature_slot = np.zeros(len(layout.features), dtype=np.int64)  # position within its table
        for feats in self.table_features:
            self.feature_slot[feats] = np.arange(feats.size)
        self.max_rows = max(max(end - start for start, end in self.ranges), 1)
        self.tbes = []
        for t, (table, (start, end)) in enumerate(zip(layout.tables, self.ranges)):
            tbe = SplitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=[(max(end - start, 1), table.dim, location, compute)],
                optimizer=FUSED_OPTIMIZERS.get(optimizer, EmbOptimType.EXACT_SGD),
                learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM, feature_table_map=[0],
            )
            with torch.no_grad():
                init = row_block_normal(seed, "init", 0, t, start, end, table.dim, init_std)
                tbe.split_embedding_weights()[0][: end - start].copy_(init)
            self.tbes.append(tbe)
        self.adam_state = None
        if optimizer == "adam":
            self.adam_state = [
                {"m": torch.zeros_like(w), "v": torch.zeros_like(w), "t": torch.zeros(w.shape[0], dtype=torch.int64)}
                for w in (tbe.split_embedding_weights()[0] for tbe in self.tbes)
            ]
        self._cache: dict = {}
        # Parameter averaging (post-processing of the iterates). ema[t][r] is the EMA through
        # step ema_through[t][r]; row r's weight has not changed since then, so the EMA through
        # any later step T is β^n·ema + (1 - β^n)·w with n = T - ema_through (_ema_catch_up).
        self.ema_decay = float(ema_decay)
        self.step = 0  # the step whose update is being applied (begin_update), then the last one applied
        self.ema: Optional[list] = None
        if self.ema_decay > 0:
            self.ema = [self.weights(t).detach().clone() for t in range(len(self.tbes))]
            self.ema_through = [torch.zeros(w.shape[0], dtype=torch.int64, device=w.device) for w in self.ema]
        self._ema_current_at: Optional[int] = 0  # every row's EMA is through this step (None: not known)

    # ---- forward ------------------------------------------------------------------------------
    def weights(self, t: int) -> torch.Tensor:
        start, end = self.ranges[t]
        return self.tbes[t].split_embedding_weights()[0][: end - start]

    def lookup(self, inp: ShardInput, batch_size: int, averaged: bool = False) -> np.ndarray:
        """Partial pooled embeddings [B, F, D] from this shard's rows (zeros elsewhere); with
        `averaged`, from the averaged weights (evaluation only: no gradient cache is kept)."""
        n_feat, dim = len(self.layout.features), self.layout.dim
        out = torch.zeros((batch_size, n_feat, dim), dtype=torch.float32)
        tables = self.averaged_weights() if averaged else None
        if not averaged:
            self._cache = {"inp": inp, "batch_size": batch_size}
        if batch_size == 0 or inp.example.size == 0:
            return out.numpy()
        # One sort groups ids by table, then by bag (feature, example) — feature-major like a KJT.
        table = self.feature_table[inp.feature]
        order = np.lexsort((inp.example, inp.feature, table))
        table_sorted = table[order]
        bounds = np.searchsorted(table_sorted, np.arange(len(self.tbes) + 1))
        for t, tbe in enumerate(self.tbes):
            lo, hi = bounds[t], bounds[t + 1]
            if lo == hi:
                continue
            feats = self.table_features[t]
            sel = order[lo:hi]
            slot = self.feature_slot[inp.feature[sel]]
            bag = slot * batch_size + inp.example[sel]
            counts = np.bincount(bag, minlength=feats.size * batch_size)
            offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
            with torch.no_grad():
                ids, weights = torch.from_numpy(inp.local_id[sel]), torch.from_numpy(inp.weight[sel])
                if tables is None:
                    pooled = tbe(ids.to(self.device), offsets.to(self.device),
                                 per_sample_weights=weights.to(self.device))
                else:  # the same weighted sum pooling over the averaged table
                    dev = tables[t].device
                    pooled = torch.nn.functional.embedding_bag(ids.to(dev), tables[t], offsets.to(dev), mode="sum",
                                                               per_sample_weights=weights.float().to(dev),
                                                               include_last_offset=True)
            out.index_copy_(1, self.table_features_t[t], pooled.float().cpu().view(feats.size, batch_size, dim).transpose(0, 1))
        return out.numpy()

    # ---- per-example gradients ----------------------------------------------------------------
    def example_sq_norms(self, pooled_grad: np.ndarray) -> np.ndarray:
        """Per-example squared ℓ2 norms of this shard's part of each example's row gradients."""
        inp, batch_size = self._cache["inp"], self._cache["batch_size"]
        grad = torch.from_numpy(np.asarray(pooled_grad, dtype=np.float32))
        contrib = torch.from_numpy(inp.weight).unsqueeze(1) * grad[inp.example, inp.feature]  # [nnz, D]
        table = self.feature_table[inp.feature]
        # Group by (example, table, row): repeated ids add up before the norm is taken.
        n_tables = len(self.tbes)
        key = (inp.example * n_tables + table) * self.max_rows + inp.local_id
        uniq, group = np.unique(key, return_inverse=True)
        group = torch.from_numpy(group.astype(np.int64).reshape(-1))
        sums = torch.zeros((uniq.size, contrib.shape[1]), dtype=torch.float64).index_add_(0, group, contrib.double())
        sq = torch.zeros(batch_size, dtype=torch.float64).index_add_(
            0, torch.from_numpy(uniq // (n_tables * self.max_rows)), sums.pow(2).sum(1))
        self._cache.update(contrib=contrib, table=table)
        return sq.numpy()

    def clipped_row_sums(self, factors: np.ndarray):
        """Σ_j factor_j · ∂L_j/∂E[t, r] over the batch, for every touched (t, r) of this shard.

        Returns (table index [m], global row id [m], sums [m, D] float32)."""
        inp = self._cache["inp"]
        if "contrib" not in self._cache:  # nonprivate mode skips the norm pass
            raise RuntimeError("clipped_row_sums needs example_sq_norms (or set_pooled_grad) first")
        contrib, table = self._cache["contrib"], self._cache["table"]
        scaled = contrib.double() * torch.from_numpy(np.asarray(factors, dtype=np.float64))[inp.example].unsqueeze(1)
        if inp.example.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, self.layout.dim), np.float32)
        uniq, group = np.unique(table * self.max_rows + inp.local_id, return_inverse=True)
        group = torch.from_numpy(group.astype(np.int64).reshape(-1))
        sums = torch.zeros((uniq.size, scaled.shape[1]), dtype=torch.float64).index_add_(0, group, scaled)
        tables, local = uniq // self.max_rows, uniq % self.max_rows
        starts = np.array([start for start, _ in self.ranges], dtype=np.int64)
        return tables, local + starts[tables], sums.float().numpy()

    def set_pooled_grad(self, pooled_grad: np.ndarray) -> None:
        """Cache per-id contributions without computing norms (nonprivate mode)."""
        inp = self._cache["inp"]
        grad = torch.from_numpy(np.asarray(pooled_grad, dtype=np.float32))
        self._cache.update(contrib=torch.from_numpy(inp.weight).unsqueeze(1) * grad[inp.example, inp.feature],
                           table=self.feature_table[inp.feature])

    # ---- updates --------------------------------------------------------------------------------
    def begin_update(self, step: Optional[int], lr_scale: float) -> None:
        """The updates that follow are step `step`'s (1-based; needed when averaging), at
        learning rate lr · lr_scale (trainer/lr_schedule.py)."""
        if step is not None:
            self.step = int(step)
        elif self.ema is not None:
            raise ValueError("with ema_decay > 0 every update must say its step")
        self._ema_current_at = None
        lr = self.lr * float(lr_scale)
        if lr != self._current_lr:
            if self.optimizer in FUSED_OPTIMIZERS:
                for tbe in self.tbes:
                    tbe.set_learning_rate(lr)
            self._current_lr = lr

    def apply_rows(self, table_idx: np.ndarray, global_ids: np.ndarray, rows: np.ndarray,
                   lr_scale: float = 1.0, step: Optional[int] = None) -> None:
        """Apply the optimizer to the given rows only (update direction = `rows`, a gradient),
        with learning rate lr · lr_scale, as step `step` (for the averaged weights)."""
        self.begin_update(step, lr_scale)
        rows = torch.from_numpy(np.array(rows, dtype=np.float32))  # copy: Ray hands read-only arrays
        for t in np.unique(table_idx):
            sel = np.flatnonzero(table_idx == t)
            local = torch.from_numpy(global_ids[sel] - self.ranges[t][0])
            self._apply_table(int(t), local, rows[sel])
        self._cache = {}

    def apply_dense_noise_update(self, step: int, noise_seed: int, std: float, table_idx, global_ids, rows,
                                 secure: bool = False, tables=None, lr_scale: float = 1.0) -> None:
        """DP-SGD: every row of every table in `tables` (None: all) gets G + N(0, std²) (G = 0
        for untouched rows). The noise of row r depends only on (seed, step, table, r), not on
        the sharding nor on which other tables are dense. Learning rate lr · lr_scale; `step` is
        0-based (the engine's step count before the step), so this is step `step + 1`."""
        self.begin_update(step + 1, lr_scale)
        rows = np.asarray(rows, dtype=np.float32)
        for t, (start, end) in enumerate(self.ranges):
            if end <= start or (tables is not None and t not in tables):
                continue
            sel = np.flatnonzero(table_idx == t)
            for lo in range(start, end, UPDATE_CHUNK):
                hi = min(end, lo + UPDATE_CHUNK)
                update = row_block_normal(noise_seed, "dpsgd", step, t, lo, hi, self.layout.dim, std, secure)
                in_chunk = sel[(global_ids[sel] >= lo) & (global_ids[sel] < hi)]
                update[torch.from_numpy(global_ids[in_chunk] - lo)] += torch.from_numpy(rows[in_chunk])
                self._apply_table(t, torch.arange(lo - start, hi - start), update)
        self._cache = {}

    def _apply_table(self, t: int, local: torch.Tensor, update: torch.Tensor) -> None:
        if local.numel() == 0:
            return
        if self.ema is not None:  # the old weight held through the previous step
            self._ema_catch_up(t, local, self.step - 1)
        self._update_weights(t, local, update)
        if self.ema is not None:  # and the new one at this step
            self._ema_catch_up(t, local, self.step)

    def _ema_catch_up(self, t: int, local, through: int) -> None:
        """Bring the EMA of rows `local` (indices or a slice) of table t through step `through`,
        their weights having been constant since each row's ema_through: β^n·ema + (1-β^n)·w."""
        n = through - self.ema_through[t][local]
        if bool((n < 0).any()):
            raise RuntimeError(f"row of table {t} updated twice in step {self.step}: the average would be wrong")
        factor = torch.pow(self.ema_decay, n.double()).float().unsqueeze(-1)
        with torch.no_grad():
            self.ema[t][local] = factor * self.ema[t][local] + (1 - factor) * self.weights(t)[local]
        self.ema_through[t][local] = through

    def averaged_weights(self) -> list:
        """Each table's EMA of its iterates through the last step applied (every row brought up
        to date in place, once per step); the weights themselves when averaging is off."""
        if self.ema is None:
            return [self.weights(t) for t in range(len(self.tbes))]
        if self._ema_current_at != self.step:
            for t in range(len(self.tbes)):
                self._ema_catch_up(t, slice(None), self.step)
            self._ema_current_at = self.step
        return self.ema

    def _update_weights(self, t: int, local: torch.Tensor, update: torch.Tensor) -> None:
        if self.optimizer in FUSED_OPTIMIZERS:
            # FBGEMM fuses the update into backward: look the rows up as bags of one and
            # back-propagate the update as the gradient of the pooled output.
            tbe = self.tbes[t]
            offsets = torch.arange(local.numel() + 1, dtype=torch.int64, device=self.device)
            out = tbe(local.to(self.device), offsets)
            out.backward(update.to(out.device, out.dtype))
            return
        # Lazy Adam: moments and the step count advance only for the rows updated.
        w, st = self.weights(t), self.adam_state[t]
        b1, b2 = self.adam_betas
        with torch.no_grad():
            m = st["m"][local].mul_(b1).add_(update, alpha=1 - b1)
            v = st["v"][local].mul_(b2).addcmul_(update, update, value=1 - b2)
            steps = st["t"][local] + 1
            st["m"][local], st["v"][local], st["t"][local] = m, v, steps
            bc1 = (1 - b1 ** steps.double()).float().unsqueeze(1)
            bc2 = (1 - b2 ** steps.double()).float().unsqueeze(1)
            w[local] -= self._current_lr * (m / bc1) / ((v / bc2).sqrt() + self.eps)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"weights": [self.weights(t).detach().cpu().numpy().copy() for t in range(len(self.tbes))]}
        if self.optimizer == "adagrad":
            state["adagrad"] = [
                tbe.split_optimizer_states()[0][0][: end - start].detach().cpu().numpy().copy()
                for tbe, (start, end) in zip(self.tbes, self.ranges)
            ]
        if self.adam_state is not None:
            state["adam"] = [{k: v.numpy().copy() for k, v in st.items()} for st in self.adam_state]
        state["step"] = self.step
        if self.ema is not None:  # through `step` for every row: the whole averaging state
            state["averaged_weights"] = [w.detach().cpu().numpy().copy() for w in self.averaged_weights()]
        return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for t, w in enumerate(state["weights"]):
                self.weights(t).copy_(torch.from_numpy(np.array(w)))
            if self.optimizer == "adagrad":
                for tbe, (start, end), s in zip(self.tbes, self.ranges, state["adagrad"]):
                    tbe.split_optimizer_states()[0][0][: end - start].copy_(torch.from_numpy(np.array(s)))
            if self.adam_state is not None:
                for st, saved in zip(self.adam_state, state["adam"]):
                    for k in st:
                        st[k].copy_(torch.from_numpy(np.array(saved[k])))
            self.step = int(state.get("step", 0))
            if self.ema is not None:
                if "averaged_weights" not in state:
                    raise ValueError("the checkpoint has no averaged weights but train.ema_decay > 0: "
                                     "resume with the checkpoint's train.ema_decay")
                for e, through, saved in zip(self.ema, self.ema_through, state["averaged_weights"]):
                    e.copy_(torch.from_numpy(np.array(saved)))
                    through.fill_(self.step)
                self._ema_current_at = self.step
