"""Private row selection over the whole vocabulary (pure library: numpy/torch, no Ray).

Every selector takes sparse input — the touched rows' ids and scores plus the vocabulary size
p (untouched rows have score 0 and stay selectable) — and an explicit RNG, and returns a
`Selection` that unpacks as `(ids, event)`. The config/CLI names live in the selector registry
(`selection.registry`: `get_selector(name)`, `selector_names()`), one class per selector in
`selection/selectors/`.
`gumbel_top_k_candidates` / `merge_top_k` (selection.partitioned): the exponential mechanism's
top-k computed on the shards that own the rows and merged exactly.
`gaussian_partition_selection` is the one-time key (vocabulary) selection over documents of
hashable keys; it returns a `PartitionSelection` (keys, noisy counts, event) instead.
"""

if __name__ != "widedp.selection":  # the repository's top-level selection/ is a link to widedp/selection/ (README, "Layout")
    raise ImportError(f"import widedp.selection, not {__name__}: each module exists once, under widedp (a second "
                      "copy under another name would hold second copies of its registries)")

from widedp.selection.exponential import exponential_top_k, k_from_fraction, paper_epsilon_per_draw
from widedp.selection.keyed_random import GaussianStream, NoiseKey
from widedp.selection.fest import fest_top_k, truncated_row_counts
from widedp.selection.noise import (NoisyStep, gaussian_noise, noisy_selected_rows, noisy_step,
                             secure_generator, step_sensitivity)
from widedp.selection.noisy_max import noisy_max_top_k
from widedp.selection.partitioned import ShardCandidates, gumbel_top_k_candidates, merge_top_k
from widedp.selection.partition import (PartitionSelection, bounded_key_counts, gaussian_partition_selection,
                                 partition_selection_threshold)
from widedp.selection.random_selection import random_rows
from widedp.selection.result import Selection
from widedp.selection.sparse_vector import numeric_sparse
from widedp.selection.threshold import contribution_counts, gaussian_threshold

__all__ = [
    "GaussianStream",
    "NoiseKey",
    "PartitionSelection",
    "Selection",
    "ShardCandidates",
    "bounded_key_counts",
    "contribution_counts",
    "exponential_top_k",
    "fest_top_k",
    "gaussian_noise",
    "NoisyStep",
    "noisy_step",
    "gaussian_partition_selection",
    "gaussian_threshold",
    "gumbel_top_k_candidates",
    "k_from_fraction",
    "merge_top_k",
    "noisy_max_top_k",
    "noisy_selected_rows",
    "numeric_sparse",
    "paper_epsilon_per_draw",
    "partition_selection_threshold",
    "random_rows",
    "secure_generator",
    "step_sensitivity",
    "truncated_row_counts",
]
