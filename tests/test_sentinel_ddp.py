"""``check_numerics(mode="sentinel")`` under DDP (2 gloo processes on CPU): the gradient hooks
run before DDP's bucket all-reduce, so each rank summarises its local gradients. With rank
1's loss non-finite, rank 1 raised and rank 0 (whose reduced gradients were non-finite too)
reported clean; a loop catching ``NonFiniteError`` then desynchronised. ``check()`` now
agrees across ranks (one all-reduce of the first offending slot): every rank raises alike,
and the ranks stay in step for the next collective (§14.6).

The test spawns this file twice as a script (``--worker``); each rank writes its record as
JSON. The test process itself imports no torch.
"""

from __future__ import annotations

import importlib.util
import math
import sys

WORLD = 2
TIMEOUT_S = 60


def _steps(rank: int, scaled: bool, sync_ranks: bool = True) -> list:
    """Three steps (clean, rank 1's loss x inf, clean), each checked and caught: per step
    (raised, message, applied)."""
    import torch

    import numstab as ns
    from numstab.errors import NonFiniteError
    from numstab.integrations.torch import GradScaler

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(init_scale=8.0) if scaled else None
    g = torch.Generator().manual_seed(1 + rank)
    out = []
    with ns.check_numerics(mode="sentinel", sync_ranks=sync_ranks) as cn:
        for step in range(3):
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 1 and rank == 1:
                loss = loss * math.inf
            applied = None
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                applied = scaler.step_and_update(opt)
            try:
                cn.check()
                out.append([False, "", applied])
            except NonFiniteError as error:
                out.append([True, str(error), applied])
            if scaler is None and not out[-1][0]:
                opt.step()
    return out


def _one_rank_only(rank: int) -> float:
    """The default (``sync_ranks=None``): a context that ran no DDP module, on rank 0 only (an
    evaluation, a debugging session), makes no collective; the ranks' next all-reduce meets
    as it should (with agreement always on, rank 0 met it with check()'s)."""
    import torch
    import torch.distributed as dist

    import numstab as ns

    if rank == 0:
        with ns.check_numerics(mode="sentinel"):
            torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
    total = torch.ones(3) * (rank + 1)
    dist.all_reduce(total)
    return float(total[0])


def _run(rank: int, world: int, folder: str) -> dict:
    record = {"plain": _steps(rank, False), "scaled": _steps(rank, True)}
    record["local"] = _steps(rank, False, sync_ranks=False)
    record["one_rank"] = _one_rank_only(rank)
    return record


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from tests.gloo_ranks import worker_main

    worker_main(_run, WORLD, TIMEOUT_S)

import pytest  # noqa: E402

from tests.gloo_ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(__file__, WORLD, TIMEOUT_S, tmp_path_factory.mktemp("sentinel_ddp"))


def test_every_rank_raises_alike_without_a_scaler(ranks):
    raised = [[step[0] for step in r["plain"]] for r in ranks]
    assert raised == [[False, True, False]] * WORLD, raised
    assert "another rank found NaN or inf" in ranks[0]["plain"][1][1]
    assert "backward pass" in ranks[0]["plain"][1][1]
    assert "another rank" not in ranks[1]["plain"][1][1]


def test_a_scaler_skip_is_quiet_on_every_rank(ranks):
    for r in ranks:
        assert [step[0] for step in r["scaled"]] == [False, False, False], r["scaled"]
        assert [step[2] for step in r["scaled"]] == [True, False, True]


def test_sync_ranks_false_keeps_each_rank_s_check_local(ranks):
    """A context some ranks only may use: no collective, each rank reads its own records, as
    before: rank 0 sees its local gradients finite at step 1, applies the all-reduced NaN
    ones, and raises only at step 2 (why agreeing is the default)."""
    raised = [[step[0] for step in r["local"]] for r in ranks]
    assert raised == [[False, False, True], [False, True, False]], raised


def test_a_context_without_a_data_parallel_module_makes_no_collective(ranks):
    assert [r["one_rank"] for r in ranks] == [3.0, 3.0]
