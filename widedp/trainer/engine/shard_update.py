"""The shard's write-back (`ShardUpdates`): the released noisy rows applied with the embedding
optimizer (SGD, row-wise Adagrad, lazy Adam) at the step's learning rate, DP-SGD's dense-table
update (every row noised, counter-based per (step, table, block)), ModelMix's mixing of the
rows, and the lazy average of the iterates. Only released (charged) updates reach it. It
writes the shard's rows (`ShardStorage`) in place and owns the optimizer's, the average's and
ModelMix's state; the checkpoint holds all of it (`state_dict`).

Lazy DP-SGD noise (`lazy_noise`, train.dpsgd_noise; SGD only, no average, no ModelMix):
DP-SGD's step s moves every row by −lr_s·(G_s + std_s·Z_s), Z_s ~ N(0, I) independent of
everything before. Under SGD a row's value is its start minus the sum of those moves, so the
noise of the steps a row is not read in can wait: row r keeps `noised_through[r]` = a (the
steps < a are in its stored value) and, when it is read at step b or released, receives
−√(Σ_{a≤s<b} (lr_s·std_s)²)·Z(r, a, b) in one draw — the sum of b − a independent Gaussians is
one Gaussian with the summed variance, so every value a lookup reads and every released table
has exactly the eager run's distribution (the split points depend only on what was read before,
never on the noise to come). Z(r, a, b) is `interval_normals` under the key derived as
(LAZY_DOMAIN, table): a function of the secret, the global row and the interval alone — the
same however the rows are sharded, the same when a step is replayed, independent between
intervals. A lookup reads the pending noise without storing it (the rows are restored after
the TBE call); the step's write-back stores it for the rows it updates, which are every row
the step read (their clipped sums), so the stored state is a function of the write-backs
alone and a lost Ray shard replayed from its write-backs is the lost one exactly. Evaluation and
`state_dict` (checkpoints, export, audits) first store every row's pending noise (`flush`).
Adagrad's and Adam's state depend on each step's noisy gradient of every row, the average of
the iterates on every intermediate value, ModelMix on every row's two latest states: eager only.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from widedp.selection._sparse import unique_ints
from widedp.selection.keyed_random import NoiseKey, interval_normals
from widedp.trainer.engine.layout import row_block_normal, row_block_uniform
from widedp.trainer.engine.modelmix import mix
from widedp.trainer.engine.shard_storage import ShardStorage
from widedp.trainer.names import OPTIMIZERS

UPDATE_CHUNK = 1 << 16  # rows per chunk of an in-place update
#: The address under the DP-SGD noise key of a row's pending noise: the key derived for
#: LAZY_DOMAIN, then per draw the point table·2^ROW_BITS + global row, the first pending step
#: and the step read (`interval_normals`).
LAZY_DOMAIN = "dpsgd-lazy"
ROW_BITS = 48


class ShardUpdates:
    """Updates of the shard's rows (see the module docstring).

    Args:
        storage: the shard's rows.
        optimizer: one of OPTIMIZERS ("sgd", "adagrad", "adam").
        lr, adam_betas, eps: the optimizer's settings (lr is scaled per step: `begin_update`).
        ema_decay: β > 0 keeps an exponential moving average of every row's iterates
            (`averaged_weights`), updated lazily: only rows written in a step cost anything.
        lazy_noise: DP-SGD's noise of the rows a step does not read is deferred to their next
            read or release (the module docstring); SGD without averaging only."""

    def __init__(self, storage: ShardStorage, optimizer: str = "sgd", lr: float = 0.1,
                 adam_betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, ema_decay: float = 0.0,
                 lazy_noise: bool = False):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if lazy_noise and (optimizer != "sgd" or ema_decay > 0):
            raise ValueError(f"lazy DP-SGD noise is exact for SGD without averaging only (optimizer {optimizer!r}, "
                             f"ema_decay {ema_decay}): Adagrad's and Adam's state and the average read every "
                             "step's noise of every row")
        self.storage, self.optimizer, self.lr = storage, optimizer, lr
        self.adam_betas, self.eps = adam_betas, eps
        self._current_lr = lr  # lr · the step's lr_scale (begin_update)
        flat = storage.flat
        self.adam_state = None
        if optimizer == "adam":  # flat like the weights
            self.adam_state = {"m": torch.zeros_like(flat), "v": torch.zeros_like(flat),
                               "t": torch.zeros(flat.shape[0], dtype=torch.int64)}
        # Parameter averaging (post-processing of the iterates). ema[r] is the EMA through step
        # ema_through[r]; row r's weight has not changed since then, so the EMA through any
        # later step T is β^n·ema + (1 - β^n)·w with n = T - ema_through (_ema_catch_up).
        self.ema_decay = float(ema_decay)
        self.step = 0  # the step whose update is being applied (begin_update), then the last one applied
        self.ema: Optional[torch.Tensor] = None
        if self.ema_decay > 0:
            self.ema = flat.detach().clone()
            self.ema_through = torch.zeros(flat.shape[0], dtype=torch.int64, device=flat.device)
        self._ema_current_at: Optional[int] = 0  # every row's EMA is through this step (None: not known)
        self.mix_previous: Optional[torch.Tensor] = None  # ModelMix's θ_{t-2} (train.modelmix; flat rows)
        self.lazy_noise = bool(lazy_noise)
        if self.lazy_noise:
            # row r's stored value holds the noise of steps < noised_through[r] (0-based steps)
            self.noised_through = torch.zeros(flat.shape[0], dtype=torch.int64)
            # _lazy_var[i] = Σ_{base ≤ s < base + i} (lr_s·std_s)², i < _lazy_len; rebased to the step
            # whenever every row has all of its noise (`_rebase`: a replayed shard rebases where
            # the lost one did, so both compute every interval's variance from the same sums)
            self._lazy_var = np.zeros(64, dtype=np.float64)
            self._lazy_len, self._lazy_base = 1, 0
            self._lazy_key: Optional[NoiseKey] = None  # the run's DP-SGD key (from the first write-back)
            self._lazy_point_key: Optional[tuple] = None  # (that key, its LAZY_DOMAIN key)
            # this step's draws so far (the lookups'), which its write-back stores: (step, sorted
            # flat ids, their noise) — the same values `_draw` would give again, kept to save the work
            self._drawn: tuple = (-1, np.zeros(0, np.int64), torch.zeros((0, storage.layout.dim)))
            if any(end > (1 << ROW_BITS) for _, end in storage.ranges) or len(storage.ranges) > (1 << 15):
                raise ValueError(f"lazy DP-SGD noise addresses tables of up to 2^{ROW_BITS} rows, 2^15 tables")
            self._valid = np.concatenate([np.arange(base, base + end - start, dtype=np.int64)
                                          for base, (start, end) in zip(storage.row_base, storage.ranges)]
                                         or [np.zeros(0, np.int64)])

    def begin_update(self, step: Optional[int], lr_scale: float) -> None:
        """The updates that follow are step `step`'s (1-based; needed when averaging), at
        learning rate lr · lr_scale (trainer/config/lr_schedule.py)."""
        if step is not None:
            self.step = int(step)
        elif self.ema is not None:
            raise ValueError("with ema_decay > 0 every update must say its step")
        self._ema_current_at = None
        lr = self.lr * float(lr_scale)
        self._current_lr = lr

    def apply_rows(self, table_idx: np.ndarray, global_ids: np.ndarray, rows: np.ndarray,
                   lr_scale: float = 1.0, step: Optional[int] = None) -> None:
        """Apply the optimizer to the given rows only (update direction = `rows`, a gradient),
        with learning rate lr · lr_scale, as step `step` (for the averaged weights)."""
        self.begin_update(step, lr_scale)
        table_idx = np.asarray(table_idx, dtype=np.int64)
        local = np.asarray(global_ids, dtype=np.int64) - self.storage.starts[table_idx]
        self._apply(table_idx, local, torch.from_numpy(np.array(rows, dtype=np.float32)))  # copy: Ray arrays are read-only

    def apply_dense_noise_update(self, step: int, noise_key: NoiseKey, std: float, table_idx, global_ids, rows,
                                 tables=None, lr_scale: float = 1.0,
                                 mix: Optional[tuple] = None) -> None:
        """DP-SGD: every row of every table in `tables` (None: all) gets G + N(0, std²) (G = 0
        for untouched rows). The noise of row r depends only on (key, step, table, r), not on
        the sharding nor on which other tables are dense. Learning rate lr · lr_scale; `step` is
        0-based (the engine's step count before the step), so this is step `step + 1`.
        Rows [c·K, (c+1)·K) of a dense table are one contiguous slice of the flat storage,
        updated in place (K = UPDATE_CHUNK): no lookup, no backward (`_apply_range`).
        `mix` = (mix key, gap in gradient units w·S/b): ModelMix (trainer/engine/modelmix.py) — each
        row starts from the secret mix of its two latest states, over a gap of lr·lr_scale times
        that, before the update (SGD only: the analysis covers w − lr·update)."""
        if self.lazy_noise:
            return self._lazy_dense_update(step, noise_key, std, table_idx, global_ids, rows, tables, lr_scale, mix)
        self.begin_update(step + 1, lr_scale)
        if mix is not None and self.optimizer != "sgd":
            raise ValueError(f"ModelMix needs the sgd embedding optimizer, this shard runs {self.optimizer!r}")
        if mix is not None and self.mix_previous is None:  # θ_{t-2} = θ_{t-1} = θ_0 at the first step
            self.mix_previous = self.storage.flat.detach().clone()
        table_idx, global_ids = np.asarray(table_idx, dtype=np.int64), np.asarray(global_ids, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.float32)
        for t, (start, end) in enumerate(self.storage.ranges):
            if end <= start or (tables is not None and t not in tables):
                continue
            in_table = table_idx == t
            for lo in range(start, end, UPDATE_CHUNK):
                hi = min(end, lo + UPDATE_CHUNK)
                update = row_block_normal(noise_key, "dpsgd", step, t, lo, hi, self.storage.layout.dim, std)
                hit = np.flatnonzero(in_table & (global_ids >= lo) & (global_ids < hi))
                if hit.size:
                    update[torch.from_numpy(global_ids[hit] - lo)] += torch.from_numpy(rows[hit])
                if mix is not None:
                    self._mix_range(t, lo - start, hi - start, step, *mix)
                self._apply_range(t, lo - start, hi - start, update)

    # ---- lazy DP-SGD noise (the module docstring) --------------------------------------------
    def _lazy_dense_update(self, step: int, noise_key: NoiseKey, std: float, table_idx, global_ids, rows,
                           tables, lr_scale: float, mix) -> None:
        """Step `step`'s DP-SGD update with lazy noise: the rows it updates (every row it read)
        first store their pending noise (steps < `step`), then −lr·G; the step's own noise,
        (lr·std)², joins every row's pending variance."""
        if mix is not None:
            raise ValueError("ModelMix mixes every row every step: it needs eager DP-SGD noise")
        if tables is not None and set(tables) != set(range(len(self.storage.ranges))):
            raise ValueError("lazy DP-SGD noise covers every table (train.mode = dpsgd), not a subset of dense tables")
        if int(step) != self.step:
            raise RuntimeError(f"lazy DP-SGD noise: write-back of step {step} after step {self.step}: steps in order only")
        if self._lazy_key is not None and noise_key != self._lazy_key:
            self._drawn = (-1, self._drawn[1][:0], self._drawn[2][:0])  # draws under another key
        self._lazy_key = noise_key
        table_idx, global_ids = np.asarray(table_idx, dtype=np.int64), np.asarray(global_ids, dtype=np.int64)
        flat_ids = self.storage.row_base[table_idx] + global_ids - self.storage.starts[table_idx]
        fused = self._drawn_match(flat_ids)
        if fused is None:
            self.flush(flat_ids)
        self.begin_update(step + 1, lr_scale)
        if self._lazy_len == self._lazy_var.size:
            self._lazy_var = np.concatenate([self._lazy_var, np.zeros_like(self._lazy_var)])
        self._lazy_var[self._lazy_len] = self._lazy_var[self._lazy_len - 1] + (self._current_lr * float(std)) ** 2
        self._lazy_len += 1
        update = torch.from_numpy(np.array(rows, dtype=np.float32))
        if fused is not None:  # the rows read are the rows updated: noise and −lr·G in one write
            self._store_and_update(flat_ids, fused, update, through=int(step))
        elif flat_ids.size:
            self._update_weights(torch.from_numpy(flat_ids), update)

    def _drawn_match(self, flat_ids: np.ndarray) -> Optional[torch.Tensor]:
        """This step's drawn noise when `flat_ids` are exactly the rows it drew for (sorted, as
        the write-back of one trainer sends them), else None: the write-back then needs no
        second search of its rows (`_store_and_update`)."""
        step, drawn_ids, drawn = self._drawn
        if step != self.step or flat_ids.size != drawn_ids.size or flat_ids.size == 0:
            return None
        if not np.array_equal(flat_ids, drawn_ids):
            return None
        return drawn

    def _store_and_update(self, flat_ids: np.ndarray, noise: torch.Tensor, update: torch.Tensor, through: int) -> None:
        """flat[r] ← (flat[r] − noise) − lr·update for distinct rows `flat_ids` that wait for
        `noise` (their draw through step `through`), then noised_through[r] = `through`:
        the arithmetic of `_store` followed by SGD's `_update_weights`, in one read and one write,
        so the stored noisy value is the one a lookup read, bit for bit."""
        flat = self.storage.flat
        index = torch.from_numpy(flat_ids).to(flat.device)
        with torch.no_grad():
            noisy = flat.index_select(0, index) - noise.to(flat.device)
            flat.index_copy_(0, index, noisy - self._current_lr * update.to(flat.device, torch.float32))
        self.noised_through[torch.from_numpy(flat_ids)] = through

    def pending_noise(self, flat_ids: np.ndarray) -> tuple[np.ndarray, Optional[torch.Tensor]]:
        """(rows, noise [rows, D]): of the distinct flat rows `flat_ids`, those with noise still to
        receive (noised_through < the steps applied) and the value to subtract — the one draw of
        their pending steps, √(Σ (lr_s·std_s)²)·Z(r, a, b). A function of the state and the key:
        the same rows give the same values until `flush` stores them."""
        if not self.lazy_noise or flat_ids.size == 0:
            return np.zeros(0, np.int64), None
        ids = unique_ints(np.asarray(flat_ids, dtype=np.int64))
        through = self.noised_through[torch.from_numpy(ids)].numpy()
        waiting = through < self.step
        ids, through = ids[waiting], through[waiting]
        if ids.size == 0:
            return ids, None
        step, drawn_ids, drawn = self._drawn
        if step != self.step or drawn_ids.size == 0:  # the step's first draw: all of them, in order
            fresh = self._draw(ids, through)
            self._drawn = (self.step, ids, fresh)
            return ids, fresh
        pos = np.minimum(np.searchsorted(drawn_ids, ids), max(drawn_ids.size - 1, 0))
        known = (drawn_ids[pos] == ids) if drawn_ids.size else np.zeros(ids.size, dtype=bool)
        noise = torch.empty((ids.size, self.storage.layout.dim), dtype=torch.float32)
        if known.any():
            noise[torch.from_numpy(np.flatnonzero(known))] = drawn[torch.from_numpy(pos[known])]
        new = np.flatnonzero(~known)
        if new.size:
            fresh = self._draw(ids[new], through[new])
            noise[torch.from_numpy(new)] = fresh
            merged = np.concatenate([drawn_ids, ids[new]])
            order = np.argsort(merged, kind="stable")
            self._drawn = (self.step, merged[order], torch.cat([drawn, fresh])[torch.from_numpy(order)])
        return ids, noise

    def _draw(self, ids: np.ndarray, through: np.ndarray) -> torch.Tensor:
        """The pending noise of flat rows `ids` (noised through `through` < the steps applied):
        √(Σ_{through ≤ s < step} (lr_s·std_s)²)·Z(table·2^ROW_BITS + global row, through, step)."""
        prefix = self._lazy_var
        scale = np.sqrt(np.maximum(prefix[self.step - self._lazy_base] - prefix[through - self._lazy_base], 0.0))
        table = np.searchsorted(self.storage.row_base, ids, side="right") - 1
        global_rows = ids - self.storage.row_base[table] + self.storage.starts[table]
        key = self._lazy_key
        if key is None:
            raise RuntimeError("lazy DP-SGD noise is pending but this shard has not been given the noise key")
        if self._lazy_point_key is None or self._lazy_point_key[0] is not key:
            self._lazy_point_key = (key, key.derive(LAZY_DOMAIN))
        points = (table.astype(np.int64) << ROW_BITS) | global_rows  # (table, global row): one AES call for all
        noise = interval_normals(self._lazy_point_key[1], points, through, np.full(ids.size, self.step, dtype=np.int64),
                                 self.storage.layout.dim)
        return noise.mul_(torch.from_numpy(scale).float().unsqueeze(1))

    def flush(self, flat_ids: Optional[np.ndarray] = None) -> int:
        """Store the pending noise of flat rows `flat_ids` (None: every row, UPDATE_CHUNK rows at a
        time, then `_rebase`) in their values; returns how many rows received some."""
        if not self.lazy_noise:
            return 0
        if flat_ids is not None:
            return self._store(*self.pending_noise(np.asarray(flat_ids, dtype=np.int64)))
        stored = 0
        for lo in range(0, self._valid.size, UPDATE_CHUNK):
            ids = self._valid[lo: lo + UPDATE_CHUNK]
            through = self.noised_through[torch.from_numpy(ids)].numpy()
            waiting = through < self.step
            if waiting.any():
                stored += self._store(ids[waiting], self._draw(ids[waiting], through[waiting]))
        self._rebase()
        return stored

    def _store(self, ids: np.ndarray, noise: Optional[torch.Tensor]) -> int:
        if noise is None or ids.size == 0:
            return 0
        index = torch.from_numpy(ids)
        _subtract_rows(self.storage.flat, index.to(self.storage.flat.device), noise)
        self.noised_through[index] = self.step
        return int(ids.size)

    def _rebase(self) -> None:
        """Every row holds all of its noise: the pending sums start again at this step, and this
        step's draws are forgotten (every row read is stored)."""
        self._lazy_var[0] = 0.0
        self._lazy_len, self._lazy_base = 1, self.step
        self._drawn = (-1, self._drawn[1][:0], self._drawn[2][:0])

    def with_pending_noise(self, flat_ids: np.ndarray):
        """A context in which rows `flat_ids` of the storage hold their pending noise (a lookup
        reads them so); their stored values are put back, bit for bit, on leaving."""
        return _PendingNoise(self, flat_ids)

    def _mix_range(self, t: int, lo: int, hi: int, step: int, mix_key: NoiseKey, gradient_gap: float) -> None:
        """Rows [lo, hi) of table t: θ_{t-1} ← mix(θ_{t-1}, θ_{t-2}, lr·gap, α), θ_{t-2} ← θ_{t-1}
        (trainer/engine/modelmix.py); α for the table's global rows, as `row_block_uniform` draws them."""
        gap = self._current_lr * gradient_gap
        assert self.mix_previous is not None
        rows = slice(int(self.storage.row_base[t]) + lo, int(self.storage.row_base[t]) + hi)
        start = self.storage.ranges[t][0]
        alpha = row_block_uniform(mix_key, "modelmix", step, t, start + lo, start + hi, self.storage.layout.dim)
        with torch.no_grad():
            current = self.storage.flat[rows].clone()
            self.storage.flat[rows] = mix(current, self.mix_previous[rows], gap, alpha)
            self.mix_previous[rows] = current

    def _apply_range(self, t: int, lo: int, hi: int, update: torch.Tensor) -> None:
        """Update every row [lo, hi) (local ids) of table t by update [hi - lo, D]: the same
        optimizer as `_apply` (the formulas tests/test_shard_storage.py pins against FBGEMM),
        in place on a contiguous slice of the flat storage."""
        rows = slice(int(self.storage.row_base[t]) + lo, int(self.storage.row_base[t]) + hi)
        if self.ema is not None:
            self._ema_catch_up(rows, self.step - 1)
        self._update_weights(rows, update)
        if self.ema is not None:
            self._ema_catch_up(rows, self.step)

    def _apply(self, tables: np.ndarray, local: np.ndarray, update: torch.Tensor) -> None:
        """Update rows (tables[i], local[i]) — each at most once — by update[i], every table at once."""
        if local.size == 0:
            return
        flat_ids = torch.from_numpy(self.storage.row_base[tables] + local).to(self.storage.flat.device)
        if self.ema is not None:  # the old weight held through the previous step
            self._ema_catch_up(flat_ids, self.step - 1)
        self._update_weights(flat_ids, update)
        if self.ema is not None:  # and the new one at this step
            self._ema_catch_up(flat_ids, self.step)

    def _ema_catch_up(self, flat_ids, through: int) -> None:
        """Bring the EMA of rows `flat_ids` (indices or a slice) through step `through`, their
        weights having been constant since each row's ema_through: β^n·ema + (1-β^n)·w."""
        assert self.ema is not None
        n = through - self.ema_through[flat_ids]
        if bool((n < 0).any()):
            raise RuntimeError(f"a row updated twice in step {self.step}: the average would be wrong")
        factor = torch.pow(self.ema_decay, n.double()).float().unsqueeze(-1)
        with torch.no_grad():
            self.ema[flat_ids] = factor * self.ema[flat_ids] + (1 - factor) * self.storage.flat[flat_ids]
        self.ema_through[flat_ids] = through

    def averaged_weights_flat(self) -> torch.Tensor:
        """Every row's EMA of its iterates through the last step applied ([R, D], brought up to
        date in place once per step); the weights themselves when averaging is off."""
        if self.ema is None:
            return self.storage.flat
        if self._ema_current_at != self.step:
            self._ema_catch_up(slice(None), self.step)
            self._ema_current_at = self.step
        return self.ema

    def averaged_weights(self) -> list:
        """`averaged_weights_flat` as one view per table."""
        flat = self.averaged_weights_flat()
        return [flat[base: base + end - start] for base, (start, end) in zip(self.storage.row_base, self.storage.ranges)]

    def _update_weights(self, rows, update: torch.Tensor) -> None:
        """One optimizer step on rows `rows` of the flat storage (a slice, or distinct indices)
        by `update` [rows, D] at the current learning rate, in place. SGD: w -= lr·g.
        Adagrad is FBGEMM's EXACT_ROWWISE_ADAGRAD (its accumulator, in the TBE's own state):
        acc += mean(g²); w -= lr·g/(√acc + eps). Adam is lazy: moments and the step count
        advance only for the rows updated. (The TBE's fused backward would do the same for
        SGD and Adagrad at the cost of a lookup and a backward pass over the rows.)"""
        update = update.to(self.storage.flat.device, torch.float32)
        lr = self._current_lr
        with torch.no_grad():
            if self.optimizer == "sgd":
                self.storage.flat[rows] -= lr * update
            elif self.optimizer == "adagrad":
                state = self.storage.adagrad_state()
                acc = state[rows] + update.pow(2).mean(1)
                state[rows] = acc
                self.storage.flat[rows] -= lr * update / (acc.sqrt() + self.eps).unsqueeze(1)
            else:
                assert self.adam_state is not None
                st = self.adam_state
                b1, b2 = self.adam_betas
                m = st["m"][rows].mul_(b1).add_(update, alpha=1 - b1)
                v = st["v"][rows].mul_(b2).addcmul_(update, update, value=1 - b2)
                steps = st["t"][rows] + 1
                st["m"][rows], st["v"][rows], st["t"][rows] = m, v, steps
                bc1 = (1 - b1 ** steps.double()).float().unsqueeze(1)
                bc2 = (1 - b2 ** steps.double()).float().unsqueeze(1)
                self.storage.flat[rows] -= lr * (m / bc1) / ((v / bc2).sqrt() + self.eps)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The rows and everything the write-back keeps, per table (a checkpoint's shard entry):
        weights, the optimizer's state, the step, the averaged weights, ModelMix's θ_{t-2}."""
        st = self.storage
        self.flush()  # lazy DP-SGD noise: a state leaves with every row's noise in it
        state: dict[str, Any] = {"weights": st.per_table(st.flat)}
        if self.optimizer == "adagrad":
            state["adagrad"] = st.per_table(st.adagrad_state())
        if self.adam_state is not None:
            state["adam"] = [dict(zip(self.adam_state, vals))
                             for vals in zip(*(st.per_table(v) for v in self.adam_state.values()))]
        state["step"] = self.step
        if self.ema is not None:  # through `step` for every row: the whole averaging state
            state["averaged_weights"] = st.per_table(self.averaged_weights_flat())
        if self.mix_previous is not None:  # ModelMix's θ_{t-2} (a released state)
            state["mix_previous"] = st.per_table(self.mix_previous)
        return state

    def load_state_dict(self, state: dict) -> None:
        """`state_dict`'s inverse; ValueError if averaging is on and the state has no average."""
        st = self.storage
        with torch.no_grad():
            st.load_per_table(st.flat, state["weights"])
            if self.optimizer == "adagrad":
                st.load_per_table(st.adagrad_state(), state["adagrad"])
            if self.adam_state is not None:
                for k, v in self.adam_state.items():
                    st.load_per_table(v, [saved[k] for saved in state["adam"]])
            self.step = int(state.get("step", 0))
            if self.lazy_noise:  # a saved state holds every row's noise (`state_dict` flushes)
                self.noised_through.fill_(self.step)
                self._rebase()
                self._drawn = (-1, self._drawn[1][:0], self._drawn[2][:0])
            self.mix_previous = None
            if "mix_previous" in state:
                self.mix_previous = st.flat.detach().clone()
                st.load_per_table(self.mix_previous, state["mix_previous"])
            if self.ema is not None:
                if "averaged_weights" not in state:
                    raise ValueError("the checkpoint has no averaged weights but train.ema_decay > 0: "
                                     "resume with the checkpoint's train.ema_decay")
                st.load_per_table(self.ema, state["averaged_weights"])
                self.ema_through.fill_(self.step)
                self._ema_current_at = self.step


class _PendingNoise:
    """`ShardUpdates.with_pending_noise`: the rows' stored values saved, their pending noise
    subtracted for the duration, the saved values put back."""

    def __init__(self, updates: ShardUpdates, flat_ids: np.ndarray):
        self.updates, self.flat_ids = updates, flat_ids
        self._saved: Optional[tuple] = None

    def __enter__(self) -> "_PendingNoise":
        ids, noise = self.updates.pending_noise(self.flat_ids)
        if noise is not None:
            flat = self.updates.storage.flat
            index = torch.from_numpy(ids).to(flat.device)
            self._saved = (index, _subtract_rows(flat, index, noise))
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            index, values = self._saved
            with torch.no_grad():
                self.updates.storage.flat.index_copy_(0, index, values)
            self._saved = None


def _subtract_rows(flat: torch.Tensor, index: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """flat[index] ← flat[index] − noise (distinct indices), in place; returns the rows' values
    before. The one arithmetic both a lookup's temporary noise and the write-back's stored noise
    use, so the value a lookup read is the value stored, bit for bit."""
    with torch.no_grad():
        before = flat.index_select(0, index)
        flat.index_copy_(0, index, before - noise.to(flat.device))
    return before
