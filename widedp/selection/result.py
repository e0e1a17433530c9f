"""What every selector returns."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from widedp.accounting.events import DpEvent


@dataclasses.dataclass(frozen=True)
class Selection:
    """Selected row ids (sorted, unique, int64) and the privacy event of the selection.

    Unpacks as `ids, event = selector(...)`. `values` is set only by selectors that also
    release noisy values (NumericSparse); it is aligned with `ids`.
    """

    ids: np.ndarray
    event: DpEvent
    values: Optional[np.ndarray] = None

    def __iter__(self):
        return iter((self.ids, self.event))
