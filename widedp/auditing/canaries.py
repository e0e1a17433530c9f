"""Canaries for the audits: examples made from a data set's public metadata, with the auditor's
secret membership coins.

Neighbouring relation: the audited run is claimed (ε, δ)-DP for adding/removing one example
(docs/DESIGN.md §1), and each canary is one example; canary i is in the training set iff
`included[i]`, a fair coin from the auditor's generator, independent of everything else, so
flipping it is one add/remove — the setting `auditing.one_run_audit` bounds. Inserted phrases
(`make_phrase_examples`, the exposure test) are groups of examples: the example-level claim says
nothing about a phrase beyond group privacy.

One-run canaries (`make_canaries`) read rows of their own, appended to the audited tables, so a
canary's row history is the step's mechanism applied to that canary alone. Built from
`meta` (the data set's public `DatasetMeta`: kind, features, their tables and sizes, dense width)
and a numpy generator only; feeding them to training is the trainer's (trainer/run/audit.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


#: How a canary is made: "example" (a data point: its own row read through one feature, its
#: gradient what the model gives it) or "gradient" (the same example, but the gradient of its
#: pooled output set to G·u_i: a fixed secret unit direction u_i per canary, G = 1000 S1, so
#: after clipping its whole gradient is ≈ S1·u_i on its own row — Steinke et al.'s Dirac
#: gradient canaries, the strongest white-box adversary the clip norm allows).
CANARY_KINDS = ("example", "gradient")
#: G / S1 for gradient canaries: the dense part's share of the clipped gradient is ≤ ‖dense‖/G.
GRADIENT_CANARY_SCALE = 1000.0


@dataclasses.dataclass(frozen=True)
class Canaries:
    """m canaries: the table of each feature in `features` gets rows [first_row, first_row + m)
    (`first_rows`, one per feature); canary i reads row first_row + i through each of them and
    ids[f][i] through every other feature f; `included[i]` is its secret membership coin."""

    features: tuple[str, ...]  # () for inserted phrases (no rows of their own, `make_phrase_examples`)
    tables: tuple[str, ...]
    first_rows: tuple[int, ...]
    ids: dict  # feature -> int64 [m, 0] (empty bags) or [m, 1]
    dense: np.ndarray  # float32 [m, num_dense]
    labels: np.ndarray  # float32 [m]
    included: np.ndarray  # bool [m]
    directions: Optional[np.ndarray] = None  # float32 [m, len(features), D], unit per canary: gradient canaries
    gradient_norm: float = 0.0  # G: the injected pooled-output gradient is G · directions[i]

    @property
    def count(self) -> int:
        return int(self.included.size)

    def rows(self, j: int) -> np.ndarray:
        """The canary rows of table `tables[j]`, canary order."""
        return self.first_rows[j] + np.arange(self.count, dtype=np.int64)


def canary_features(meta, feature: Optional[str]) -> tuple[str, ...]:
    """The features whose tables get the canaries' own rows: `feature` None (the first feature),
    a name, a comma list, or "all" (every feature: a CTR canary that touches only rows of its own,
    one per table, so each table's selection gets its own chance to give it away). Each chosen
    feature must have a table of its own among them."""
    if feature == "all":
        if meta.kind == "cbow":
            raise ValueError("--feature all needs a CTR data set: a CBOW example reads the output table "
                             "through its target and negatives, which cannot all be rows of its own")
        chosen = tuple(meta.features)
    else:
        chosen = tuple((feature or meta.features[0]).split(","))
    for f in chosen:
        if f not in meta.features:
            raise ValueError(f"audit feature {f!r} is not a feature of the data set; features are {meta.features}")
    tables = [meta.feature_tables[f] for f in chosen]
    if len(set(tables)) != len(tables):
        raise ValueError(f"audit features {list(chosen)} share a table ({tables}); pick features with tables of their own")
    return chosen


def make_canaries(meta, count: int, feature: Optional[str], rng: np.random.Generator) -> Canaries:
    """`count` canaries for a data set with `meta` (trainer.data.DatasetMeta); `feature`: the
    one(s) whose tables get the canary rows (`canary_features`). Coins from `rng`."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 2:
        raise ValueError(f"--canaries must be an integer >= 2, got {count!r}")
    features = canary_features(meta, feature)
    tables = tuple(meta.feature_tables[f] for f in features)
    first_rows = tuple(int(meta.table_sizes[t]) for t in tables)
    # Other features: empty bags (CTR), or ids from their own tables (CBOW; never an audited table).
    ids = {f: (np.empty((count, 0), np.int64) if meta.kind == "ctr" or meta.feature_tables[f] in tables else
               rng.integers(0, meta.table_sizes[meta.feature_tables[f]], (count, 1)).astype(np.int64))
           for f in meta.features}
    for f, first_row in zip(features, first_rows):
        ids[f] = (first_row + np.arange(count, dtype=np.int64)).reshape(count, 1)
    dense = np.zeros((count, meta.num_dense), dtype=np.float32)
    labels = np.ones(count, dtype=np.float32) if meta.kind == "ctr" else np.zeros(count, dtype=np.float32)
    included = rng.random(count) < 0.5
    return Canaries(features, tables, first_rows, ids, dense, labels, included)


def as_gradient_canaries(canaries: Canaries, dim: int, clip_norm: Optional[float],
                         rng: np.random.Generator) -> Canaries:
    """The same canaries with injected gradients: directions uniform on the unit sphere of
    R^(len(features)·dim), G = GRADIENT_CANARY_SCALE · S1 (S1 = 1 when the run does not clip)."""
    width = len(canaries.features)
    u = rng.standard_normal((canaries.count, width * dim))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    return dataclasses.replace(canaries, directions=u.reshape(canaries.count, width, dim).astype(np.float32),
                               gradient_norm=GRADIENT_CANARY_SCALE * float(clip_norm or 1.0))


# ---- canary phrases: the seed's exposure test (wide-network-dp §6.5) -----------------------------------
#: Where an inserted phrase goes: "text" (seed §6.5: into the running text, between neighbour
#: words, so every example within ±window of it — 2·window + 3 per insertion — reads some of its
#: words among other context words) or "line" (as its own line: three examples whose whole
#: context is the phrase's other two words, the most the phrase can be memorized per example).
PHRASE_PLACEMENTS = ("text", "line")


def make_phrase_examples(meta, phrases: np.ndarray, insertions: int, rng: np.random.Generator,
                         placement: str = "line", neighbour_words: Optional[np.ndarray] = None) -> Canaries:
    """CBOW examples of 3-word phrases (c0, c1, c2) [N, 3], each inserted `insertions` times.
    `placement` (PHRASE_PLACEMENTS): "line": with a window covering the line, each word is a
    target once and the other two its context. "text": each insertion sits between 2·w words
    drawn from `neighbour_words` (the corpus's words, so i.i.d. from its unigram distribution;
    w = the data set's window, default 4) on each side, and every position within ±w of the
    phrase is an example (its ±w neighbours as context, text order) — what windowing the
    corpus with the phrase inserted gives, sentence breaks aside. Negatives uniform over the
    output table. All are members (included)."""
    if meta.kind != "cbow" or meta.features[:2] != ["context", "target"]:
        raise ValueError(f"--kind exposure needs a CBOW (text) data set, got kind {meta.kind!r}")
    if isinstance(insertions, bool) or not isinstance(insertions, (int, np.integer)) or insertions < 1:
        raise ValueError(f"--insertions must be an integer >= 1, got {insertions!r}")
    if placement not in PHRASE_PLACEMENTS:
        raise ValueError(f"--placement must be one of {list(PHRASE_PLACEMENTS)}, got {placement!r}")
    phrases = np.repeat(np.asarray(phrases, dtype=np.int64), insertions, axis=0)  # [N·n_c, 3]
    if placement == "line":
        target_pos = np.tile(np.arange(3), phrases.shape[0])
        lines = np.repeat(phrases, 3, axis=0)  # one example per (insertion, target position)
        context = np.take_along_axis(lines, np.array([[1, 2], [0, 2], [0, 1]])[target_pos], axis=1)
        targets = lines[np.arange(lines.shape[0]), target_pos]
    else:
        if neighbour_words is None or not np.asarray(neighbour_words).size:
            raise ValueError("placement 'text' needs the corpus's words (neighbour_words)")
        w = int(meta.extra.get("window", 4))
        n = phrases.shape[0]
        # [n, 2w | 3 | 2w] tokens: the phrase at [2w, 2w + 3); examples at positions [w, 3w + 3).
        words = np.asarray(neighbour_words, dtype=np.int64)
        text = np.concatenate([words[rng.integers(0, words.size, (n, 2 * w))], phrases,
                               words[rng.integers(0, words.size, (n, 2 * w))]], axis=1)
        positions = np.arange(w, 3 * w + 3)
        offsets = np.concatenate([np.arange(-w, 0), np.arange(1, w + 1)])
        context = text[:, positions[:, None] + offsets[None, :]].reshape(-1, 2 * w)  # [n·(2w+3), 2w]
        targets = text[:, positions].reshape(-1)
    count = targets.size
    ids = {"context": context, "target": targets.reshape(count, 1)}
    vocab_out = meta.table_sizes[meta.feature_tables["target"]]
    for f in meta.features[2:]:
        ids[f] = rng.integers(0, vocab_out, (count, 1)).astype(np.int64)
    return Canaries((), (), (), ids, np.zeros((count, meta.num_dense), np.float32), np.zeros(count, np.float32),
                    np.ones(count, dtype=bool))
