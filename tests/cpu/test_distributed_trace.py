"""DelayedScaling amax reduction under torch.compile, traced on CPUs: 2 processes (gloo), a
te.Linear on fake CUDA tensors (te_compile.simulate_gpu), `te.autocast(recipe=DelayedScaling(
reduce_amax=True), amax_reduction_group=...)` inside the compiled step, fullgraph.

What is checked per rank: one forward and one backward graph, no graph break; the forward
graph holds the MAX all-reduce as a functional collective feeding the amax/scale update (as
eager TE reduces at the autocast exit); the backward GEMM op gets the group's name, resolvable
in that process, to reduce its backward amaxes (kernels/process_groups.py); without reduce_amax,
neither. And the reduction's numerics on CPU tensors, through TE's Python update (the
`NVTE_UNFUSED_FP8_UPDATE` path): the update op reducing over the group by name, or given amaxes
the caller reduced, equals TE's reduce-then-update on every rank. The fused CUDA kernel's runs
on 2 GPUs (tests/gpu/test_distributed_gpu.py).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trace_on_rank(rank: int, port: int, results, work=None) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results[rank] = (work or _trace)(dist)
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        results[rank] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()


def _trace(dist) -> dict:
    import transformer_engine.pytorch as te
    from torch._dynamo.utils import counters
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

    import te_compile
    from te_compile.kernels import process_groups as amax_groups
    from te_compile.recipes import QuantConfig
    from te_compile_testing import JointRecorder, op_targets

    te_compile.patch()
    # The TE-kernel ops carry the backward's group (the graph path refuses amax reduction; this
    # test reads the backward op's config, so the case without a reduction stays there too).
    te_compile.configure(graph_fp8=False)
    subgroup = dist.new_group(list(range(WORLD)))
    out = {}
    for name, reduce_amax, group in (
        ("world", True, None),
        ("subgroup", True, subgroup),
        ("no_reduction", False, None),
        ("eager_subgroup", False, subgroup),  # the autocast around the compiled module
    ):
        torch._dynamo.reset()
        counters.clear()
        FGS.reset()  # eager TE's autocast exit updates every recipe key it holds: one per case
        recipe = R.DelayedScaling(reduce_amax=reduce_amax)
        with te_compile.simulate_gpu("hopper"):
            linear = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

            def step(x, linear=linear, recipe=recipe, group=group):
                with te.autocast(recipe=recipe, amax_reduction_group=group):
                    return linear(x)

            rec = JointRecorder()
            if name.startswith("eager"):
                with te.autocast(recipe=recipe, amax_reduction_group=group):
                    y = torch.compile(linear, backend=rec.backend, fullgraph=True)(x)
                y.sum().backward()
            else:
                torch.compile(step, backend=rec.backend, fullgraph=True)(x).sum().backward()
        bwd_configs = [
            n.kwargs["config"]
            for gm in rec.bw
            for n in gm.graph.nodes
            if "linear_bwd" in str(n.args[0] if n.args else "")
        ]
        group_names = {QuantConfig.from_key(c).amax_group for c in bwd_configs}
        keys = FGS.quantization_state.global_amax_buffer
        out[name] = {
            # TE's buffers are keyed by (recipe, group); each exit reduces a key over its group
            "registered_groups": sorted(
                "world"
                if k.endswith("group=None")
                else "subgroup"
                if k.endswith(f"group={id(subgroup)}")
                else k
                for k in keys
            ),
            "fw_reduce_groups": sorted(
                n.args[2]
                for gm in rec.fw
                for n in gm.graph.nodes
                if str(n.target) == "_c10d_functional.all_reduce.default"
            ),
            "deferred": sorted({QuantConfig.from_key(c).deferred_update for c in bwd_configs}),
            "graphs": (len(rec.fw), len(rec.bw)),
            "breaks": sum(counters["graph_break"].values()),
            "fw_ops": op_targets(rec.fw),
            "bwd_groups": sorted(group_names),
            "resolvable": all(
                n == amax_groups.WORLD or n in amax_groups._GROUPS for n in group_names if n
            ),
            "subgroup_name": subgroup.group_name,
            "world_name": dist.group.WORLD.group_name,
        }
    FGS.reset()
    with te_compile.simulate_gpu("hopper"):
        linear = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")
        te_compile.prepare(linear, R.DelayedScaling(), amax_reduction_group=subgroup)
    keys = list(FGS.quantization_state.global_amax_buffer)
    out["prepared"] = (
        linear.fp8_meta["fp8_group"] is subgroup
        and len(keys) == 2
        and all(k.endswith(f"group={id(subgroup)}") for k in keys)
    )
    try:  # prepared under the subgroup already: TE's buffers cannot move it
        with te_compile.simulate_gpu("hopper"):
            te_compile.prepare(linear, R.DelayedScaling(), amax_reduction_group=None)
        out["prepare_again_error"] = ""
    except RuntimeError as e:
        out["prepare_again_error"] = str(e)
    out["second_model_error"] = _second_model_under_another_group(subgroup)
    return out


def _second_model_under_another_group(subgroup) -> str:
    """Model A's first trace (under `subgroup`) registers every live TE module, model B's too;
    B's own trace under the default group must then refuse, not reduce over A's group."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

    import te_compile

    torch._dynamo.reset()
    FGS.reset()
    recipe = R.DelayedScaling(reduce_amax=True)
    with te_compile.simulate_gpu("hopper"):
        a, b = (te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda") for _ in range(2))
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)

        def run(model, group):
            def step(x):
                with te.autocast(recipe=recipe, amax_reduction_group=group):
                    return model(x)

            return torch.compile(step, backend="eager", fullgraph=True)(x)

        run(a, subgroup)
        try:
            run(b, None)
        except Exception as e:  # noqa: BLE001 (dynamo may wrap it)
            return f"{type(e).__name__}: {e}"
    return ""


