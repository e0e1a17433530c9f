"""Strict JSON for everything widedp writes (summary.json, metrics.jsonl, the CLI's output).

Python's `json` writes `Infinity`/`NaN`, which strict parsers (JavaScript's JSON.parse, jq's
--strict readers, Go's encoding/json) reject. Here a non-finite float becomes `null`; where a
null would be ambiguous the writer says why beside it (a non-private run's summary has
`"epsilon": null` with `"private": false`). numpy scalars and arrays become numbers and lists.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(obj: Any) -> Any:
    """`obj` with every non-finite float (also inside dicts, lists, tuples, numpy) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    kind = type(obj).__module__
    if kind == "numpy":
        if hasattr(obj, "tolist"):  # numpy scalar or array
            return finite_or_none(obj.tolist())
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `finite_or_none(obj)`, refusing anything that still is not strict JSON."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
