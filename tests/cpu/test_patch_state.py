"""What patch() sets up besides the swaps: the registry of live TE GEMM modules that trace-time
state creation reads (persistent_state: construction while patched registers, one scan of the
garbage collector finds the modules made before), and te_compile's digest in torch.compile's
cache key tag (cache_key.py)."""

from __future__ import annotations

import time

import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile import cache_key
from te_compile.modules import persistent_state as ps


def test_modules_made_while_patched_are_registered_without_a_scan(patched):
    ps._live_modules()  # whatever scan this patch() owes is done
    scans = ps.scans()
    with te_compile.simulate_gpu("hopper"):
        modules = [te.Linear(16, 16), te.LayerNormLinear(16, 16), te.LayerNormMLP(16, 32)]
    live = ps._live_modules()
    assert ps.scans() == scans
    assert [m for m in live if any(m is x for x in modules)] == modules  # construction order


def test_modules_made_before_patch_are_found_by_one_scan():
    te_compile.unpatch()
    with te_compile.simulate_gpu("hopper"):
        before = te.Linear(16, 16)
    te_compile.patch()
    try:
        scans = ps.scans()
        assert any(m is before for m in ps._live_modules())
        ps._live_modules()
        assert ps.scans() == scans + 1
    finally:
        te_compile.unpatch()


def test_dead_modules_leave_the_registry(patched):
    with te_compile.simulate_gpu("hopper"):
        m = te.Linear(16, 16)
    ident = id(m)
    del m
    import gc

    gc.collect()
    assert all(id(x) != ident for x in ps._live_modules())


def test_unpatched_init_is_tes():
    from transformer_engine.pytorch.module.linear import Linear

    te_compile.patch()
    patched_init = Linear.__init__
    te_compile.unpatch()
    assert Linear.__init__ is not patched_init and Linear.__init__.__module__.startswith(
        "transformer_engine"
    )


def test_delayed_trace_of_a_stack_scans_at_most_once(patched, graph_breaks):
    """Trace-time state creation reads the registry: four TransformerLayers (12 GEMM modules,
    each trace site asking for state) cost at most the one scan patch() owes."""
    with te_compile.simulate_gpu("hopper"):
        layers = torch.nn.Sequential(
            *[te.TransformerLayer(64, 256, 4, params_dtype=torch.bfloat16) for _ in range(4)]
        ).cuda()
        recipe = R.DelayedScaling()

        def fwd(x):
            with te.autocast(recipe=recipe):
                return layers(x)

        x = torch.randn(32, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        scans, t0 = ps.scans(), time.perf_counter()
        torch.compile(fwd, backend="aot_eager", fullgraph=True)(x).float().sum().backward()
    assert graph_breaks() == 0 and ps.scans() - scans <= 1, time.perf_counter() - t0


def test_cache_key_tag_carries_the_digest_and_keeps_the_users():
    te_compile.unpatch()
    torch.compiler.config.cache_key_tag = "mine"
    try:
        te_compile.patch()
        assert torch.compiler.config.cache_key_tag == f"mine+te_compile-{cache_key.digest()}"
        te_compile.unpatch()
        assert torch.compiler.config.cache_key_tag == "mine"
    finally:
        te_compile.unpatch()
        torch.compiler.config.cache_key_tag = ""


def test_copies_are_registered(patched):
    import copy

    with te_compile.simulate_gpu("hopper"):
        m = te.Linear(16, 16)
    ps._live_modules()
    scans = ps.scans()
    for clone in (copy.deepcopy(m), copy.copy(m)):
        assert any(x is clone for x in ps._live_modules())
    assert ps.scans() == scans
