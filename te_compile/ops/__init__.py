"""Custom ops, one file per TE kernel family. Arguments are plain values (tensors, numbers,
strings, lists); TE objects (recipes, quantizers, FP8 storages) are rebuilt inside the ops.

Importing this package registers: te_compile::amax_and_scale_update (delayed_scaling.py),
te_compile::linear_fwd and te_compile::linear_bwd (linear.py)."""

from . import delayed_scaling, linear  # noqa: F401