def _update_numerics(dist) -> dict:
    """Our update with the reduction vs TE's reduce (all-gather + max here) then update, per
    history/scale pair, on this rank's CPU tensors."""
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch import quantization as q

    from te_compile.kernels.delayed_update import amax_and_scale_update as update_amax_and_scale

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    histories = [torch.rand(4, 3, generator=g), torch.rand(4, 1, generator=g)]
    for h in histories:  # this rank's latest amaxes differ from the other's
        h[0] = torch.rand(h.shape[1], generator=torch.Generator().manual_seed(10 + rank)) * 8
    scales = [torch.full((3,), 2.0), torch.full((1,), 0.5)]

    latest = torch.cat([h[0] for h in histories])
    gathered = [torch.empty_like(latest) for _ in range(WORLD)]
    dist.all_gather(gathered, latest)
    reduced = torch.stack(gathered).amax(dim=0)
    want_h, want_s = [h.clone() for h in histories], [s.clone() for s in scales]
    recipe = R.DelayedScaling(margin=0, amax_compute_algo="max")
    for h, s, row in zip(want_h, want_s, reduced.split([3, 1]), strict=True):
        h[0] = row
        q._amax_and_scale_update(h, s, R.Format.E4M3.value.max_fwd, recipe)

    def run(**kwargs):
        hs, ss = [h.clone() for h in histories], [s.clone() for s in scales]
        update_amax_and_scale(hs, ss, "max", "e4m3", 0.0, False, **kwargs)
        return hs, ss

    def same(got, want):
        pairs = zip(got, want, strict=True)
        return all(torch.equal(x, y) for a, b in pairs for x, y in zip(a, b, strict=True))

    by_name, given = run(reduce_group="world"), run(latest=reduced.clone())
    return {
        "by_name": same(by_name, (want_h, want_s)),
        "given": same(given, (want_h, want_s)),
        "without_reduction_differs": not same(run(), (want_h, want_s)),
        "scales": torch.cat(by_name[1]).tolist(),
    }


def _spawn(work=None) -> dict:
    """Run `work(dist)` (default: the traces) on WORLD gloo ranks; {rank: its result}."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        args = [(r, port, results, work) for r in range(WORLD)]
        procs = [ctx.Process(target=_trace_on_rank, args=a) for a in args]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        return dict(results)


@pytest.fixture(scope="module")
def traces():
    return _spawn()


def _case(traces, rank, name):
    result = traces[rank]
    assert "error" not in result, result.get("error")
    return result[name]


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("name", ["world", "subgroup"])
def test_amax_all_reduce_in_forward_graph(traces, rank, name):
    case = _case(traces, rank, name)
    assert case["graphs"] == (1, 1) and case["breaks"] == 0
    ops = case["fw_ops"]
    reduce_at = ops.index("_c10d_functional.all_reduce.default")
    assert "_c10d_functional.wait_tensor.default" in ops
    assert ops.index("te_compile.amax_and_scale_update.default") > reduce_at
    want = "world" if name == "world" else case["subgroup_name"]
    assert case["bwd_groups"] == [want] and case["resolvable"]
    # The state is registered under the autocast's group, so its exit reduces over that group
    # (before session 31 te_compile registered it under the default group: the world).
    assert case["registered_groups"] == [name, name]  # forward and backward keys
    assert case["fw_reduce_groups"] == [case["world_name" if name == "world" else "subgroup_name"]]


@pytest.mark.parametrize("rank", range(WORLD))
def test_under_an_eager_autocast_with_a_subgroup_the_backward_update_is_deferred(traces, rank):
    """Compiled modules defer their backward update to an eager autocast's exit whatever its
    amax reduction group: their state is registered under that group, as eager TE's is."""
    case = _case(traces, rank, "eager_subgroup")
    assert case["breaks"] == 0 and case["deferred"] == [True], case
    assert case["registered_groups"] == ["subgroup", "subgroup"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_prepare_registers_under_the_given_group(traces, rank):
    assert "error" not in traces[rank], traces[rank].get("error")
    assert traces[rank]["prepared"]
    assert "already registered under amax_reduction_group" in traces[rank]["prepare_again_error"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_module_registered_under_another_group_is_refused(traces, rank):
    """Eager TE would register the second model under its own autocast's group; te_compile's
    first trace registered it under the first model's: refused by name, prepare() the way out."""
    assert "error" not in traces[rank], traces[rank].get("error")
    message = traces[rank]["second_model_error"]
    assert "registered under amax_reduction_group" in message, message
    assert "traced under None (the default group)" in message and "te_compile.prepare" in message


@pytest.mark.parametrize("rank", range(WORLD))
def test_no_collective_without_reduce_amax(traces, rank):
    case = _case(traces, rank, "no_reduction")
    assert case["graphs"] == (1, 1) and case["breaks"] == 0
    assert not any("c10d" in op for op in case["fw_ops"])
    assert case["bwd_groups"] == [""]


def test_reduced_update_equals_te_on_every_rank():
    results = _spawn(_update_numerics)
    for rank in range(WORLD):
        r = results[rank]
        assert "error" not in r, r.get("error")
        assert r["by_name"] and r["given"], r
        assert r["without_reduction_differs"], r  # the ranks' amaxes really differ
    assert results[0]["scales"] == results[1]["scales"]  # one scale across ranks
