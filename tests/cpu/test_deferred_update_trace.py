"""DelayedScaling's backward update deferred to an eager autocast's exit (te_compile/
delayed_updates.py), traced on CPU with a pretend Hopper: which graph holds which update, and
when the deferral applies. Numerics against eager TE: tests/gpu/test_deferred_update_gpu.py."""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

import te_compile
from te_compile.modules import persistent_state
from te_compile.recipes import QuantConfig
from te_compile_testing import JointRecorder, graph_fp8, op_args, te_op_nodes

UPDATE = "te_compile.amax_and_scale_update.default"
SNAPSHOT = "te_compile.scale_snapshot.default"


def _two_layers(kind: str):
    bf16 = torch.bfloat16
    if kind == "Linear":
        return torch.nn.Sequential(*(te.Linear(64, 64, params_dtype=bf16) for _ in range(2)))
    return torch.nn.Sequential(
        te.LayerNormMLP(64, 128, params_dtype=bf16), te.Linear(64, 64, params_dtype=bf16)
    )


def _trace(kind: str, graph_path: bool, autocast_inside: bool):
    """One fwd+bwd of two TE modules under DelayedScaling: the recorder, and the second module's
    backward history after it."""
    rec = JointRecorder()
    recipe = R.DelayedScaling(amax_history_len=4)
    with te_compile.simulate_gpu("hopper"), graph_fp8(graph_path):
        torch.manual_seed(0)
        model = _two_layers(kind)
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if autocast_inside:

            def fn(x):
                with te.autocast(recipe=recipe):
                    return model(x)

            torch.compile(fn, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
        else:
            compiled = torch.compile(model, backend=rec.backend, fullgraph=True)
            with te.autocast(recipe=recipe):
                y = compiled(x)
            y.float().sum().backward()
    return rec


@pytest.mark.parametrize("graph_path", [False, True], ids=["te_kernels", "graph"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_under_an_eager_autocast_backward_only_records_amaxes(kind, graph_path, patched):
    """Compiled inside an eager te.autocast, the backward graph quantizes grad_output with TE's
    scale and merges its amax into the history, and neither updates the state nor snapshots the
    scale: the autocast's next exit updates every backward state at once."""
    rec = _trace(kind, graph_path, autocast_inside=False)
    fw, bw = JointRecorder.targets(rec.fw), JointRecorder.targets(rec.bw)
    assert UPDATE not in fw and UPDATE not in bw, (fw, bw)
    assert SNAPSHOT not in bw, bw
    if graph_path:
        assert "aten._scaled_mm.default" in bw, bw


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_under_a_traced_autocast_each_backward_updates_its_own_state(kind, patched):
    """An autocast traced inside the compiled function cannot run the backward update at its
    exit (the forward graph would write a tensor the backward graph writes): each module's
    backward updates its own state (inside the TE-kernel ops' backward)."""
    rec = _trace(kind, graph_path=False, autocast_inside=True)
    assert JointRecorder.targets(rec.fw).count(UPDATE) == 1  # the forward update at the exit
    assert _backward_configs(rec) == {False}
    assert _backward_configs(_trace(kind, graph_path=False, autocast_inside=False)) == {True}


def _backward_configs(rec) -> set:
    """Whether each backward GEMM op's config defers the update."""
    configs = {
        QuantConfig.from_key(op_args(node)["config"]).defers_backward_update
        for name, node in te_op_nodes(rec.bw)
        if name.endswith("_bwd")
    }
    assert configs, [name for name, _ in te_op_nodes(rec.bw)]
    return configs


def test_eager_autocast_flag_follows_the_outermost_autocast(patched):
    """The flag compiled modules read: set by an eager, enabled, outermost autocast, kept through
    nested ones, cleared at its exit; a disabled outermost autocast (whose exit never updates)
    leaves it clear."""
    recipe = R.DelayedScaling()
    with te_compile.simulate_gpu("hopper"):
        assert not persistent_state.autocast_is_eager()
        with te.autocast(recipe=recipe):
            assert persistent_state.autocast_is_eager()
            with te.autocast(enabled=False):
                assert persistent_state.autocast_is_eager()
            assert persistent_state.autocast_is_eager()
        assert not persistent_state.autocast_is_eager()
        with te.autocast(enabled=False):
            with te.autocast(recipe=recipe):
                assert not persistent_state.autocast_is_eager()
        assert not persistent_state.autocast_is_eager()


def test_flush_refuses_to_run_under_compile(patched):
    def fn(x):
        te_compile.flush_delayed_updates()
        return x + 1

    with pytest.raises(Exception, match="between steps"):
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))


def test_the_config_key_records_the_deferral(patched):
    """Two QuantConfigs, one per way of updating: a module compiled under an eager autocast and
    the same module traced with the autocast inside do not share cached code by accident."""
    from te_compile.recipes import for_linear

    recipe = R.DelayedScaling()
    deferred = for_linear(recipe, fp8_transpose=True, deferred_update=True)
    own = for_linear(recipe, fp8_transpose=True)
    assert deferred.defers_backward_update and not own.defers_backward_update
    assert deferred.key != own.key
    assert not for_linear(
        recipe, fp8_transpose=True, fused_update=False, deferred_update=True
    ).defers_backward_update
    FGS.reset()


def test_flushes_skip_a_module_now_set_up_for_another_recipe(patched):
    """A module compiled under DelayedScaling that later holds another recipe's fp8_meta (a
    checkpoint of another recipe loaded, an eager step under Float8CurrentScaling): state_dict's
    flush and flush_delayed_updates() leave it alone instead of failing on its recipe."""
    from te_compile import delayed_updates

    rec = _trace("Linear", graph_path=False, autocast_inside=False)
    assert rec.bw
    with te_compile.simulate_gpu("hopper"):
        linear = te.Linear(64, 64, params_dtype=torch.bfloat16)
        linear.fp8_meta["recipe"] = R.DelayedScaling()
        setattr(linear, persistent_state.DELAYED_ATTR, ("stale",))
        linear.fp8_meta["recipe"] = R.Float8CurrentScaling()
        linear.fp8_meta["scaling_bwd"] = object()  # another recipe's state: no amax_history
        delayed_updates._flush_module(linear)
        te_compile.flush_delayed_updates()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("fsdp_managed", [False, True], ids=["plain", "fsdp2"])
def test_backward_reads_state_in_backward(fsdp_managed, kind, bias, patched):
    """The graph path's backward reads TE's backward scale and history in the backward graph,
    from the forward inputs themselves: the autocast exit updates both between forward and
    backward. AOT autograd's partitioner may instead compute in the forward, and save, what
    depends on forward inputs alone; it did so under FSDP2 (fully_shard marks every module of
    its subtree `_is_fsdp_managed_module` and `_fsdp_use_orig_params`; dynamo then does not make
    their tensors static inputs), and the backward GEMMs ran with a stale scale's reciprocal
    (session 32's FSDP2 + DelayedScaling divergence). Traced with inductor's partitioner
    (min-cut)."""
    recipe = R.DelayedScaling(amax_history_len=4)
    rec = JointRecorder("min_cut")
    with te_compile.simulate_gpu("hopper"), graph_fp8(True):
        bf16 = torch.bfloat16
        if kind == "Linear":
            module = te.Linear(64, 64, bias=bias, params_dtype=bf16)
        else:
            module = te.LayerNormMLP(64, 128, bias=bias, params_dtype=bf16)
        for m in module.modules() if fsdp_managed else ():
            m._is_fsdp_managed_module = m._fsdp_use_orig_params = True
        module.compile(fullgraph=True, backend=rec.backend)
        x = torch.randn(32, 64, device="cuda", dtype=bf16, requires_grad=True)
        with te.autocast(recipe=recipe):
            y = module(x)
        y.float().sum().backward()
    (fw,), (bw,) = rec.fw, rec.bw
    forward_inputs = {n.name for n in fw.graph.find_nodes(op="placeholder")}
    ops = torch.ops.te_compile
    # The backward scale's readers: graph operations tied to the gradient for an inductor-made
    # cast (a bias-less GEMM's grad_output: graph_fp8.delayed.read_with), TE's fused dbias cast
    # (a biased one's; LayerNormMLP's FC1 always). No copy: nothing in this backward writes it.
    assert not bw.graph.find_nodes(op="call_function", target=ops.scale_in_backward.default)
    te_casts = bw.graph.find_nodes(op="call_function", target=ops.delayed_grad_quantize.default)
    where = bw.graph.find_nodes(op="call_function", target=torch.ops.aten.where.self)
    tied = [w for w in where if w.args[2].op == "placeholder"]
    tied = [w for w in tied if "tangents" in str(_inputs_above(w.args[0]))]
    assert len(tied) == (0 if bias else 1)
    assert len(te_casts) == {"Linear": int(bias), "LayerNormMLP": 1 + bias}[kind]
    for read in tied:  # TE's scale itself, not a value of it (nor a view saved for it)
        never, _, scale = read.args
        assert scale.name in forward_inputs
        assert "tangents" in str(_inputs_above(never))
    for read in te_casts:
        assert op_args(read)["scales"].name in forward_inputs
    writes = bw.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    history = [w.args[0] for w in writes]
    assert len(history) == 1 and history[0].name in forward_inputs
    # the value written: the history max-merged with the amaxes, read directly (functionalized:
    # copy_(history, copy(history, maximum(history, amaxes))))
    merged = writes[0].args[1]
    assert merged.target == torch.ops.aten.copy.default
    merged = merged.args[1]
    assert merged.target == torch.ops.aten.maximum.default and merged.args[0] is history[0]


@pytest.mark.parametrize("graph_path", [True, False], ids=["graph_path", "te_kernels"])
def test_fsdp2_marks_leave_the_partition_as_it_is(graph_path, patched):
    """A TransformerLayer under DelayedScaling with an eager autocast partitions the same with
    and without FSDP2's marks (the first test's reason: under them dynamo makes no module tensor
    a static input, and the partitioner's choices may change). Session 32's code saved
    LayerNormMLP's forward-time backward scales under the marks."""

    def backward_code(fsdp_managed: bool) -> list[str]:
        torch._dynamo.reset()
        FGS.reset()
        rec = JointRecorder("min_cut")
        with te_compile.simulate_gpu("hopper"), graph_fp8(graph_path):
            torch.manual_seed(0)
            layer = te.TransformerLayer(
                64, 256, 4, params_dtype=torch.bfloat16, hidden_dropout=0, attention_dropout=0
            )
            for m in layer.modules() if fsdp_managed else ():
                m._is_fsdp_managed_module = m._fsdp_use_orig_params = True
            layer.compile(fullgraph=True, backend=rec.backend)
            x = torch.randn(32, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with te.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
                y = layer(x)
            y.float().sum().backward()
        return [g.code for g in rec.bw]

    plain = backward_code(False)
    assert len(plain) == 1
    assert backward_code(True) == plain


def _inputs_above(node) -> set[str]:
    """The placeholders `node` is computed from."""
    seen, todo, found = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n.name)
        todo.extend(n.all_input_nodes)
    return found
