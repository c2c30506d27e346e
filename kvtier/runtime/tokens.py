"""Token ids from another program: ``token_list`` takes what ``match`` and the request calls
accept (a sequence of ints, a 1-D integer tensor or array) and refuses the rest by name."""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["token_list"]


def token_list(token_ids) -> list[int]:
    """Token ids as a list of Python ints: a sequence of ints, a 1-D integer tensor or a 1-D
    integer numpy array. Raises ``TypeError``/``ValueError`` naming ``token_ids`` otherwise."""
    if isinstance(token_ids, torch.Tensor):
        if (
            token_ids.dim() != 1
            or token_ids.dtype.is_floating_point
            or token_ids.dtype.is_complex
            or token_ids.dtype is torch.bool
            or token_ids.device.type == "meta"  # no values to read
        ):
            raise TypeError(
                f"token_ids: expected a 1-D integer tensor, got {token_ids.dim()}-D "
                f"{token_ids.dtype} on {token_ids.device}"
            )
        tokens = token_ids.tolist()
    elif isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise TypeError(
                f"token_ids: expected a 1-D integer array, got {token_ids.ndim}-D {token_ids.dtype}"
            )
        tokens = token_ids.tolist()
    elif isinstance(token_ids, (str, bytes, bytearray, memoryview)) or not isinstance(
        token_ids, Sequence
    ):
        raise TypeError(
            f"token_ids: expected a sequence of ints, a 1-D integer tensor or array, got "
            f"{type(token_ids).__name__}"
        )
    else:
        tokens = list(token_ids)
        if set(map(type, tokens)) - {int}:  # one C pass (all(... is int) costs 1.5x as much)
            for i, t in enumerate(tokens):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise TypeError(
                        f"token_ids: position {i} holds {t!r} ({type(t).__name__}), not an int"
                    )
            tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("token_ids: needs at least one token")
    try:  # packed as int64 in C (which bounds them above), then the minimum in numpy: ~30%
        # cheaper than min() and max()
        lo = int(np.frombuffer(array.array("q", tokens), dtype=np.int64).min())
        bad = lo if lo < 0 else None
    except OverflowError:  # an id outside int64: below -2**63 or from 2**63 up
        lo, hi = min(tokens), max(tokens)
        bad = lo if lo < 0 else hi
    if bad is not None:
        raise ValueError(
            f"token_ids: token id {bad} at position {tokens.index(bad)} is outside [0, 2**63)"
        )
    return tokens
