"""DelayedScaling's backward update as graph operations (`triton_history_update=False`: the
default before session 43, and what runs without Triton), trained against eager TE with
option_training.py's checks. Its arithmetic against TE's kernel: test_graph_fp8_gpu.py's
test_delayed_update_matches_tes_kernel.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_history_graph_ops_gpu.py -m gpu -q
"""

from __future__ import annotations

import option_training
import pytest

pytestmark = pytest.mark.gpu

(
    option,
    test_layernorm_mlp_trains_as_eager_te,
    test_layernorm_linear_trains_as_eager_te,
    test_transformer_layer_matches_eager,
) = option_training.tests("triton_history_update", False)
