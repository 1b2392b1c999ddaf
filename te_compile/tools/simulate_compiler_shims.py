"""The shims simulate_gpu (simulate.py) puts on torch's compiler while it simulates: what
compiled code on meta tensors needs that compiled code on a GPU does not. Each reaches into
torch internals, looked up lazily, and restores them on exit.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def rng_replay_on_meta():
    """Activation checkpointing recomputes a random op (TE's fused attention) in backward
    inside AOTAutograd's RNG-replay wrappers, whose kernels exist for real devices only. On
    meta tensors nothing random runs: the wrapped op is called as is. (torch internals, looked
    up lazily; without them checkpointed attention does not trace here, nothing else changes.)"""
    try:
        from torch._C import DispatchKey
        from torch._prims import rng_prims
    except ImportError:
        yield
        return

    def save_meta(select):
        def run_and_save(op, *args, **kwargs):
            if _meta_args(args, kwargs):
                return torch.get_rng_state(), op(*args, **kwargs)
            return select(op, *args, **kwargs)

        return run_and_save

    def replay_meta(select):
        def run_with(rng_state, op, *args, **kwargs):
            if _meta_args(args, kwargs):
                return op(*args, **kwargs)
            return select(rng_state, op, *args, **kwargs)

        return run_with

    wrappers = (
        (rng_prims.run_and_save_rng_state, save_meta),
        (rng_prims.run_with_rng_state, replay_meta),
    )
    saved = [(hop, hop.py_kernels.get(DispatchKey.BackendSelect)) for hop, _ in wrappers]
    try:
        for (hop, wrap), (_, select) in zip(wrappers, saved, strict=True):
            if select is not None:
                hop.py_kernels[DispatchKey.BackendSelect] = wrap(select)
                hop._dispatch_cache.clear()
        yield
    finally:
        for hop, select in saved:
            if select is not None:
                hop.py_kernels[DispatchKey.BackendSelect] = select
                hop._dispatch_cache.clear()


@contextlib.contextmanager
def inductor_decomposes_meta_mutations():
    """Inductor leaves a node whose inputs it cannot codegen (meta tensors among them) to a
    fallback, and a mutating custom op's `auto_functionalized_v2` node must be decomposed
    before lowering ("auto_functionalized_v2 was not removed"). On a GPU those inputs are CUDA
    tensors; on the simulation's meta tensors the decomposition is allowed too, so
    torch.compile's default backend traces what it would trace on the GPU. (torch internals,
    looked up lazily; without them nothing changes.)"""
    try:
        from torch._inductor import lowering
    except ImportError:
        yield
        return
    original = lowering.unsupported_input_tensor

    def unsupported_input_tensor(t, node=None):
        if t.is_meta and node is not None and "auto_functionalized" in str(node.target):
            return False
        return original(t, node)

    lowering.unsupported_input_tensor = unsupported_input_tensor
    try:
        yield
    finally:
        lowering.unsupported_input_tensor = original


@contextlib.contextmanager
def meta_outputs_keep_their_values():
    """Inductor's joint-graph pass `remove_no_ops` replaces every meta tensor a graph returns
    with a bare `empty_strided` (meta tensors hold no data). On torch 2.11 the new nodes carry
    no `val`, so the min-cut partitioner takes them for non-tensors it can neither save nor
    recompute and refuses the graph; torch 2.14 does not make them. On a GPU no output is a
    meta tensor. Here the nodes get their values back. (torch internals, looked up lazily.)"""
    try:
        from torch._inductor.fx_passes import joint_graph
    except ImportError:
        yield
        return
    original = joint_graph.remove_no_ops

    def remove_no_ops(gm, *args, **kwargs):
        result = original(gm, *args, **kwargs)
        for node in gm.graph.find_nodes(
            op="call_function", target=torch.ops.aten.empty_strided.default
        ):
            if "val" not in node.meta:
                size, stride = node.args[:2]
                node.meta["val"] = torch.empty_strided(size, stride, **node.kwargs)
        return result

    joint_graph.remove_no_ops = remove_no_ops
    try:
        yield
    finally:
        joint_graph.remove_no_ops = original


def _meta_args(args, kwargs) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)
