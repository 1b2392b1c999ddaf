"""A once-per-step backward update counted in tensors (issue 20, deliverable 2): a design
experiment in pure PyTorch, no TE, any machine.

    python bench/batched_update_prototype.py [aot_eager|inductor]

Each module holds a [1] int32 counter (a non-persistent buffer): its forward raises it, its
backward lowers it, and the "update" (here: state + 1) is applied with `torch.where` only when
the counter is back at 0, so a module used twice in a step updates once, after its last
backward, as eager TE's one update at the end of the backward. Prints, after 3 compiled steps,
each module's counter (0 expected) and update count (3 expected) for a module used once, used
twice, and two modules under torch.utils.checkpoint (whose recompute must not raise the counter
again). Session 29, CPU: all three as expected on torch 2.11 and 2.14, both backends.
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as cp


class CountedUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, uses, state):
        uses.add_(1)  # one more backward pending this step
        ctx.save_for_backward(w, uses, state)
        ctx.mark_dirty(uses)
        return x @ w, uses

    @staticmethod
    def backward(ctx, grad, _):
        w, uses, state = ctx.saved_tensors
        uses.sub_(1)
        state.copy_(torch.where(uses == 0, state + 1, state))  # the update, once per step
        return grad @ w.t(), None, None, None


class Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("uses", torch.zeros(1, dtype=torch.int32), persistent=False)
        self.register_buffer("updates", torch.zeros(1), persistent=False)

    def forward(self, x):
        return CountedUpdate.apply(x, self.w, self.uses, self.updates)[0]


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "aot_eager"
    for how in ("once", "twice", "checkpoint"):
        torch._dynamo.reset()
        a, b = Counted(), Counted()

        def step(x, how=how, a=a, b=b):
            if how == "once":
                return a(b(x))
            if how == "twice":
                return a(b(a(x)))
            return cp.checkpoint(lambda t: a(b(t)), x, use_reentrant=False)

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        for _ in range(3):
            compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()
        print(
            f"{how}: counters {a.uses.item()} {b.uses.item()}, "
            f"updates {a.updates.item():.0f} {b.updates.item():.0f}"
        )


if __name__ == "__main__":
    main()
