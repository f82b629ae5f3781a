"""Multi-process stress and load, gloo ranks started as scripts (`_rank_script.py`).

- Random layers of collectives (`all_to_all_single` with uneven and zero splits,
  `all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`) and `comm.moe`
  dispatch/combine, forward and backward, on 2 and 4 ranks: the overlapped output and
  gradients equal, bitwise, those of the same two halves run one after the other, on
  every rank. The plan is drawn from a seed that a failure prints.
- Many overlapped calls (2 and 4 ubatches, a yield, a workspace request, an all-to-all
  and an all-reduce each) on 2 ranks: the live threads stay the same, the resident
  memory grows < 5% once warm, the workspace capacity stays the same.

Bounded by default; `DBO_STRESS=long`: 200 steps per world, 10,000 calls.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _dist_world import describe, run_ranks
from _stress import size

pytestmark = [pytest.mark.stress, pytest.mark.distributed]

SEED = int(os.environ.get("DBO_STRESS_SEED", "20240617"))


@pytest.mark.timeout(size(150, 1800))
@pytest.mark.parametrize(("world_size", "steps"), [(2, size(100, 200)), (4, size(30, 200))])
def test_random_collective_layers_equal_the_serial_halves_on_every_rank(
    world_size: int, steps: int, tmp_path: Path
) -> None:
    spec = {"steps": steps, "seed": SEED}
    ranks = run_ranks("stress", world_size, spec, tmp_path, limit_s=size(120, 1700))
    context = f"seed {SEED} (DBO_STRESS_SEED to replay)\n{describe(ranks)}"
    for run in ranks:
        assert run.returncode == 0, context
        report = run.events["stress"]
        assert report["steps"] == steps
        assert report["mismatches"] == [], context
        assert all(count > 0 for count in report["kinds"].values()), report["kinds"]
    kinds = ranks[0].events["stress"]["kinds"]
    print(f"\n[{world_size} ranks] {steps} steps, layers per kind: {kinds}")


LEAK_CALLS = size(1_500, 10_000)
WARM_CALL = LEAK_CALLS // 10


@pytest.mark.timeout(size(120, 900))
def test_many_overlapped_calls_with_collectives_grow_no_threads_nor_memory(
    tmp_path: Path,
) -> None:
    spec = {"calls": LEAK_CALLS, "sample_at": [WARM_CALL, LEAK_CALLS]}
    ranks = run_ranks("leak", 2, spec, tmp_path, limit_s=size(100, 850))
    context = describe(ranks)
    for run in ranks:
        assert run.returncode == 0, context
        report = run.events["leak"]
        warm, last = (report["samples"][str(call)] for call in spec["sample_at"])
        growth = last["rss"] / warm["rss"] - 1
        assert growth < 0.05, f"rank {run.rank}: RSS grew {growth:.1%}\n{context}"
        assert last["threads"] == warm["threads"], context
        workers = [f"dbo-ubatch-{i}-of-{num}" for num in (2, 4) for i in range(num)]
        assert report["thread_names"] == sorted(report["baseline"] + workers), context
        assert last["capacity"] == warm["capacity"], context
        print(f"\n[rank {run.rank}] {LEAK_CALLS} calls: RSS {warm['rss'] / 2**20:.1f} -> "
              f"{last['rss'] / 2**20:.1f} MiB ({growth:+.2%}), {last['threads']} threads")
