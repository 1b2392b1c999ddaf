"""The autocast cases shared by the CPU trace tests and the GPU suite."""

from __future__ import annotations

import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

FGS = q.FP8GlobalStateManager
RECIPE_CODES = {
    R.DelayedScaling: 1,
    R.Float8CurrentScaling: 2,
    R.Float8BlockScaling: 3,
    R.MXFP8BlockScaling: 4,
    R.NVFP4BlockScaling: 5,
    R.CustomRecipe: 6,
}


def state_code() -> int:
    """The autocast state as one number, read the way TE modules read it."""
    recipe = FGS.get_fp8_recipe()
    code = 0
    for cls, value in RECIPE_CODES.items():
        if type(recipe) is cls:
            code = value
    return code + 10 * int(FGS.is_fp8_enabled()) + 100 * int(FGS.is_fp8_calibration())


def in_autocast(**autocast_kwargs):
    def fn(x):
        with te.autocast(**autocast_kwargs):
            inside = x + state_code()
        return inside, x + state_code()

    return fn
