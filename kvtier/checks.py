"""Checks of numbers from another program, shared by every layer."""

from __future__ import annotations

import math

__all__ = ["is_finite"]


def is_finite(value: float) -> bool:
    """``math.isfinite``, False (not ``OverflowError``) for an int beyond a float's range: a
    number of seconds or a rate like ``10**400`` is refused by name, as ``inf`` is."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
