"""te-compile demo: an MLP of te.Linear layers trained under torch.compile(fullgraph=True) with FP8.

On a GPU: for each recipe, a 3-layer te.Linear MLP trains 20 steps with its forward + loss
compiled by inductor (fullgraph=True, te.autocast inside), and a fresh copy (same seed) trains the
same 20 steps with eager TE; a table compares graphs, losses and step times. A recipe that the
GPU or te-compile does not support prints one row with the reason.
Without a GPU: te_compile.check traces the same MLP, forward + backward with fullgraph=True, as
if on Hopper (Blackwell for MXFP8 and NVFP4): a table per GPU, per recipe and per te.Linear.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")

import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS  # noqa: E402

import te_compile  # noqa: E402
from te_compile_testing import InductorRecorder  # noqa: E402  (counts the graphs compiled)

# name: (recipe factory, the GPU generation the CPU trace pretends to be on)
RECIPES = {
    "bf16 (no FP8)": (lambda: None, "hopper"),
    "Float8CurrentScaling": (R.Float8CurrentScaling, "hopper"),
    "Float8BlockScaling": (R.Float8BlockScaling, "hopper"),
    "DelayedScaling": (R.DelayedScaling, "hopper"),
    "MXFP8BlockScaling": (R.MXFP8BlockScaling, "blackwell"),
    "NVFP4BlockScaling": (R.NVFP4BlockScaling, "blackwell"),
}
DIM, TOKENS, STEPS, LR = 1024, 2048, 20, 1e-3
LAYERS = ("fc1", "fc2", "fc3")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name in LAYERS:
            setattr(self, name, te.Linear(DIM, DIM, params_dtype=torch.bfloat16))

    def forward(self, x):
        x = torch.nn.functional.gelu(self.fc1(x))
        x = torch.nn.functional.gelu(self.fc2(x))
        return self.fc3(x)


def loss_fn(model, recipe):
    """Forward + MSE loss, under te.autocast with FP8 (no autocast at all for bf16)."""

    def forward_loss(x, y):
        fp8 = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with fp8:
            out = model(x)
        return torch.nn.functional.mse_loss(out.float(), y)

    return forward_loss


def reason(e: BaseException, width: int = 140) -> str:
    """The error's own message, unwrapped from dynamo's "Observed exception" and "backend=...
    raised:" wrappers: its first clause, at most `width` characters."""
    text = str(e)
    ours = re.search(r"(\w+ cannot run on this GPU: [^'\"\n)]*)", text)  # RecipeNotSupportedError
    if ours:
        return ours[1][:width]
    inner = re.search(r"raised exception \w+\((['\"])(.*?)\1\)", text, re.S)
    lines = [inner[2]] if inner else [ln for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.endswith(" raised:")] or [type(e).__name__]
    text = lines[0].split("; ")[0]  # the what, not the way out
    return text if len(text) <= width else text[: width - 3] + "..."


# ---- without a GPU: te_compile.check -----------------------------------------------------------


def trace_report() -> None:
    """te_compile.check on the same MLP, built as on a GPU under te_compile.simulate_gpu: each
    recipe traced forward + backward with fullgraph=True, for the whole model and per te.Linear."""
    te_compile.patch()
    print("No GPU: te_compile.check traces the MLP as if on the named GPU (nothing runs).")
    print(f"MLP: {len(LAYERS)} x te.Linear({DIM}, {DIM}, bf16) + GELU, {TOKENS} tokens.\n")
    # MXFP8 on Hopper shows how an unsupported recipe is reported (TE's reason).
    for arch, recipes in (
        ("hopper", ["none", "current", "block", "delayed", "mxfp8"]),
        ("blackwell", ["mxfp8", "nvfp4"]),
    ):
        with te_compile.simulate_gpu(arch):
            model = MLP()
            x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        print(te_compile.check(model, x, arch=arch, recipes=recipes).table())
        print()


# ---- on a GPU: train compiled and eager --------------------------------------------------------


def batches():
    """STEPS batches of a synthetic regression task: y = tanh(x @ teacher)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    teacher = torch.randn(DIM, DIM, device="cuda", generator=g) / DIM**0.5
    xs = [torch.randn(TOKENS, DIM, device="cuda", generator=g) for _ in range(STEPS)]
    return [(x.bfloat16(), torch.tanh(x @ teacher)) for x in xs]


def train(recipe, compiled: bool, data):
    """STEPS AdamW steps on a fresh MLP: (losses, median step ms of steps 2.., graphs)."""
    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    backend = InductorRecorder()
    step = loss_fn(model, recipe)
    if compiled:
        step = torch.compile(step, backend=backend, fullgraph=True)
    losses, times = [], []
    for x, y in data:
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(x, y)  # compiled: forward + loss; backward runs AOTAutograd's graph
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
        losses.append(loss.detach())
    return torch.stack(losses).cpu(), statistics.median(times[1:]), backend.graphs


def gpu_report() -> None:
    te_compile.patch()
    versions = f"torch {torch.__version__}, TE {transformer_engine.__version__}"
    print(f"{torch.cuda.get_device_name()}, {versions}")
    print(f"MLP: {len(LAYERS)} x te.Linear({DIM}, {DIM}, bf16) + GELU, {TOKENS} tokens, AdamW,")
    print(f"{STEPS} steps; compiled: forward + loss with inductor, fullgraph=True.\n")
    print(
        f"{'recipe':<22}{'graphs':>7}{'loss compiled':>15}{'loss eager':>12}"
        f"{'max |diff|':>12}{'ms compiled':>13}{'ms eager':>10}"
    )
    data = batches()
    for name, (make, _) in RECIPES.items():
        side = "compiled"
        try:
            loss_c, ms_c, graphs = train(make(), True, data)
            side = "eager"
            loss_e, ms_e, _ = train(make(), False, data)
        except (RuntimeError, AssertionError) as e:  # TE's eager support checks assert
            print(f"{name:<22}{side} run raises: {reason(e)}")
            continue
        diff = (loss_c - loss_e).abs().max().item()
        print(
            f"{name:<22}{graphs:>7}{loss_c[-1].item():>15.6f}{loss_e[-1].item():>12.6f}"
            f"{diff:>12.3g}{ms_c:>13.2f}{ms_e:>10.2f}"
        )
    print(
        f"\nmax |diff|: compiled vs eager loss over all {STEPS} steps (inductor fuses GELU and the\n"
        "loss, so last-bit differences can appear and grow). ms: median step time (forward,\n"
        f"backward, optimizer) of steps 2-{STEPS}."
    )


if __name__ == "__main__":
    start = time.time()
    if torch.cuda.is_available():
        gpu_report()
    else:
        trace_report()
    print(f"\ndone in {time.time() - start:.1f} s")
