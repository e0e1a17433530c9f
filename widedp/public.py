"""The public surface's marker: `@public` tags what widedp promises to keep (named in
`widedp.__all__`, documented with Args/Returns/Raises, listed in the docs site's API
reference); everything else is internal and may change between releases.
tests/test_api.py holds every name of `widedp.__all__` marked and documented."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

PUBLIC_ATTRIBUTE = "__widedp_public__"


def public(obj: T) -> T:
    """Mark `obj` (a function or class) as part of the stable public API; returns it unchanged."""
    setattr(obj, PUBLIC_ATTRIBUTE, True)
    return obj


def is_public(obj: object) -> bool:
    return bool(getattr(obj, PUBLIC_ATTRIBUTE, False))
