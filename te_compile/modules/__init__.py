"""Compile paths for TE modules, one file per module. Each file's `swaps()` patches the module's
forward so that TE runs unchanged outside torch.compile and our ops run while tracing."""

from __future__ import annotations

from ..patching import Swap


def swaps() -> list[Swap]:
    from . import (
        attention,
        checkpointing,
        layernorm,
        layernorm_linear,
        layernorm_mlp,
        linear,
        persistent_state,
        transformer_layer,
    )

    return (
        persistent_state.swaps()
        + linear.swaps()
        + layernorm.swaps()
        + layernorm_linear.swaps()
        + layernorm_mlp.swaps()
        + attention.swaps()
        + checkpointing.swaps()
        + transformer_layer.swaps()
    )
