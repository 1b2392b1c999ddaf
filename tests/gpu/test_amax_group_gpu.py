"""DelayedScaling under `te.autocast(amax_reduction_group=<subgroup>)` on 2 or 4 GPUs: compiled
modules' state registered and reduced under the autocast's group, equal to eager TE bit for
bit (tests/gpu/amax_group_worker.py runs under torchrun). The ranks' inputs differ. On 2 GPUs
each rank's group holds that rank alone, so a reduction over the default group (what
te_compile did before session 31) would make the ranks' amaxes equal and unlike eager TE's;
on 4 the groups are {0, 1} and {2, 3}: a real reduction inside each pair, none between them.
Skips without 2 CUDA GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from te_compile_testing import torchrun

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    out = tmp_path_factory.mktemp("amax_group")
    n = 4 if torch.cuda.device_count() >= 4 else 2
    proc = torchrun(Path(__file__).with_name("amax_group_worker.py"), n, ["--out", out], 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(n)]


@pytest.mark.parametrize("mode", ["traced", "outside"])
def test_compiled_state_equals_eager_te(ranks, mode):
    for rank, result in enumerate(ranks):
        eager, compiled = result["eager"], result[mode]
        assert eager.keys() == compiled.keys()
        for name, want in eager.items():
            assert torch.equal(compiled[name], want), (rank, name)


def _same_histories(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a if k.endswith("history"))


def test_ranks_were_reduced_within_their_group_only(ranks):
    """The check above can fail: eager TE's ranks of different groups hold different amaxes;
    on 4 GPUs the two ranks of one group hold the same (the reduction ran)."""
    eager = [r["eager"] for r in ranks]
    assert any(eager[0][k].abs().sum() > 0 for k in eager[0] if k.endswith("history"))
    other = 1 if len(ranks) == 2 else 2
    assert not _same_histories(eager[0], eager[other])
    if len(ranks) == 4:
        assert _same_histories(eager[0], eager[1]) and _same_histories(eager[2], eager[3])
