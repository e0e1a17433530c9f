"""A shard's part of a step's gradients (`ShardGradients`): partial pooled embeddings of its
bags, per-example (or per-unit) partial squared gradient norms over the unique rows of each
example, and clipped per-row gradient sums (for one trainer, or reduced over the trainers'
parts). It reads the shard's rows (`ShardStorage`, trainer/engine/shard_storage.py) and owns
the step's per-trainer caches, which the shard's selection (trainer/engine/shard_select.py)
reads and the write-back empties (trainer/engine/shard.py).

Per-example row gradient (sum pooling with per-id weights w, mean pooling = w = 1/|bag|):
  ∂L_j/∂E[t, r] = Σ_{features f of table t} Σ_{i in bag(j, f), id_i = r} w_i · ∂L_j/∂pooled_{j,f}.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from widedp.selection._sparse import unique_ints
from widedp.trainer.engine.layout import ShardInput
from widedp.trainer.engine.shard_storage import ShardStorage

class ShardGradients:
    """Lookup, norms and clipped row sums over the shard's rows (see the module docstring).

    State: `caches` (trainer index -> this step's input, bags and per-id contributions: each
    data-parallel trainer talks to the shard about its own examples) and `step_row_sums` (this
    step's (row keys, float64 sums), for selection by norms)."""

    def __init__(self, storage: ShardStorage):
        self.storage = storage
        self.caches: dict[int, dict] = {}
        self._row_sum_parts: list = []  # (keys, sums) of the trainers' clipped row sums this step
        self.step_row_sums: Optional[tuple] = None

    def discard(self) -> None:
        """Forget this step's per-trainer state and partial reductions."""
        self.caches, self._row_sum_parts, self.step_row_sums = {}, [], None

    def lookup(self, inp: ShardInput, batch_size: int, trainer: int = 0,
               averaged_table: Optional[torch.Tensor] = None, ids_checked: bool = False) -> np.ndarray:
        """Partial pooled embeddings of this shard's bags ([bags, D], in `inp.bags` order: only
        what this shard holds travels back). One TBE call over every feature's bags
        (feature-major, like a KJT), and the step's cache for trainer `trainer` (whose examples
        these are: data-parallel trainers each keep their own step state here; example indices
        are the trainer's own). With `averaged_table` ([R, D], the averaged rows), the same
        weighted sum pooling over those rows instead, and no cache (evaluation only)."""
        st = self.storage
        dim = st.layout.dim
        if not ids_checked:  # (the shard checked them already where the ids index its lazy-noise state)
            self._check_ids(inp, batch_size)
        bags = inp.bags(batch_size)
        if averaged_table is None:
            self.caches[int(trainer)] = {"inp": inp, "batch_size": batch_size, "bags": bags}
        if batch_size == 0 or inp.example.size == 0:
            return np.zeros((0, dim), dtype=np.float32)
        channel = st.feature_channel[inp.feature]
        bag_of_id = channel * batch_size + inp.example
        if bool((bag_of_id[1:] >= bag_of_id[:-1]).all()):  # routed in bag order already (channel = feature order)
            order: "np.ndarray | slice" = slice(None)
        else:
            order = np.argsort(bag_of_id, kind="stable")  # stable: a bag keeps its ids' order
        bag = bag_of_id[order]
        n_bags = st.num_channels * batch_size
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(np.bincount(bag, minlength=n_bags))]))
        weights = torch.from_numpy(inp.weight[order])
        bag_channel = st.feature_channel[bags.feature]
        with torch.no_grad():
            if averaged_table is None:
                ids = torch.from_numpy(inp.local_id[order])
                pooled = st.tbe(ids.to(st.device), offsets.to(st.device),
                                per_sample_weights=weights.to(st.device))  # [B, channels·D]
                pooled = pooled.reshape(-1, dim)  # row example·channels + channel
                wanted = torch.from_numpy(bags.example * st.num_channels + bag_channel)
            else:
                table = averaged_table
                flat_ids = torch.from_numpy(st.row_base[st.feature_table[inp.feature[order]]] + inp.local_id[order])
                pooled = torch.nn.functional.embedding_bag(
                    flat_ids.to(table.device), table, offsets.to(table.device), mode="sum",
                    per_sample_weights=weights.float().to(table.device), include_last_offset=True)  # [channels·B, D]
                wanted = torch.from_numpy(bag_channel * batch_size + bags.example)
            out = pooled.index_select(0, wanted.to(pooled.device))
        return out.float().cpu().numpy()

    def _check_ids(self, inp: ShardInput, batch_size: int) -> None:
        """ValueError naming the feature and id of any id outside this shard's rows of its
        table (the TBE runs without its own bounds check), or an example outside the batch."""
        if inp.example.size == 0:
            return
        bad = (inp.local_id < 0) | (inp.local_id >= self.storage.feature_rows[inp.feature])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            feature = self.storage.layout.features[int(inp.feature[i])]
            raise ValueError(f"shard {self.storage.shard_index}: feature {feature.name!r} id {int(inp.local_id[i])} (local) is "
                             f"outside this shard's {int(self.storage.feature_rows[inp.feature[i]])} rows of table {feature.table!r}")
        if inp.example.min() < 0 or inp.example.max() >= batch_size:
            raise ValueError(f"shard {self.storage.shard_index}: example index outside the batch of {batch_size}")

    def cache(self, trainer: int) -> dict:
        cache = self.caches.get(int(trainer))
        if cache is None:
            raise RuntimeError(f"trainer {trainer} has no lookup on shard {self.storage.shard_index} this step")
        return cache

    def _contributions(self, bag_grads: np.ndarray, trainer: int) -> torch.Tensor:
        """Each id's w_i · ∂L_j/∂pooled_{j,f} [nnz, D] from the pooled-output gradients of this
        shard's bags ([bags, D], `inp.bags` order) and cache them for the row sums."""
        cache = self.cache(trainer)
        inp, bags = cache["inp"], cache["bags"]
        grad = torch.from_numpy(np.asarray(bag_grads, dtype=np.float32).reshape(-1, self.storage.layout.dim))
        contrib = torch.from_numpy(inp.weight).unsqueeze(1) * grad[torch.from_numpy(bags.id_bag)]
        cache.update(contrib=contrib, table=self.storage.feature_table[inp.feature])
        return contrib

    def example_sq_norms(self, bag_grads: np.ndarray, trainer: int = 0) -> np.ndarray:
        """Per-example squared ℓ2 norms of this shard's part of each example's row gradients,
        for this shard's examples (`inp.bags(B).examples` order); `bag_grads` as in `lookup`."""
        contrib = self._contributions(bag_grads, trainer)
        cache = self.cache(trainer)
        inp, bags, table = cache["inp"], cache["bags"], cache["table"]
        if self.ids_never_repeat(cache):  # each id's contribution is its own row gradient
            return torch.zeros(bags.examples.size, dtype=torch.float64).index_add_(
                0, torch.from_numpy(bags.id_example), contrib.double().pow(2).sum(1)).numpy()
        # Group by (example, table, row): repeated ids add up before the norm is taken.
        n_tables = len(self.storage.ranges)
        key = (bags.id_example * n_tables + table) * self.storage.max_rows + inp.local_id
        uniq, group = np.unique(key, return_inverse=True)
        group_t = torch.from_numpy(group.astype(np.int64).reshape(-1))
        sums = torch.zeros((uniq.size, contrib.shape[1]), dtype=torch.float64).index_add_(0, group_t, contrib.double())
        sq = torch.zeros(bags.examples.size, dtype=torch.float64).index_add_(
            0, torch.from_numpy(uniq // (n_tables * self.storage.max_rows)), sums.pow(2).sum(1))
        return sq.numpy()

    def unit_sq_norms(self, bag_grads: np.ndarray, units: np.ndarray, num_units: int, trainer: int = 0) -> np.ndarray:
        """Per-unit squared ℓ2 norms [num_units] of this shard's part of each privacy unit's
        (user's) summed row gradients: ‖Σ_{j∈u} ∂L_j/∂E[t, r]‖² summed over the (t, r) here.
        `units`: the unit (0..num_units-1) of each of this shard's examples (`inp.bags(B).examples`
        order). A row two examples of one unit touch adds up before the norm is taken, as repeated
        ids of one example do in `example_sq_norms` (which is this with one unit per example).
        The units are kept for this step's contribution counts (`_row_counts`: distinct (unit, row)
        pairs, each unit's weight once)."""
        contrib = self._contributions(bag_grads, trainer)
        cache = self.cache(trainer)
        inp, bags, table = cache["inp"], cache["bags"], cache["table"]
        units = np.asarray(units, dtype=np.int64)
        if units.shape != bags.examples.shape:
            raise ValueError(f"shard {self.storage.shard_index}: {units.size} units for {bags.examples.size} examples")
        if units.size and (units.min() < 0 or units.max() >= num_units):
            raise ValueError(f"shard {self.storage.shard_index}: a unit index outside [0, {num_units})")
        cache["units"] = units
        id_unit = units[bags.id_example]
        n_tables = len(self.storage.ranges)
        key = (id_unit * n_tables + table) * self.storage.max_rows + inp.local_id
        uniq, group = np.unique(key, return_inverse=True)
        sums = torch.zeros((uniq.size, contrib.shape[1]), dtype=torch.float64).index_add_(
            0, torch.from_numpy(group.astype(np.int64).reshape(-1)), contrib.double())
        sq = torch.zeros(int(num_units), dtype=torch.float64).index_add_(
            0, torch.from_numpy(uniq // (n_tables * self.storage.max_rows)), sums.pow(2).sum(1))
        return sq.numpy()

    def clipped_row_sums(self, factors: np.ndarray, trainer: int = 0, selection_weights=None,
                         coordinate_bound: Optional[float] = None, bag_grads: Optional[np.ndarray] = None):
        """Σ_j factor_j · ∂L_j/∂E[t, r] over the trainer's batch, for every touched (t, r) of
        this shard; `factors` for this shard's examples (`inp.bags(B).examples` order), kept as
        this step's sums (`step_row_sums`, for selection by norms).
        `selection_weights`: the same examples' contribution weights, kept for the selection's
        counts (`ShardSelection.select_rows`). `coordinate_bound`: refined clipping — each
        example's clipped row gradient clamped to ±bound per coordinate before the sum
        (`_clamped_row_sums64`). `bag_grads`: this step's pooled-output gradients of this
        shard's bags (as in `example_sq_norms`), when the trainer computed the norms itself
        (trainer/engine/example_norms.py) and no norms round ran: the pooled gradients and the
        factors travel in this one call.

        Returns (table index [m], global row id [m], sums [m, D] float32)."""
        if bag_grads is not None:
            self._contributions(bag_grads, trainer)
        self._keep_selection_weights(selection_weights, trainer)
        keys, sums = self.step_row_sums = (self._clipped_row_sums64(factors, trainer) if coordinate_bound is None
                                           else self._clamped_row_sums64(factors, trainer, coordinate_bound))
        return self.storage.rows_of(keys, sums)

    def add_clipped_row_sums(self, factors: np.ndarray, trainer: int, selection_weights=None,
                             coordinate_bound: Optional[float] = None, bag_grads: Optional[np.ndarray] = None) -> None:
        """Data-parallel trainers: add trainer `trainer`'s clipped row sums (as in
        `clipped_row_sums`, `bag_grads` too) to this step's reduction here, where the rows live;
        nothing travels back until `reduced_row_sums`."""
        if bag_grads is not None:
            self._contributions(bag_grads, trainer)
        self._keep_selection_weights(selection_weights, trainer)
        self._row_sum_parts.append(self._clipped_row_sums64(factors, trainer) if coordinate_bound is None
                                   else self._clamped_row_sums64(factors, trainer, coordinate_bound))

    def _keep_selection_weights(self, weights, trainer: int) -> None:
        if weights is not None:
            self.cache(trainer)["selection_weights"] = np.asarray(weights, dtype=np.float64)

    def reduced_row_sums(self):
        """The sum over trainers of the clipped row sums added this step (float64 sums, then
        float32 as `clipped_row_sums` returns), and the reduction is emptied."""
        parts, self._row_sum_parts = self._row_sum_parts, []
        if not parts:
            self.step_row_sums = (np.empty(0, np.int64), torch.zeros((0, self.storage.layout.dim), dtype=torch.float64))
            return self.storage.rows_of(*self.step_row_sums)
        uniq, group = np.unique(np.concatenate([k for k, _ in parts]), return_inverse=True)
        sums = torch.zeros((uniq.size, self.storage.layout.dim), dtype=torch.float64).index_add_(
            0, torch.from_numpy(group.astype(np.int64).reshape(-1)), torch.cat([v for _, v in parts]))
        self.step_row_sums = (uniq, sums)
        return self.storage.rows_of(uniq, sums)

    def ids_never_repeat(self, cache: dict) -> bool:
        """One id per bag and one table per feature: no example touches a (table, row) twice."""
        return self.storage.tables_unshared and cache["bags"].example.size == cache["inp"].example.size

    def row_groups(self, cache: dict) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct keys t·max_rows + local id, each id's index among them) of the
        trainer's ids this step, computed once (row sums and selection counts share it)."""
        if "row_groups" not in cache:
            inp = cache["inp"]
            cache["row_groups"] = unique_ints(self.storage.feature_table[inp.feature] * self.storage.max_rows + inp.local_id,
                                              return_inverse=True)
        return cache["row_groups"]

    def _clipped_row_sums64(self, factors: np.ndarray, trainer: int) -> tuple[np.ndarray, torch.Tensor]:
        """(sorted row keys t·max_rows + local id, float64 sums) of the trainer's clipped rows."""
        cache = self.cache(trainer)
        if "contrib" not in cache:  # nonprivate mode skips the norm pass
            raise RuntimeError("clipped_row_sums needs bag_grads, or example_sq_norms (or set_pooled_grad) first")
        inp, contrib, bags = cache["inp"], cache["contrib"], cache["bags"]
        if inp.example.size == 0:
            return np.empty(0, np.int64), torch.zeros((0, self.storage.layout.dim), dtype=torch.float64)
        per_id = torch.from_numpy(np.asarray(factors, dtype=np.float64))[torch.from_numpy(bags.id_example)]
        scaled = contrib.double() * per_id.unsqueeze(1)
        uniq, group = self.row_groups(cache)
        sums = torch.zeros((uniq.size, scaled.shape[1]), dtype=torch.float64).index_add_(0, torch.from_numpy(group), scaled)
        return uniq, sums

    def _clamped_row_sums64(self, factors: np.ndarray, trainer: int, bound: float) -> tuple[np.ndarray, torch.Tensor]:
        """As `_clipped_row_sums64`, with each example's clipped gradient of each row clamped to
        ±bound per coordinate before the rows are summed (ModelMix's refined clipping, seed B
        Alg 2): repeated ids of one example in one row add up first, as in `example_sq_norms`."""
        cache = self.cache(trainer)
        if "contrib" not in cache:
            raise RuntimeError("clipped_row_sums needs bag_grads or example_sq_norms first")
        inp, contrib, bags = cache["inp"], cache["contrib"], cache["bags"]
        if inp.example.size == 0:
            return np.empty(0, np.int64), torch.zeros((0, self.storage.layout.dim), dtype=torch.float64)
        row_key = self.storage.feature_table[inp.feature] * self.storage.max_rows + inp.local_id
        span = len(self.storage.ranges) * self.storage.max_rows
        pair, group = unique_ints(bags.id_example * span + row_key, return_inverse=True)
        pair_sums = torch.zeros((pair.size, contrib.shape[1]), dtype=torch.float64).index_add_(
            0, torch.from_numpy(group), contrib.double())
        f = torch.from_numpy(np.asarray(factors, dtype=np.float64))[torch.from_numpy(pair // span)]
        clamped = (pair_sums * f.unsqueeze(1)).clamp(-bound, bound)
        rows, inverse = unique_ints(pair % span, return_inverse=True)
        sums = torch.zeros((rows.size, contrib.shape[1]), dtype=torch.float64).index_add_(
            0, torch.from_numpy(inverse), clamped)
        return rows, sums

    def set_pooled_grad(self, bag_grads: np.ndarray, trainer: int = 0) -> None:
        """Cache per-id contributions without computing norms (nonprivate mode)."""
        self._contributions(bag_grads, trainer)
