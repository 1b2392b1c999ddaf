"""Process groups named by plain strings, so they can cross op boundaries: DelayedScaling's
amax reduction group (`te.autocast(amax_reduction_group=...)` with `reduce_amax=True`) and a
module's tensor-parallel group (`tp_group`).

A group's name is registered by `name_of`, called from traced module code: dynamo runs the
registration while it traces (an `assume_constant_result` function), so the table holds the
group before the first graph runs (a forward op may need it). Ops resolve names with
`group_of` at run time.

The forward DelayedScaling update at the autocast exit reduces in the traced graph
(`torch.distributed.all_reduce`, which dynamo turns into a functional collective); the
backward update and tensor-parallel communication run inside ops, where only names arrive.
"""

from __future__ import annotations

import torch

WORLD = "world"  # group None: the default group
_GROUPS: dict[str, object] = {}


def name_of(group) -> str:
    """The name ops resolve `group` by (None: the default group); registers it."""
    if group is None:
        return WORLD
    return _registered(group)


@torch.compiler.assume_constant_result
def _registered(group) -> str:
    group = real_group(group)
    _GROUPS[group.group_name] = group
    return group.group_name


def real_group(group):
    """`group` itself where dynamo hands an `assume_constant_result` function a stand-in for it
    (a FakeScriptObject, which keeps the group as `real_obj`): ops reduce over the real group
    at run time, and TE keys its DelayedScaling buffers by the group's identity."""
    real = getattr(group, "real_obj", group)
    if real is not None and not isinstance(real, torch.distributed.ProcessGroup):
        raise TypeError(f"te_compile: expected a torch.distributed.ProcessGroup, got {type(real)}")
    return real


def group_of(name: str):
    """The process group registered as `name` (run time)."""
    if name == WORLD:
        return None
    if name not in _GROUPS:
        raise RuntimeError(f"te_compile: no process group registered as {name!r}")
    return _GROUPS[name]


def reduction_group_name(reduce_amax: bool, group) -> str:
    """The name the ops reduce amaxes over, or "" for no reduction (reduce_amax off, or one
    rank). Registers `group` under it."""
    dist = torch.distributed
    if not (reduce_amax and dist.is_available() and dist.is_initialized()):
        return ""
    if dist.get_world_size(group) <= 1:
        return ""
    return name_of(group)


def all_reduce_max(tensor: torch.Tensor, name: str) -> None:
    """In-place MAX all-reduce of `tensor` over the group registered as `name` (run time)."""
    dist = torch.distributed
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group_of(name))
