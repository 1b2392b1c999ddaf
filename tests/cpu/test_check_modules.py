"""te_compile.check's per-module cases take each TE module's inputs from the whole-model trace
(te_compile/tools/check_modules.py): the model's eager code runs only when the whole-model case
stopped before some module, and then what it raised is reported."""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te

import te_compile

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")
HIDDEN = 64


def _linear():
    return te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16)


class TwoLinears(torch.nn.Module):
    """fc1, then the model's own code (`between`), then fc2."""

    def __init__(self, between):
        super().__init__()
        self.fc1, self.fc2 = _linear(), _linear()
        self.between = between

    def forward(self, x):
        return self.fc2(self.between(self.fc1(x)))


def _check(make_model, **kw):
    """te_compile.check of `make_model()` (built as on a GPU) on a (16, HIDDEN) input."""
    with te_compile.simulate_gpu("hopper"):
        model = make_model().cuda()
        x = torch.randn(16, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return te_compile.check(model, x, recipes=kw.pop("recipes", ["current"]), **kw)


def _statuses(report):
    return {r.target: r.status for r in report.results}


def eager_only_item(h):
    """As HF transformers' mask code: eagerly, `.item()` on a tensor derived from the input
    (meta tensors raise: "Tensor.item() cannot be called on meta tensors"); under compile the
    read is skipped."""
    if not torch.compiler.is_compiling() and h.isnan().any().item():
        raise ValueError("NaN activations")
    return h * 2


def test_eager_only_code_of_the_model_is_not_run(patched):
    """The old per-module cases ran the model eagerly on meta tensors: eager_only_item raised
    there and every module after it read "not reached ... the model's own code raised first"
    (exit 1) while the whole-model case passed. Inputs recorded from the trace: all pass."""
    report = _check(lambda: TwoLinears(eager_only_item), recipes=["current", "delayed"])
    assert report.ok, report.table()
    assert [r.status for r in report.results] == ["ok"] * 6, report.table()
    assert all(r.graphs == 2 and "linear_bwd" in r.ops for r in report.results), report.table()
    assert report.notes == ()


@torch.compiler.disable
def _outside_the_graph(h):
    return h + 1


def test_a_graph_break_in_the_model_s_code_still_checks_every_module(patched):
    """The whole-model case breaks between fc1 and fc2: fc1's inputs come from the trace, fc2's
    from the model run eagerly on meta tensors (the fallback); both modules pass."""
    report = _check(lambda: TwoLinears(_outside_the_graph))
    assert _statuses(report) == {"model": "break", "fc1": "ok", "fc2": "ok"}, report.table()
    assert not report.ok and report.notes == ()


def _branch_on_data(h):
    if h.float().sum() > 0:  # a graph break under compile; on meta tensors eagerly it raises
        return h * 2
    return h


def test_an_error_of_the_model_s_eager_code_is_reported(patched):
    """When the fallback's eager run raises in the model's own code, the report says what
    raised and the way out, instead of hiding it."""
    report = _check(lambda: TwoLinears(_branch_on_data))
    assert _statuses(report) == {"model": "break", "fc1": "ok", "fc2": "not reached"}
    assert "the model's own code raised (note)" in report.results[2].reason
    (note,) = report.notes
    assert "RuntimeError: Tensor.item() cannot be called on meta tensors" in note, note
    assert "--whole-model-only" in note
    assert "note: [current] the whole-model case stopped before 1 TE module" in report.table()


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = _linear(), _linear()

    def forward(self, x):
        return self.used(x)


def test_a_module_the_forward_does_not_call_is_not_a_failure(patched):
    report = _check(WithUnused)
    assert _statuses(report) == {"model": "ok", "used": "ok", "unused": "not called"}
    assert report.ok, report.table()
    assert "2 of 3 cases passed" not in report.table()
    assert "3 of 3 cases passed (1 not called)" in report.table()


class Deep(torch.nn.Module):
    """More instances of one TE class than dynamo's recompile limit (8)."""

    def __init__(self, depth: int = 10):
        super().__init__()
        self.layers = torch.nn.Sequential(*(_linear() for _ in range(depth)))

    def forward(self, x):
        return self.layers(x)


def test_more_instances_than_the_recompile_limit(patched):
    report = _check(Deep)
    assert report.ok, report.table()
    assert len(report.results) == 11 and all(r.graphs == 2 for r in report.results)


def test_kwargs_and_shapes_come_from_the_trace(patched):
    """A TransformerLayer called with a keyword tensor (a padding mask built in the forward)
    and a 3-D input: its case rebuilds both from the specs recorded in the trace."""

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = te.TransformerLayer(
                HIDDEN,
                2 * HIDDEN,
                4,
                params_dtype=torch.bfloat16,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="padding",
            )

        def forward(self, x):
            padding = torch.zeros(x.shape[1], 1, 1, x.shape[0], dtype=torch.bool)
            return self.layer(x, attention_mask=padding.to(x.device))

    with te_compile.simulate_gpu("hopper"):
        model = Wrapper().cuda()
        x = torch.randn(32, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    report = te_compile.check(model, x, recipes=["current"])
    assert _statuses(report) == {"model": "ok", "layer": "ok"}, report.table()


def _tiny_hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    for layer in model.model.layers:  # the projections as te.Linear
        for block in (layer.self_attn, layer.mlp):
            for name, child in list(block.named_children()):
                if isinstance(child, torch.nn.Linear):
                    linear = te.Linear(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        params_dtype=torch.bfloat16,
                    )
                    setattr(block, name, linear)
    return model.cuda()


def test_hf_llama_with_te_linears(patched):
    """HF transformers' eager mask code calls `.item()` (the case this was reported on): with
    inputs recorded from the trace every per-module case runs."""
    with te_compile.simulate_gpu("hopper"):
        model = _tiny_hf_llama()
        ids = torch.randint(0, 128, (2, 32), device="cuda")
    report = te_compile.check(model, ids, recipes=["current"])
    assert report.ok, report.table()
    assert len(report.results) == 15 and {r.status for r in report.results} == {"ok"}


def test_inputs_not_recorded_fail_loudly(patched, monkeypatch):
    """If the recording hook stopped working (a torch that changed dynamo's comptime), the
    per-module cases fail instead of passing as "not called"."""
    import torch._dynamo.comptime

    monkeypatch.setattr(torch._dynamo.comptime, "comptime", lambda fn, fallback=None: None)
    report = _check(lambda: TwoLinears(torch.nn.functional.gelu))
    assert _statuses(report) == {"model": "ok", "fc1": "error", "fc2": "error"}
    assert "could not record its inputs" in report.results[1].reason
