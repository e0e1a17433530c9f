"""The one exception type of the data layer."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data: a message naming the file and, where there is one, the row.

    Rows are 0-based data-row indices (``row 17``); for text inputs (Criteo TSV, plain text)
    the 1-based line number is given too (``line 18``). Subclasses ValueError so the CLI
    reports it as one line with exit code 2.
    """
