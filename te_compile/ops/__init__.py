"""Custom ops, one file per TE kernel family. Arguments are plain values (tensors, numbers,
strings, lists); TE objects (recipes, quantizers, FP8 storages) are rebuilt inside the ops."""

from . import delayed_scaling  # noqa: F401  (registers te_compile::amax_and_scale_update)
