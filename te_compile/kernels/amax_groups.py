"""Process groups for DelayedScaling's amax reduction (`te.autocast(amax_reduction_group=...)`
with `DelayedScaling(reduce_amax=True)`), named by plain strings so they can cross op
boundaries.

The forward update at the autocast exit reduces in the traced graph (`torch.distributed.
all_reduce`, which dynamo turns into a functional collective). The backward update runs inside
the backward GEMM ops, where only the group's name arrives: the ops resolve it here. The name is
registered by `reduction_group_name`, called from traced module code; dynamo replays the
registration (a dict store) after each run of the forward graph, so the real group is in the
table before any backward op needs it.
"""

from __future__ import annotations

import torch

WORLD = "world"  # amax_reduction_group=None: the default group, as eager TE reduces over it
_GROUPS: dict[str, object] = {}


def reduction_group_name(reduce_amax: bool, group) -> str:
    """The name the ops reduce amaxes over, or "" for no reduction (reduce_amax off, or one
    rank). Registers `group` under it."""
    dist = torch.distributed
    if not (reduce_amax and dist.is_available() and dist.is_initialized()):
        return ""
    if dist.get_world_size(group) <= 1:
        return ""
    if group is None:
        return WORLD
    name = group.group_name
    _GROUPS[name] = group
    return name


def all_reduce_max(tensor: torch.Tensor, name: str) -> None:
    """In-place MAX all-reduce of `tensor` over the group registered as `name` (run time)."""
    dist = torch.distributed
    if name == WORLD:
        group = None
    elif name in _GROUPS:
        group = _GROUPS[name]
    else:
        raise RuntimeError(f"te_compile: no amax reduction group registered as {name!r}")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
