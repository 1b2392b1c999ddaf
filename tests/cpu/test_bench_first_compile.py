"""bench/first_compile_code.py: the wrapper's calls it compares, on a generated wrapper written
here (comments, asserts and buffer numbers dropped; launches and te_compile op calls kept)."""

from __future__ import annotations

from conftest import file_module

_WRAPPER = """
    def call(self, args):
        # Topologically Sorted Source Nodes: [sum_1], Original ATen: [aten.sum]
        buf3 = empty_strided_cuda((1024, ), (1, ), torch.bfloat16)
        triton_red_fused_sum_2.run(buf0, buf3, 4096, 128, stream=stream0)
        assert_alignment(buf6, 16, 'torch.ops.te_compile.layernorm_mlp_bwd.default')
        buf7 = torch.ops.te_compile.layernorm_mlp_bwd.default(buf3, None)
"""


def test_kernel_calls_keep_launches_and_op_calls_without_buffer_numbers():
    calls = file_module("first_compile_code", "bench/first_compile_code.py").kernel_calls(_WRAPPER)
    assert calls == [
        "triton_red_fused_sum_2.run(buf, buf, 4096, 128, stream=stream0)",
        "buf = torch.ops.te_compile.layernorm_mlp_bwd.default(buf, None)",
    ]
