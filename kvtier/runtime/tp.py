"""Tensor-parallel agreement: the rank, and fixed-size MIN/MAX all-reduces on a CPU group.

Every decision that changes a tree is taken on values all ranks agreed on, so their trees change
identically. Without a group (one rank) every helper is the identity.
"""

from __future__ import annotations

import torch

__all__ = ["all_reduce_max", "all_reduce_min", "rank_and_size"]


def rank_and_size(group) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` without a group."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(values: torch.Tensor, group, op: str) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(values, op=getattr(dist.ReduceOp, op), group=group)
    return values


def all_reduce_min(values: torch.Tensor, group) -> torch.Tensor:
    """In place: each element becomes its minimum over the ranks (what every rank has)."""
    return _all_reduce(values, group, "MIN")


def all_reduce_max(values: torch.Tensor, group) -> torch.Tensor:
    """In place: each element becomes its maximum over the ranks (what any rank still has)."""
    return _all_reduce(values, group, "MAX")
