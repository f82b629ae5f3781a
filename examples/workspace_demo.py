"""A tour of the workspace manager: scratch memory for two ubatch threads.

Run it with:

    make demo-workspace  # or: .venv/bin/python examples/workspace_demo.py

What it shows, on CPU:

1. warmup: two ubatch threads ask for scratch buffers of growing size; the manager grows
   one shared capacity, and each slot follows at its own thread's next request;
2. lock: every slot is realized at the capacity and frozen;
3. a step after lock allocates nothing, and every address stays the same;
4. a request larger than the locked capacity fails with an error that names its line.
"""

from __future__ import annotations

import argparse

import torch

import dbo
from workspace import (
    WorkspaceLockedError,
    current_workspace_manager,
    init_workspace_manager,
    lock_workspace,
)

NUM_UBATCHES = 2
HIDDEN = 1024
JOIN_TIMEOUT_S = 30.0
MiB = float(1 << 20)
RUNNER = dbo.UBatchRunner(num_ubatches=NUM_UBATCHES)


def scratch_step(tokens: int) -> list[int]:
    """What a layer does each step: take its scratch tensors in one call and use them."""
    hidden, scores, index = current_workspace_manager().get_simultaneous(
        ((tokens, HIDDEN), torch.bfloat16),
        ((tokens, 8), torch.float32),
        ((tokens,), torch.int64),
    )
    ubatch = dbo.current_ubatch_id()
    hidden.fill_(ubatch)
    scores.fill_(ubatch)
    index.copy_(torch.arange(tokens))
    dbo.yield_()  # the other ubatch takes its own scratch memory meanwhile
    if not (bool((hidden == ubatch).all()) and int(index[-1]) == tokens - 1):
        raise AssertionError(f"ubatch {ubatch} saw foreign bytes")
    return [hidden.data_ptr(), scores.data_ptr(), index.data_ptr()]


def run_ubatches(tokens_per_ubatch: list[int]) -> list[list[int]]:
    """Run `scratch_step` as one overlap of NUM_UBATCHES ubatches; each one's addresses."""
    return RUNNER.run(
        scratch_step, [((tokens,), {}) for tokens in tokens_per_ubatch], timeout_s=JOIN_TIMEOUT_S
    )


def show_stats(title: str) -> None:
    stats = current_workspace_manager().stats()
    slots = ", ".join(f"{b / MiB:.2f}" for b in stats.realized_bytes_per_slot)
    print(
        f"  {title:<34} capacity {stats.capacity_bytes / MiB:6.2f} MB | slots [{slots}] MB | "
        f"resizes {stats.num_resizes} | allocations {stats.num_allocations}"
        f"{' | locked' if stats.locked else ''}"
    )


def main() -> None:
    manager = init_workspace_manager("cpu", num_ubatches=NUM_UBATCHES)
    print(f"Workspace demo: {manager}\n")

    print("1. Warmup: both ubatch threads ask for scratch memory of growing size")
    for step, tokens in enumerate([(128, 256), (512, 384), (1024, 1024)], start=1):
        run_ubatches(list(tokens))
        show_stats(f"step {step}: tokens {tokens[0]:>4} / {tokens[1]:>4}")
    print("  (a slot below the capacity catches up at its own thread's next request)\n")

    print("2. Lock: every slot is realized at the capacity, which is frozen")
    lock_workspace()
    show_stats("after lock_workspace()")
    print()

    print("3. Steps after lock: no allocation, the same addresses every time")
    allocations_before = manager.stats().num_allocations
    first = run_ubatches([1024, 1024])
    again = run_ubatches([1024, 1024])
    smaller = run_ubatches([300, 700])
    allocations_after = manager.stats().num_allocations
    for ubatch in range(NUM_UBATCHES):
        print(f"  ubatch {ubatch} tensor addresses: {[hex(p) for p in first[ubatch]]}")
    same = first == again
    same_start = all(first[u][0] == smaller[u][0] for u in range(NUM_UBATCHES))
    print(f"  same addresses on the next step:      {same}")
    print(f"  smaller step starts at the same spot: {same_start}")
    print(f"  new allocations:                      {allocations_after - allocations_before}")
    if not (same and same_start and allocations_after == allocations_before):
        raise SystemExit("unexpected: the locked workspace moved or allocated")
    print()

    print("4. A request larger than the locked capacity is a clear error")
    try:
        run_ubatches([4096, 16])
    except WorkspaceLockedError as error:
        print(f"  WorkspaceLockedError: {error}")
    else:
        raise SystemExit("unexpected: the locked workspace grew")
    print()
    show_stats("final")
    print("\nDone: after warmup and lock, the hot path reuses the same memory every step.")
    print("(logging.basicConfig(level=logging.DEBUG) logs every resize, lock and unlock.)")
    RUNNER.close()


if __name__ == "__main__":
    # No options; --help prints what the tour shows instead of running it.
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
