"""The shard's write-back (`ShardUpdates`): the released noisy rows applied with the embedding
optimizer (SGD, row-wise Adagrad, lazy Adam) at the step's learning rate, DP-SGD's dense-table
update (every row noised, counter-based per (step, table, block)), ModelMix's mixing of the
rows, and the lazy average of the iterates. Only released (charged) updates reach it. It
writes the shard's rows (`ShardStorage`) in place and owns the optimizer's, the average's and
ModelMix's state; the checkpoint holds all of it (`state_dict`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.layout import row_block_normal, row_block_uniform
from widedp.trainer.engine.modelmix import mix
from widedp.trainer.engine.shard_storage import ShardStorage
from widedp.trainer.names import OPTIMIZERS

UPDATE_CHUNK = 1 << 16  # rows per chunk of an in-place update


class ShardUpdates:
    """Updates of the shard's rows (see the module docstring).

    Args:
        storage: the shard's rows.
        optimizer: one of OPTIMIZERS ("sgd", "adagrad", "adam").
        lr, adam_betas, eps: the optimizer's settings (lr is scaled per step: `begin_update`).
        ema_decay: β > 0 keeps an exponential moving average of every row's iterates
            (`averaged_weights`), updated lazily: only rows written in a step cost anything."""

    def __init__(self, storage: ShardStorage, optimizer: str = "sgd", lr: float = 0.1,
                 adam_betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, ema_decay: float = 0.0):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
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
