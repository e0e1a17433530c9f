"""Per-table privacy policy of a sparse run: which tables are noised densely, which selected.

A table is either
  `dense`:  every row gets G + N(0, (σ·sensitivity)²) and is updated every step, exactly as
            DP-SGD treats every table (and as every step treats the dense parameters);
  `sparse`: its rows compete in the step's private row selection; only selected rows are
            noised and written back.
The policy is a function of public quantities only (table names and sizes, the expected batch
size b, the config), never of the data, so it costs no privacy: a dense row is a row that is
always selected, and the step's accounting is unchanged (docs/DESIGN.md §2). The selection
then runs over the rows of the sparse tables alone (`SparseVocabulary`), so its false
positives, k = gamma·vocabulary and its thresholds refer to those rows.

Default rule (`privacy.table_default = "auto"`): a table is dense when a batch can touch most
of it — when it has at most `privacy.dense_max_rows` rows, "auto" meaning b·m_t, with m_t the
most ids one example can put into the table (the sum over the features reading it of each
feature's public bound, `DatasetMeta.max_ids_per_example`: 1 for a single id, a list column's
`max_length`, CBOW's 2·window context; b·1 where a feature has no bound). At ≤ b·m_t rows dense
noise costs at most one noisy row per id an expected batch can hold, and such a table's rows are
the ones a batch touches most often, where thresholding only drops signal. Per-table overrides
(`[privacy.tables]`, `name = "dense" | "sparse"`) take precedence.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional


POLICIES = ("dense", "sparse")
DEFAULTS = ("auto", *POLICIES)


@dataclasses.dataclass(frozen=True)
class TablePolicy:
    """The resolved policy: table names per kind, in the layout's order, and the rule used."""

    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    rule: str

    def dense_indices(self, table_names: tuple[str, ...] | list[str]) -> tuple[int, ...]:
        return tuple(i for i, name in enumerate(table_names) if name in self.dense)

    def to_dict(self) -> dict:
        return {"dense": list(self.dense), "sparse": list(self.sparse), "rule": self.rule}


def resolve_table_policy(table_rows: Mapping[str, int], *, expected_batch_size: float, default: str = "auto",
                         dense_max_rows: Optional[int] = None, overrides: Optional[Mapping[str, str]] = None,
                         ids_per_example: Optional[Mapping[str, Optional[int]]] = None) -> TablePolicy:
    """The policy of every table in `table_rows` ({name: rows}, the layout's order).

    `default`: "auto" (dense iff rows ≤ `dense_max_rows`, None meaning b·m_t), "dense" or
    "sparse" for every table; `overrides`: {table name: "dense" | "sparse"};
    `ids_per_example`: {table: m_t, the most ids one example puts into it, or None when
    unbounded} (public metadata; a table missing from it, or None, counts m_t = 1). Errors name
    the config key (privacy.table_default, privacy.dense_max_rows, privacy.tables.<name>)."""
    overrides = dict(overrides or {})
    if default not in DEFAULTS:
        raise ValueError(f"privacy.table_default must be one of {DEFAULTS}, got {default!r}")
    if dense_max_rows is not None and dense_max_rows < 1:
        raise ValueError(f"privacy.dense_max_rows must be >= 1 or \"auto\", got {dense_max_rows}")
    unknown = sorted(set(overrides) - set(table_rows))
    if unknown:
        raise ValueError(f"privacy.tables.{unknown[0]}: no table named {unknown[0]!r}; "
                         f"the data set's tables are {list(table_rows)}")
    for name, kind in overrides.items():
        if kind not in POLICIES:
            raise ValueError(f"privacy.tables.{name} must be one of {POLICIES}, got {kind!r}")
    per_table = {name: (ids_per_example or {}).get(name) or 1 for name in table_rows}

    def limit_of(name: str) -> int:
        return int(expected_batch_size) * int(per_table[name]) if dense_max_rows is None else int(dense_max_rows)

    if default == "auto" and dense_max_rows is None:
        bounds = ", ".join(f"{n} {limit_of(n)}" for n in table_rows)
        rule = (f"dense when rows <= b × the most ids one example puts into the table (privacy.dense_max_rows = "
                f"auto; b = {int(expected_batch_size)}): {bounds}")
    elif default == "auto":
        rule = f"dense when rows <= {dense_max_rows} (privacy.dense_max_rows)"
    else:
        rule = f"every table {default} (privacy.table_default)"
    if overrides:
        rule += "; overrides: " + ", ".join(f"{n} = {k}" for n, k in overrides.items())

    def kind_of(name: str, rows: int) -> str:
        if name in overrides:
            return overrides[name]
        if default == "auto":
            return "dense" if rows <= limit_of(name) else "sparse"
        return default

    kinds = {name: kind_of(name, int(rows)) for name, rows in table_rows.items()}
    return TablePolicy(dense=tuple(n for n, k in kinds.items() if k == "dense"),
                       sparse=tuple(n for n, k in kinds.items() if k == "sparse"), rule=rule)
