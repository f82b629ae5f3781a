"""Tests of `workspace`: per-ubatch scratch buffers handed out as typed views.

Sections follow the manager's contract: views, the request cache, slots and threads,
grow together, free before allocate, lock, bad input, autograd and inference mode, the
module-level accessors, stats, debug logging.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

import dbo
import workspace
from dbo.runtime.context import UBatchContext, registered
from workspace import (
    ALIGNMENT_BYTES,
    WorkspaceAllocationError,
    WorkspaceLockedError,
    WorkspaceManager,
)

T = TypeVar("T")

JOIN_TIMEOUT_S = 30.0
MiB = 1 << 20
THIS_FILE = "test_workspace.py"

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
ODD_SHAPES = [(1,), (3,), (7, 5), (0,), (2, 0, 3), (33, 17), (1, 1, 1), (255,), (257,), (3, 0)]


# ------------------------------------------------------------------------------- helpers
def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _assert_disjoint(tensors: list[torch.Tensor]) -> None:
    ranges = sorted(_byte_range(t) for t in tensors if t.numel() > 0)
    for (_, end), (next_start, _) in zip(ranges, ranges[1:], strict=False):
        assert end <= next_start, f"byte ranges overlap: {ranges}"


def _round_up(num_bytes: int) -> int:
    return (num_bytes + ALIGNMENT_BYTES - 1) // ALIGNMENT_BYTES * ALIGNMENT_BYTES


def _layout_bytes(*requests: tuple[tuple[int, ...], torch.dtype]) -> int:
    """Bytes a request needs: each tensor rounded up to the alignment."""
    total = 0
    for shape, dtype in requests:
        numel = 1
        for dim in shape:
            numel *= dim
        total += _round_up(numel * dtype.itemsize)
    return total


def _in_ubatch(ubatch_id: int, num_ubatches: int, fn: Callable[[], T]) -> T:
    """Run `fn` in a new thread registered as `ubatch_id`; return its result or re-raise."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            with registered(UBatchContext(ubatch_id=ubatch_id, num_ubatches=num_ubatches)):
                outcome["value"] = fn()
        except BaseException as error:  # re-raised in the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=body, name=f"ubatch-{ubatch_id}", daemon=True)
    thread.start()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive(), f"ubatch {ubatch_id} thread did not finish in time"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _next_line() -> int:
    """The line number just after the caller's line."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno + 1


def _count_allocations(monkeypatch: pytest.MonkeyPatch, manager: WorkspaceManager) -> list[int]:
    """Wrap `manager._allocate`; the returned list receives each allocation's byte count."""
    calls: list[int] = []
    original = manager._allocate

    def counting(num_bytes: int) -> torch.Tensor:
        calls.append(num_bytes)
        return original(num_bytes)

    monkeypatch.setattr(manager, "_allocate", counting)
    return calls


def _count_prepares(monkeypatch: pytest.MonkeyPatch, manager: WorkspaceManager) -> list[int]:
    """Wrap `manager._prepare` (the validating path); the list grows by one per call."""
    prepared: list[int] = []
    original = manager._prepare

    def counting(*args: Any) -> Any:
        prepared.append(1)
        return original(*args)

    monkeypatch.setattr(manager, "_prepare", counting)
    return prepared


def _misaligned_allocator(misalignment: int) -> Callable[[int], torch.Tensor]:
    """An `_allocate` whose tensors start `misalignment` bytes past a 256-byte boundary."""

    def allocate(num_bytes: int) -> torch.Tensor:
        backing = torch.empty((num_bytes + 2 * ALIGNMENT_BYTES,), dtype=torch.uint8)
        skip = (misalignment - backing.data_ptr()) % ALIGNMENT_BYTES
        raw = backing[skip : skip + num_bytes]
        assert raw.data_ptr() % ALIGNMENT_BYTES == misalignment
        return raw

    return allocate


def _raised(fn: Any, *args: Any) -> list[BaseException]:
    try:
        fn(*args)
    except BaseException as error:  # noqa: BLE001 - reported to the test
        return [error]
    return []


def _graph_size(grad_fn: Any) -> int:
    seen: set[int] = set()
    stack = [grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)



# --------------------------------------------------- views: alignment, types, no overlap
@pytest.mark.parametrize("misalignment", [None, 16, 64, 128, 192])
def test_every_view_starts_at_a_multiple_of_256(
    monkeypatch: pytest.MonkeyPatch, misalignment: int | None
) -> None:
    manager = WorkspaceManager("cpu")
    if misalignment is not None:
        # The CPU allocator only promises 64 bytes; force the worst cases explicitly.
        monkeypatch.setattr(manager, "_allocate", _misaligned_allocator(misalignment))
    requests = [(shape, dtype) for dtype in ALL_DTYPES for shape in ODD_SHAPES]

    views = manager.get_simultaneous(*requests)

    assert len(views) == len(requests)
    for view, (shape, dtype) in zip(views, requests, strict=True):
        assert view.data_ptr() % ALIGNMENT_BYTES == 0, (shape, dtype, view.data_ptr())
        assert tuple(view.shape) == shape
        assert view.dtype == dtype
        assert view.device == torch.device("cpu")
        assert view.is_contiguous()
    # One request at a time too: each starts at the slot's (aligned) beginning.
    for shape, dtype in requests:
        (view,) = manager.get_simultaneous((shape, dtype))
        assert view.data_ptr() % ALIGNMENT_BYTES == 0, (shape, dtype)
        assert tuple(view.shape) == shape and view.dtype == dtype


def test_views_are_usable_typed_tensors() -> None:
    manager = WorkspaceManager("cpu")
    a, b, c = manager.get_simultaneous(
        ((4, 8), torch.float32), ((3,), torch.complex64), ((5, 2), torch.bfloat16)
    )
    a.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8))
    b.copy_(torch.tensor([1 + 2j, 3 - 1j, 0j]))
    c.fill_(1.5)
    assert torch.equal(a, torch.arange(32, dtype=torch.float32).reshape(4, 8))
    assert torch.equal(b, torch.tensor([1 + 2j, 3 - 1j, 0j], dtype=torch.complex64))
    assert torch.equal(c, torch.full((5, 2), 1.5, dtype=torch.bfloat16))
    assert a.stride() == (8, 1) and c.stride() == (2, 1)


def test_views_of_one_call_never_overlap() -> None:
    manager = WorkspaceManager("cpu")
    requests = [(shape, dtype) for dtype in ALL_DTYPES for shape in ODD_SHAPES]
    views = manager.get_simultaneous(*requests)
    _assert_disjoint(views)
    # Filling each with its index leaves every other one intact.
    for index, view in enumerate(views):
        view.view(torch.uint8).fill_(index % 251)
    for index, view in enumerate(views):
        assert bool((view.view(torch.uint8) == index % 251).all()), index


def test_zero_size_and_empty_requests() -> None:
    manager = WorkspaceManager("cpu")
    assert manager.get_simultaneous() == []
    assert manager.capacity_bytes == 0

    for shape in [(0,), (3, 0), (0, 0, 5)]:
        for dtype in (torch.float32, torch.bool, torch.complex128):
            (view,) = manager.get_simultaneous((shape, dtype))
            assert tuple(view.shape) == shape and view.dtype == dtype
            assert view.numel() == 0 and view.is_contiguous()
            assert view.device == torch.device("cpu")
            assert view.sum().item() == 0  # a valid tensor: ops work on it
    # A zero-size request next to real ones takes no bytes away from them.
    empty, real = manager.get_simultaneous(((0,), torch.float32), ((16,), torch.float32))
    assert empty.numel() == 0 and real.numel() == 16


@pytest.mark.parametrize(
    "requests",
    [pytest.param((), id="no-arguments"), pytest.param((((0, 4), torch.float32),), id="zero-size")],
)
def test_requests_of_zero_bytes_allocate_nothing(
    monkeypatch: pytest.MonkeyPatch, requests: tuple[Any, ...]
) -> None:
    manager = WorkspaceManager("cpu")
    calls = _count_allocations(monkeypatch, manager)
    manager.get_simultaneous(*requests)
    assert calls == []
    assert manager.stats().num_allocations == 0


def test_an_empty_view_next_to_real_ones_is_not_a_window_onto_them() -> None:
    """A zero-size request gets a fresh tensor: an `out=` that torch resizes writes into
    new memory, never over its neighbours' bytes."""
    manager = WorkspaceManager("cpu")
    empty, data = manager.get_simultaneous(((0,), torch.float32), ((64,), torch.float32))
    data.fill_(7.0)
    torch.cat([torch.zeros(8), torch.zeros(8)], out=empty)
    assert empty.shape == (16,)
    assert bool((data == 7.0).all())



# --------------------------------------------------------------------- the request cache
def test_same_request_returns_same_addresses_and_allocates_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager = WorkspaceManager("cpu")
    calls = _count_allocations(monkeypatch, manager)
    requests = (((64, 128), torch.float32), ((64, 128), torch.bfloat16), ((64,), torch.int64))

    first = [view.data_ptr() for view in manager.get_simultaneous(*requests)]
    allocations_after_first = manager.stats().num_allocations
    assert allocations_after_first == 1 and len(calls) == 1

    for _ in range(50):
        again = [view.data_ptr() for view in manager.get_simultaneous(*requests)]
        assert again == first
    # Smaller requests and other dtypes fit in the capacity: still nothing allocated.
    manager.get_simultaneous(((16,), torch.float64), ((100,), torch.bool))
    manager.get_simultaneous(([8, 8], torch.int32))
    assert manager.stats().num_allocations == allocations_after_first
    assert len(calls) == 1


def test_list_shapes_work_and_reuse_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = WorkspaceManager("cpu")
    calls = _count_allocations(monkeypatch, manager)
    (listed,) = manager.get_simultaneous(([4, 8], torch.float32))
    assert tuple(listed.shape) == (4, 8) and listed.dtype == torch.float32
    ptr = listed.data_ptr()
    (again,) = manager.get_simultaneous(([4, 8], torch.float32))
    (as_tuple,) = manager.get_simultaneous(((4, 8), torch.float32))
    (as_size,) = manager.get_simultaneous((torch.Size([4, 8]), torch.float32))
    assert again.data_ptr() == as_tuple.data_ptr() == as_size.data_ptr() == ptr
    assert len(calls) == 1


def test_a_repeated_request_is_served_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuples, torch.Size and numpy ints compare equal to the cached (validated) form."""
    import numpy as np

    manager = WorkspaceManager("cpu")
    prepared = _count_prepares(monkeypatch, manager)
    (first,) = manager.get_simultaneous(((4, 8), torch.float32))
    for shape in [(4, 8), torch.Size([4, 8]), (np.int64(4), np.int32(8))] * 3:
        (view,) = manager.get_simultaneous((shape, torch.float32))
        assert view.shape == (4, 8) and view.data_ptr() == first.data_ptr()
    assert len(prepared) == 1


def test_list_shapes_are_validated_on_every_call_and_reuse_the_cached_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager = WorkspaceManager("cpu")
    first = manager.get_simultaneous(([4, 8], torch.float32), ([3], torch.int64))
    prepared = _count_prepares(monkeypatch, manager)
    allocations = _count_allocations(monkeypatch, manager)
    again = manager.get_simultaneous(([4, 8], torch.float32), ([3], torch.int64))
    assert len(prepared) == 1 and allocations == []
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    assert again[0].shape == (4, 8) and again[1].shape == (3,)
    with pytest.raises(TypeError, match="not an integer"):
        manager.get_simultaneous(([4.0, 8], torch.float32), ([3], torch.int64))


def test_tensor_dimensions_are_validated_on_every_call() -> None:
    """A 0-dim tensor dimension is hashed by identity and its value may change: it never
    matches a cached request by itself."""
    manager = WorkspaceManager("cpu")
    dim = torch.tensor(4)
    (view,) = manager.get_simultaneous(((dim,), torch.float32))
    assert view.shape == (4,)
    dim.fill_(6)  # the same object, another value
    (view,) = manager.get_simultaneous(((dim,), torch.float32))
    assert view.shape == (6,)



# ------------------------------------------ slots: one per ubatch id, one user at a time
def test_slot_is_the_calling_threads_ubatch_id() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    request = ((1024,), torch.uint8)

    (outside,) = manager.get_simultaneous(request)  # not registered: slot 0
    assert manager.stats().realized_bytes_per_slot == (1024, 0)

    ptr_0 = _in_ubatch(0, 2, lambda: manager.get_simultaneous(request)[0].data_ptr())
    assert ptr_0 == outside.data_ptr()
    assert manager.stats().realized_bytes_per_slot == (1024, 0)

    ptr_1 = _in_ubatch(1, 2, lambda: manager.get_simultaneous(request)[0].data_ptr())
    assert ptr_1 != outside.data_ptr()
    assert manager.stats().realized_bytes_per_slot == (1024, 1024)


def test_slots_never_alias() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((4096,), torch.uint8))
    capacity = manager.capacity_bytes

    def whole_slot(fill: int) -> torch.Tensor:
        assert dbo.current_ubatch_id() in (0, 1)
        (view,) = manager.get_simultaneous(((capacity,), torch.uint8))
        view.fill_(fill)
        return view

    slot_0 = _in_ubatch(0, 2, lambda: whole_slot(0xAA))
    slot_1 = _in_ubatch(1, 2, lambda: whole_slot(0x55))
    _assert_disjoint([slot_0, slot_1])
    assert bool((slot_0 == 0xAA).all())
    assert bool((slot_1 == 0x55).all())

    slot_0.fill_(0x11)  # writing one slot leaves the other untouched
    assert bool((slot_1 == 0x55).all())
    slot_1.fill_(0x22)
    assert bool((slot_0 == 0x11).all())


def test_ubatch_id_beyond_num_ubatches_is_a_clear_error() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((64,), torch.uint8))
    before = manager.stats()
    with pytest.raises(RuntimeError, match="num_ubatches") as excinfo:
        _in_ubatch(2, 3, lambda: manager.get_simultaneous(((64,), torch.uint8)))
    assert "ubatch 2" in str(excinfo.value)
    assert manager.stats() == before


def test_too_few_slots_names_the_reset_that_a_new_manager_needs() -> None:
    """`init_workspace_manager` refuses while a manager exists: the advice names both."""
    manager = WorkspaceManager(torch.device("cpu"), num_ubatches=1)
    with pytest.raises(RuntimeError, match=r"reset_workspace_manager\(\), then init_workspace"):
        _in_ubatch(1, 2, lambda: manager.get_simultaneous(((8,), torch.uint8)))


@pytest.mark.timeout(30)
def test_two_overlaps_at_once_from_two_threads_may_not_share_a_slot() -> None:
    # One slot per ubatch id: the second caller's ubatch 0 would overwrite the views
    # the first caller's ubatch 0 still uses. It raises instead of corrupting.
    manager = WorkspaceManager("cpu", num_ubatches=2)
    inside = threading.Event()
    release = threading.Event()

    def holds_its_views(x: torch.Tensor) -> torch.Tensor:
        (scratch,) = manager.get_simultaneous(((2,), torch.float32))
        scratch.fill_(1.0)
        if dbo.current_ubatch_id() == 0:
            inside.set()
            assert release.wait(10)
        return scratch + x

    errors: list[BaseException] = []
    first = threading.Thread(
        target=lambda: errors.extend(_raised(dbo.overlap(holds_its_views), torch.zeros(4))),
        daemon=True,
    )
    first.start()
    assert inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match="workspace slot 0 is in use by another thread"):
            dbo.overlap(lambda x: manager.get_simultaneous(((2,), torch.float32))[0] + x)(
                torch.zeros(4)
            )
        with pytest.raises(RuntimeError, match="workspace slot 0 is in use"):
            manager.get_simultaneous(((2,), torch.float32))  # slot 0, from outside
    finally:
        release.set()
        first.join(10)
    assert not first.is_alive() and errors == []
    (after,) = manager.get_simultaneous(((2,), torch.float32))  # the overlap has ended
    assert after.shape == (2,)


@pytest.mark.timeout(30)
def test_a_slot_whose_last_user_moved_on_to_another_overlap_is_free() -> None:
    # Pooled runners: the worker that last used manager A's slot 0 now runs ubatch 0 of
    # an unrelated overlap (which uses its own manager); A's next overlap, on another
    # runner, must get its slot: nothing shares it.
    mine, theirs = WorkspaceManager("cpu", num_ubatches=2), WorkspaceManager("cpu", 2)
    inside, release = threading.Event(), threading.Event()

    def uses_mine(x: torch.Tensor) -> torch.Tensor:
        (scratch,) = mine.get_simultaneous(((2,), torch.float32))
        scratch.fill_(1.0)
        dbo.yield_()
        return x + scratch.sum()

    def uses_theirs(x: torch.Tensor) -> torch.Tensor:
        (scratch,) = theirs.get_simultaneous(((2,), torch.float32))
        if dbo.current_ubatch_id() == 0:
            inside.set()
            assert release.wait(10)
        scratch.fill_(2.0)
        return x + scratch.sum()

    step, other = dbo.overlap(uses_mine), dbo.overlap(uses_theirs)
    assert torch.equal(step(torch.zeros(4)), torch.full((4,), 2.0))  # its runner goes back
    errors: list[BaseException] = []
    thread = threading.Thread(
        target=lambda: errors.extend(_raised(other, torch.zeros(4))), daemon=True
    )
    thread.start()  # leases the runner whose worker last used `mine`
    assert inside.wait(10)
    try:
        assert torch.equal(step(torch.zeros(4)), torch.full((4,), 2.0))  # another runner
    finally:
        release.set()
        thread.join(10)
    assert not thread.is_alive() and errors == []


def test_a_slot_keeps_nothing_of_a_finished_run_alive() -> None:
    # The slot remembers its last user's registration as a number: holding the context
    # would keep the run (its run_state, the MoE order token and the graph behind it).
    import gc
    import weakref

    manager = WorkspaceManager("cpu", num_ubatches=2)
    kept: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        manager.get_simultaneous(((2,), torch.float32))
        state = dbo.run_state()
        assert state is not None
        state[f"test.{dbo.current_ubatch_id()}"] = big = torch.zeros(1000)
        kept.append(weakref.ref(big))
        return x + 1

    gc.disable()
    try:
        dbo.overlap(fn, timeout_s=30)(torch.zeros(4))
        assert len(kept) == 2 and all(ref() is None for ref in kept)
    finally:
        gc.enable()


def test_concurrent_ubatch_threads_never_see_each_others_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    num_threads = 4
    iterations = 10_000
    growth_iterations = 400  # sizes rise over these, so threads grow concurrently at first
    manager = WorkspaceManager("cpu", num_ubatches=num_threads)
    failures: list[str] = []
    start = threading.Barrier(num_threads, timeout=JOIN_TIMEOUT_S)
    finish = threading.Barrier(num_threads, timeout=JOIN_TIMEOUT_S)
    allocations: list[int] = []
    original_allocate = manager._allocate

    def yielding_allocate(num_bytes: int) -> torch.Tensor:
        time.sleep(0)  # let the other threads run in the middle of a resize
        raw = original_allocate(num_bytes)
        allocations.append(num_bytes)
        return raw

    monkeypatch.setattr(manager, "_allocate", yielding_allocate)

    def rows_at(iteration: int, thread_id: int) -> int:
        return 4 * (1 + min(iteration, growth_iterations) // 20) + (iteration + thread_id) % 5

    def requests(rows: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        return (
            ((rows, 16), torch.int32),
            ((rows * 8,), torch.float64),
            ((rows * 3 + 1,), torch.uint8),
        )

    def worker(thread_id: int) -> None:
        try:
            context = UBatchContext(ubatch_id=thread_id, num_ubatches=num_threads)
            with registered(context):
                start.wait()
                for iteration in range(iterations):
                    a, b, c = manager.get_simultaneous(*requests(rows_at(iteration, thread_id)))
                    int_value = thread_id * 1_000_000 + iteration
                    byte_value = thread_id * 64 + iteration % 64
                    a.fill_(int_value)
                    b.fill_(float(int_value))
                    c.fill_(byte_value)
                    for when in ("right after writing", "after yielding"):
                        if not (
                            bool((a == int_value).all())
                            and bool((b == float(int_value)).all())
                            and bool((c == byte_value).all())
                        ):
                            failures.append(f"thread {thread_id}, iteration {iteration}: {when}")
                        time.sleep(0)
                    if len(failures) > 20:
                        return
                # Once nobody grows any more, each slot's next request realizes it at the
                # final capacity.
                finish.wait()
                manager.get_simultaneous(*requests(rows_at(0, thread_id)))
        except BaseException as error:
            failures.append(f"thread {thread_id} raised {error!r}")

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # switch threads often: more interleavings
    try:
        threads = [
            threading.Thread(target=worker, args=(i,), name=f"ubatch-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 50.0  # below pytest's 60 s timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(old_interval)
    assert not any(thread.is_alive() for thread in threads), "worker threads hung"
    assert failures == []
    largest = max(rows_at(i, t) for i in range(iterations) for t in range(num_threads))
    stats = manager.stats()
    assert stats.capacity_bytes == _layout_bytes(*requests(largest))
    assert stats.num_resizes >= 2
    assert stats.realized_bytes_per_slot == (stats.capacity_bytes,) * num_threads
    assert stats.num_allocations == len(allocations)



# ------------------------------------------------------------------------- grow together
def test_other_slot_keeps_its_buffer_until_its_next_request() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    small = ((1024,), torch.uint8)

    def slot_1_first() -> torch.Tensor:
        (view,) = manager.get_simultaneous(small)
        view.fill_(0x5A)
        return view

    held = _in_ubatch(1, 2, slot_1_first)
    held_ptr = held.data_ptr()
    assert manager.stats().realized_bytes_per_slot == (0, 1024)

    manager.get_simultaneous(((8192,), torch.uint8))  # slot 0 raises the shared capacity
    stats = manager.stats()
    assert stats.capacity_bytes == 8192
    assert stats.realized_bytes_per_slot == (8192, 1024)
    # Slot 1's thread may still use its views: same address, bytes untouched.
    assert held.data_ptr() == held_ptr
    assert bool((held == 0x5A).all())

    # Its next request, even one seen before, is realized at the new capacity.
    ptr_after = _in_ubatch(1, 2, lambda: manager.get_simultaneous(small)[0].data_ptr())
    assert manager.stats().realized_bytes_per_slot == (8192, 8192)
    assert ptr_after % ALIGNMENT_BYTES == 0
    assert bool((held == 0x5A).all())  # the old buffer lives as long as a view does


def test_capacity_is_shared_and_only_rises() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((3000,), torch.uint8))
    assert manager.capacity_bytes == _round_up(3000)
    _in_ubatch(1, 2, lambda: manager.get_simultaneous(((100,), torch.uint8)))
    # Slot 1 is realized at the shared capacity, not at its own (smaller) need.
    assert manager.stats().realized_bytes_per_slot == (_round_up(3000), _round_up(3000))
    manager.get_simultaneous(((10,), torch.uint8))
    assert manager.capacity_bytes == _round_up(3000)
    assert manager.stats().num_resizes == 1



# ------------------------------------------------------------------ free before allocate
def _track_raw_buffers(
    monkeypatch: pytest.MonkeyPatch, manager: WorkspaceManager
) -> tuple[list[weakref.ref[torch.UntypedStorage]], list[list[bool]]]:
    """Wrap `_allocate`: keep a weakref to every raw buffer, and at each allocation record
    which of the earlier raw buffers were still alive at that moment.

    The weakref is to the raw tensor's *storage*: the raw tensor object itself can die
    while its memory lives on (a `view(dtype)` does not keep its base tensor object), but
    the storage object stays alive exactly as long as any tensor uses the memory.
    """
    refs: list[weakref.ref[torch.UntypedStorage]] = []
    alive_at_allocation: list[list[bool]] = []
    original = manager._allocate

    def tracking(num_bytes: int) -> torch.Tensor:
        alive_at_allocation.append([ref() is not None for ref in refs])
        raw = original(num_bytes)
        refs.append(weakref.ref(raw.untyped_storage()))
        return raw

    monkeypatch.setattr(manager, "_allocate", tracking)
    return refs, alive_at_allocation


def test_old_buffer_is_freed_before_the_new_one_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager = WorkspaceManager("cpu")
    refs, alive_at_allocation = _track_raw_buffers(monkeypatch, manager)

    for size in (1 * MiB, 2 * MiB, 3 * MiB, 8 * MiB):
        manager.get_simultaneous(((size,), torch.uint8))  # views not kept
        assert refs[-1]() is not None  # the slot's current buffer is alive
    assert len(alive_at_allocation) == 4
    # At every allocation, all earlier buffers of the (only) slot were already gone.
    assert alive_at_allocation == [[], [False], [False, False], [False, False, False]]


def test_free_before_allocate_detector_sees_a_view_the_caller_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control: a view the caller holds keeps the old buffer, and the tracking sees it."""
    manager = WorkspaceManager("cpu")
    _, alive_at_allocation = _track_raw_buffers(monkeypatch, manager)
    (kept,) = manager.get_simultaneous(((MiB,), torch.uint8))
    manager.get_simultaneous(((2 * MiB,), torch.uint8))
    assert alive_at_allocation == [[], [True]]
    assert kept.numel() == MiB


def test_free_before_allocate_per_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    refs, alive_at_allocation = _track_raw_buffers(monkeypatch, manager)

    manager.get_simultaneous(((MiB,), torch.uint8))  # allocation 0: slot 0
    _in_ubatch(1, 2, lambda: len(manager.get_simultaneous(((MiB,), torch.uint8))))  # 1: slot 1
    manager.get_simultaneous(((2 * MiB,), torch.uint8))  # 2: slot 0 grows
    # Slot 0's old buffer was gone; slot 1's is kept (its thread may use it) until...
    assert alive_at_allocation[2] == [False, True]
    _in_ubatch(1, 2, lambda: len(manager.get_simultaneous(((MiB,), torch.uint8))))  # 3: slot 1
    # ...slot 1's next request, which frees it before allocating the new one.
    assert alive_at_allocation[3] == [False, False, True]
    assert [ref() is not None for ref in refs] == [False, False, True, True]


def test_impossible_request_raises_allocation_error_and_manager_stays_usable() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((4096,), torch.uint8))
    capacity = manager.capacity_bytes
    resizes = manager.stats().num_resizes

    huge = 2**60
    with pytest.raises(WorkspaceAllocationError) as excinfo:
        manager.get_simultaneous(((huge,), torch.uint8))
    assert isinstance(excinfo.value, RuntimeError)
    assert str(huge) in str(excinfo.value)

    stats = manager.stats()
    assert stats.capacity_bytes == capacity
    assert stats.num_resizes == resizes
    (view,) = manager.get_simultaneous(((4096,), torch.uint8))
    view.fill_(7)
    assert bool((view == 7).all())
    assert view.data_ptr() % ALIGNMENT_BYTES == 0
    assert manager.capacity_bytes == capacity
    assert manager.stats().realized_bytes_per_slot[0] == capacity


def test_device_out_of_memory_becomes_allocation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-style OOM (a RuntimeError subclass) is wrapped the same way."""
    manager = WorkspaceManager("cpu")
    manager.get_simultaneous(((512,), torch.uint8))
    original = manager._allocate

    def out_of_memory(num_bytes: int) -> torch.Tensor:
        if num_bytes > MiB:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {num_bytes}")
        return original(num_bytes)

    monkeypatch.setattr(manager, "_allocate", out_of_memory)
    with pytest.raises(WorkspaceAllocationError, match=str(4 * MiB)) as excinfo:
        manager.get_simultaneous(((4 * MiB,), torch.uint8))
    assert isinstance(excinfo.value.__cause__, torch.OutOfMemoryError)
    assert manager.capacity_bytes == 512
    (view,) = manager.get_simultaneous(((512,), torch.uint8))
    assert view.numel() == 512


@pytest.mark.gpu
def test_cuda_peak_is_max_of_old_and_new() -> None:
    manager = WorkspaceManager("cuda", num_ubatches=1)
    manager.get_simultaneous(((64 * MiB,), torch.uint8))  # views not kept
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    manager.get_simultaneous(((128 * MiB,), torch.uint8))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # Freed first: peak = before - 64 MiB + 128 MiB (plus rounding), not before + 128 MiB.
    assert peak <= before - 64 * MiB + 128 * MiB + 8192, (before, peak)
    (view,) = manager.get_simultaneous(((128 * MiB,), torch.uint8))
    assert view.data_ptr() % ALIGNMENT_BYTES == 0 and view.is_cuda



# ---------------------------------------------------------------------------------- lock
def test_lock_realizes_every_slot_and_freezes_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager = WorkspaceManager("cpu", num_ubatches=3)
    manager.get_simultaneous(((40, 100), torch.float32), ((40,), torch.int64))
    capacity = manager.capacity_bytes
    assert manager.stats().realized_bytes_per_slot == (capacity, 0, 0)

    manager.lock()
    stats = manager.stats()
    assert stats.locked and manager.is_locked()
    assert stats.realized_bytes_per_slot == (capacity,) * 3
    assert stats.num_allocations == 3

    calls = _count_allocations(monkeypatch, manager)
    requests = [
        (((capacity,), torch.uint8),),
        (((capacity // 4,), torch.float32),),
        (((1,), torch.bool), ((7, 3), torch.float16)),
        (((capacity // 8 - 64,), torch.int64), ((10,), torch.int8)),
        (((0,), torch.float32),),
        (([5, 5], torch.complex64),),
    ]

    def addresses() -> tuple[int, list[list[int]]]:
        base = manager.get_simultaneous(((capacity,), torch.uint8))[0].data_ptr()
        seen = []
        for request in requests:
            views = manager.get_simultaneous(*request)
            for view in views:
                if view.numel() > 0:  # data_ptr() of an empty tensor is 0
                    start, end = _byte_range(view)
                    assert base <= start and end <= base + capacity
            seen.append([view.data_ptr() for view in views])
        return base, seen

    for ubatch_id in range(3):
        first = _in_ubatch(ubatch_id, 3, addresses)
        for _ in range(20):
            assert _in_ubatch(ubatch_id, 3, addresses) == first
    assert calls == []
    assert manager.stats().num_allocations == 3
    assert manager.stats().realized_bytes_per_slot == (capacity,) * 3


def test_lock_reallocates_a_slot_left_at_an_older_capacity() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    _in_ubatch(1, 2, lambda: len(manager.get_simultaneous(((1024,), torch.uint8))))
    manager.get_simultaneous(((8192,), torch.uint8))
    assert manager.stats().realized_bytes_per_slot == (8192, 1024)
    manager.lock()
    assert manager.stats().realized_bytes_per_slot == (8192, 8192)
    # Slot 1 now serves its full capacity without growing (which would raise).
    (view,) = _in_ubatch(1, 2, lambda: manager.get_simultaneous(((8192,), torch.uint8)))
    assert view.numel() == 8192


def test_growth_while_locked_names_the_call_site_and_sizes() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((MiB,), torch.uint8))
    manager.lock()
    assert manager.is_locked()

    with pytest.raises(WorkspaceLockedError) as excinfo:
        line = _next_line()
        manager.get_simultaneous(((3 * MiB + MiB // 2,), torch.uint8))
    error = excinfo.value
    assert isinstance(error, RuntimeError)
    message = str(error)
    site = f"{THIS_FILE}:{line}:test_growth_while_locked_names_the_call_site_and_sizes"
    assert site in message
    assert "3.50 MB" in message  # requested
    assert "1.00 MB" in message  # locked capacity
    assert manager.capacity_bytes == MiB
    assert manager.stats().num_resizes == 1

    manager.unlock()
    assert not manager.is_locked() and not manager.stats().locked
    (view,) = manager.get_simultaneous(((3 * MiB + MiB // 2,), torch.uint8))
    assert view.numel() == 3 * MiB + MiB // 2
    assert manager.capacity_bytes == 3 * MiB + MiB // 2


def test_the_locked_capacity_error_reads_small_sizes_in_bytes() -> None:
    manager = WorkspaceManager("cpu")
    manager.get_simultaneous(((4,), torch.float32))
    manager.lock()
    with pytest.raises(WorkspaceLockedError) as raised:
        manager.get_simultaneous(((1000,), torch.float32))
    message = str(raised.value)
    needed = -(-4000 // ALIGNMENT_BYTES) * ALIGNMENT_BYTES  # whole aligned blocks
    assert f"needs {needed} B per slot" in message, message
    assert f"capacity is {manager.capacity_bytes} B;" in message, message


def test_requests_within_locked_capacity_still_work() -> None:
    manager = WorkspaceManager("cpu")
    manager.get_simultaneous(((1000,), torch.float32))
    manager.lock()
    (view,) = manager.get_simultaneous(((250,), torch.float64))
    assert view.numel() == 250
    with pytest.raises(WorkspaceLockedError):
        manager.get_simultaneous(((1000,), torch.float32), ((1,), torch.uint8))


def test_lock_before_any_request_allocates_nothing() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.lock()
    stats = manager.stats()
    assert stats.num_allocations == 0 and stats.realized_bytes_per_slot == (0, 0)
    assert manager.get_simultaneous(((0,), torch.float32))[0].numel() == 0
    with pytest.raises(WorkspaceLockedError):
        manager.get_simultaneous(((1,), torch.uint8))


def test_lock_from_inside_an_overlap_is_refused() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((64,), torch.uint8))

    def ubatch() -> None:
        manager.lock()

    with pytest.raises(RuntimeError, match="outside"):
        dbo.UBatchRunner(2).run(ubatch, [((), {}), ((), {})], timeout_s=30)
    assert not manager.is_locked()


def test_lock_from_a_helper_thread_while_an_overlap_uses_the_slots_is_refused() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    errors: list[BaseException] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        manager.get_simultaneous(((64,), torch.float32))
        if dbo.current_ubatch_id() == 0:

            def helper() -> None:  # a thread outside any ubatch
                try:
                    manager.lock()
                except RuntimeError as error:
                    errors.append(error)

            thread = threading.Thread(target=helper)
            thread.start()
            thread.join(JOIN_TIMEOUT_S)
        return x

    dbo.overlap(fn, timeout_s=JOIN_TIMEOUT_S)(torch.zeros(2))
    assert len(errors) == 1 and "still uses its slot" in str(errors[0])
    manager.lock()  # after the overlap: fine



# ----------------------------------------------------------------------------- bad input
BAD_REQUESTS = [
    pytest.param(
        (((4,), torch.float32), ((-1, 2), torch.float32)), ValueError, "request 1", id="negative"
    ),
    pytest.param((((4,), "float32"),), TypeError, "torch.dtype", id="dtype-str"),
    pytest.param((((4,), float),), TypeError, "torch.dtype", id="dtype-python-type"),
    pytest.param((((2.5, 4), torch.float32),), TypeError, "not an integer", id="float-dim"),
    pytest.param(((("3",), torch.float32),), TypeError, "not an integer", id="str-dim"),
    pytest.param(((4, torch.float32),), TypeError, "shape", id="int-shape"),
    pytest.param((((4,), torch.float32, 1),), TypeError, "pair", id="triple"),
    pytest.param((((0,), torch.uint8), ((3,), None)), TypeError, "request 1", id="dtype-none"),
    pytest.param(((("", torch.float32)),), TypeError, "shape", id="str-shape"),
    pytest.param((((b"\x02\x03", torch.float32)),), TypeError, "shape", id="bytes-shape"),
    pytest.param((({4: None, 8: None}, torch.float32),), TypeError, "shape", id="dict-shape"),
]


@pytest.mark.parametrize(("requests", "error", "needle"), BAD_REQUESTS)
def test_bad_requests_raise_and_change_nothing(
    monkeypatch: pytest.MonkeyPatch, requests: tuple[Any, ...], error: type, needle: str
) -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((128,), torch.float32))
    before = manager.stats()
    calls = _count_allocations(monkeypatch, manager)
    with pytest.raises(error, match=re.escape(needle)):
        manager.get_simultaneous(*requests)
    assert manager.stats() == before
    assert calls == []


def test_bad_request_on_a_fresh_manager_allocates_nothing() -> None:
    manager = WorkspaceManager("cpu")
    with pytest.raises(ValueError, match="request 0"):
        manager.get_simultaneous(((-3,), torch.float32))
    stats = manager.stats()
    assert stats.capacity_bytes == 0 and stats.num_allocations == 0
    assert stats.realized_bytes_per_slot == (0,)


def test_unhashable_requests_get_the_validators_message() -> None:
    manager = WorkspaceManager("cpu")
    with pytest.raises(TypeError, match=r"shape \(\[3\], 4\) is not an integer"):
        manager.get_simultaneous((([3], 4), torch.float32))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        manager.get_simultaneous(((4,), [torch.float32]))


@pytest.mark.parametrize(
    "request_",
    [
        ({4: None, 8: None}, torch.float32),
        {(4, 8): None, torch.float32: None},
        [{4, 8}, torch.float32],
    ],
    ids=["dict-shape", "dict-request", "set-shape"],
)
def test_a_cached_request_does_not_let_other_containers_through(request_: Any) -> None:
    manager = WorkspaceManager("cpu")
    manager.get_simultaneous(((4, 8), torch.float32))  # the tuple form is now cached
    with pytest.raises(TypeError):
        manager.get_simultaneous(request_)


@pytest.mark.parametrize(
    ("num_ubatches", "error"),
    [
        (0, ValueError), (-1, ValueError), ("2", TypeError), (True, TypeError),
        (2.0, TypeError), (2**31, ValueError),  # a typo must not build 2**31 slots
    ],
)
def test_bad_num_ubatches(fresh_workspace_global: None, num_ubatches: Any, error: type) -> None:
    with pytest.raises(error, match="num_ubatches"):
        WorkspaceManager("cpu", num_ubatches=num_ubatches)
    with pytest.raises(error, match="num_ubatches"):
        workspace.init_workspace_manager("cpu", num_ubatches=num_ubatches)
    assert not workspace.is_workspace_manager_initialized()


@pytest.mark.parametrize(("given", "expected"), [("cpu:0", "cpu"), (torch.device("cpu", 0), "cpu")])
def test_device_is_normalized(
    fresh_workspace_global: None, given: Any, expected: str
) -> None:
    manager = WorkspaceManager(given)
    assert manager.device == torch.device(expected)
    (view,) = manager.get_simultaneous(((4,), torch.float32))
    assert view.device == manager.device
    first = workspace.init_workspace_manager("cpu")
    assert workspace.init_workspace_manager(given) is first  # the same device


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without usable CUDA")
def test_cuda_device_without_cuda_is_refused_at_construction() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        WorkspaceManager("cuda")



# ----------------------------------------- like torch.empty: autograd and inference mode
@pytest.mark.parametrize("shape", [(4,), (0,)])
def test_a_view_written_from_a_graph_leaves_no_history_in_later_views(
    shape: tuple[int, ...],
) -> None:
    # Scratch memory is used like torch.empty: written in place from an activation that
    # requires grad. The next step's views must be fresh (no grad_fn), or every step's
    # graph would hang on to the last one and a second backward would fail.
    manager = WorkspaceManager("cpu")
    weight = torch.randn(shape, requires_grad=True)
    first = None
    for _ in range(4):
        (view,) = manager.get_simultaneous((shape, torch.float32))
        assert not view.requires_grad and view.grad_fn is None and view.is_leaf
        first = view.data_ptr() if first is None else first
        assert view.data_ptr() == first  # same bytes: no reallocation to get rid of it
        view.copy_(weight * 2)
        assert _graph_size(view.grad_fn) > 0  # the write itself is differentiable
        view.sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.full(shape, 8.0))
    assert manager.stats().num_allocations == (1 if shape[0] else 0)


def test_a_new_request_after_a_graph_write_gets_a_fresh_view() -> None:
    manager = WorkspaceManager("cpu")
    (view,) = manager.get_simultaneous(((4,), torch.float32))
    view.copy_(torch.randn(4, requires_grad=True) * 2)
    small, flag = manager.get_simultaneous(((2,), torch.float32), ((0,), torch.bool))
    assert not small.requires_grad and small.grad_fn is None
    assert small.data_ptr() == view.data_ptr()  # within the capacity: the same bytes


def test_writing_a_tensor_that_requires_grad_into_a_view_leaves_its_siblings_plain() -> None:
    # Like torch.empty: two views of one call are independent tensors for autograd.
    manager = WorkspaceManager("cpu", num_ubatches=1)
    x = torch.randn(4, requires_grad=True)
    a, b = manager.get_simultaneous(((4,), torch.float32), ((4,), torch.float32))
    a.copy_(x * 2)
    assert a.requires_grad  # the written view carries the graph, as torch.empty would
    assert not b.requires_grad and b.grad_fn is None
    torch.add(torch.ones(4), torch.ones(4), out=b)  # an out= into the sibling works
    assert torch.equal(b, torch.full((4,), 2.0))
    a.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))
    with torch.no_grad():  # serving: plain views, still distinct memory
        c, d = manager.get_simultaneous(((4,), torch.float32), ((4,), torch.float32))
    assert c.data_ptr() != d.data_ptr() and not c.requires_grad


def test_a_graph_written_into_a_view_lives_only_as_long_as_that_view() -> None:
    """The slot keeps no autograd history: what a view's write saved for backward goes
    with the view, whatever the next request is."""
    manager = WorkspaceManager("cpu")
    x = torch.randn(4, requires_grad=True)
    intermediate = x * 3
    saved = weakref.ref(intermediate)  # sin() saves it for backward
    (view,) = manager.get_simultaneous(((4,), torch.float32))
    view.copy_(intermediate.sin())
    del intermediate
    assert saved() is not None  # the view's graph holds it
    del view
    assert saved() is None
    (again,) = manager.get_simultaneous(((4,), torch.float32))
    assert not again.requires_grad and again.grad_fn is None


def test_a_saved_view_overwritten_by_a_later_request_is_caught_by_autograd() -> None:
    """Workspace memory is reused from call to call: a view that autograd saved for
    backward and a later request's view are the same bytes. Every view of a slot shares
    one version counter, so autograd reports the overwrite instead of computing a wrong
    gradient (the price: a write to any view of the slot, even a disjoint one of the
    same call, marks the saved one as modified; see the README)."""
    manager = WorkspaceManager("cpu")
    weight = torch.randn(4, requires_grad=True)
    (first,) = manager.get_simultaneous(((4,), torch.float32))
    first.copy_(torch.randn(4))
    loss = (first * weight).sum()  # saves `first` for backward
    (second,) = manager.get_simultaneous(((4,), torch.float32))
    assert second.data_ptr() == first.data_ptr()  # the same scratch bytes
    second.fill_(7.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_buffers_allocated_under_inference_mode_are_usable_outside_it() -> None:
    manager = WorkspaceManager("cpu")
    with torch.inference_mode():
        (warm,) = manager.get_simultaneous(((4,), torch.float32))
        warm.fill_(0.0)
        manager.lock()
    (view,) = manager.get_simultaneous(((4,), torch.float32))
    assert not view.is_inference()
    view.fill_(1.0)  # an inference tensor would refuse this outside inference mode
    assert view.sum().item() == 4.0



# ---------------------------------------------------------------- module-level accessors
def test_module_lock_and_unlock(fresh_workspace_global: None) -> None:
    manager = workspace.init_workspace_manager("cpu", num_ubatches=2)
    manager.get_simultaneous(((2 * MiB,), torch.uint8))
    workspace.lock_workspace()
    assert manager.is_locked()
    assert manager.stats().realized_bytes_per_slot == (2 * MiB, 2 * MiB)
    with pytest.raises(WorkspaceLockedError, match=r"needs 4\.25 MB .* is 2\.00 MB"):
        workspace.current_workspace_manager().get_simultaneous(((4 * MiB + MiB // 4,), torch.uint8))
    workspace.unlock_workspace()
    assert not manager.is_locked()
    workspace.current_workspace_manager().get_simultaneous(((4 * MiB + MiB // 4,), torch.uint8))
    assert manager.capacity_bytes == 4 * MiB + MiB // 4


def test_current_manager_before_init_names_init(fresh_workspace_global: None) -> None:
    assert not workspace.is_workspace_manager_initialized()
    with pytest.raises(RuntimeError, match="init_workspace_manager"):
        workspace.current_workspace_manager()
    with pytest.raises(RuntimeError, match="init_workspace_manager"):
        workspace.lock_workspace()


def test_init_is_idempotent_and_reset_allows_reinit(fresh_workspace_global: None) -> None:
    first = workspace.init_workspace_manager("cpu", num_ubatches=2)
    assert workspace.is_workspace_manager_initialized()
    assert workspace.init_workspace_manager(torch.device("cpu"), 2) is first
    assert workspace.current_workspace_manager() is first

    with pytest.raises(RuntimeError, match="reset_workspace_manager"):
        workspace.init_workspace_manager("cpu", num_ubatches=3)
    assert workspace.current_workspace_manager() is first

    workspace.reset_workspace_manager()
    assert not workspace.is_workspace_manager_initialized()
    second = workspace.init_workspace_manager("cpu", num_ubatches=3)
    assert second is not first and second.num_ubatches == 3
    # None means one slot: the same as num_ubatches=1.
    workspace.reset_workspace_manager()
    one = workspace.init_workspace_manager("cpu")
    assert workspace.init_workspace_manager("cpu", 1) is one and one.num_ubatches == 1


def test_init_without_a_slot_count_adopts_the_existing_manager(
    fresh_workspace_global: None,
) -> None:
    # A library module asks for "the manager on this device" without knowing how many
    # ubatches the application overlaps with.
    manager = workspace.init_workspace_manager("cpu", num_ubatches=2)
    assert workspace.init_workspace_manager("cpu") is manager
    with pytest.raises(RuntimeError, match="already exists"):
        workspace.init_workspace_manager("cpu", num_ubatches=3)



# --------------------------------------------------------------------------------- stats
def test_stats_fields() -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    fresh = manager.stats()
    assert fresh.capacity_bytes == 0
    assert fresh.realized_bytes_per_slot == (0, 0)
    assert fresh.num_resizes == 0 and fresh.num_allocations == 0
    assert fresh.locked is False

    manager.get_simultaneous(((1000,), torch.uint8))
    manager.get_simultaneous(((10, 1000), torch.float32), ((5,), torch.int64))
    manager.get_simultaneous(((5000,), torch.uint8))

    stats = manager.stats()
    big = _layout_bytes(((10, 1000), torch.float32), ((5,), torch.int64))
    assert stats.capacity_bytes == big
    assert stats.realized_bytes_per_slot == (big, 0)
    assert stats.num_resizes == 2
    assert stats.num_allocations == 2
    manager.lock()
    assert manager.stats().locked and manager.stats().realized_bytes_per_slot == (big, big)



# ----------------------------------------------------------------------------- debug log
RESIZE_LINE = re.compile(
    r"^resized from '(?P<site>[^']+)': (?P<old>\d+\.\d\d) MB -> (?P<new>\d+\.\d\d) MB per slot$"
)


@pytest.fixture
def debug_logging(caplog: pytest.LogCaptureFixture) -> None:
    """The workspace logger's DEBUG records in `caplog` (the level is restored after)."""
    caplog.set_level(logging.DEBUG, logger="workspace")


def test_resize_lock_and_unlock_are_logged_at_debug_level(
    debug_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)

    line = _next_line()
    manager.get_simultaneous(((int(12.5 * MiB),), torch.uint8))
    manager.lock()
    manager.unlock()

    records = [r for r in caplog.records if r.name == "workspace"]
    assert all(r.levelno == logging.DEBUG for r in records)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 3, messages
    match = RESIZE_LINE.match(messages[0])
    assert match is not None, messages[0]
    site = f"{THIS_FILE}:{line}:test_resize_lock_and_unlock_are_logged_at_debug_level"
    assert match["site"].endswith(site), match["site"]
    assert (match["old"], match["new"]) == ("0.00", "12.50")
    assert messages[1:] == ["locked at 12.50 MB per slot", "unlocked at 12.50 MB per slot"]


def test_nothing_is_logged_above_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workspace")
    manager = WorkspaceManager("cpu", num_ubatches=2)
    manager.get_simultaneous(((MiB,), torch.uint8))
    manager.lock()
    manager.unlock()
    manager.get_simultaneous(((2 * MiB,), torch.uint8))
    assert manager.stats().num_resizes == 2  # things happened, and...
    assert [r for r in caplog.records if r.name == "workspace"] == []  # ...nothing was logged


def test_a_logging_handler_may_read_stats(debug_logging: None) -> None:
    manager = WorkspaceManager("cpu")
    seen: list[int] = []

    class StatsReader(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(manager.stats().capacity_bytes)  # takes the manager's lock

    handler = StatsReader()
    logger = logging.getLogger("workspace")
    logger.addHandler(handler)
    try:
        done = threading.Event()

        def grow() -> None:
            manager.get_simultaneous(((MiB,), torch.uint8))
            done.set()

        thread = threading.Thread(target=grow, daemon=True)
        thread.start()
        assert done.wait(JOIN_TIMEOUT_S), "growth deadlocked on a handler reading stats()"
    finally:
        logger.removeHandler(handler)
    assert seen == [MiB]


def test_each_resize_is_logged_once_when_two_slots_grow_at_once(
    debug_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    manager = WorkspaceManager("cpu", num_ubatches=2)
    errors: list[BaseException] = []

    def grow(ubatch_id: int) -> None:
        try:
            with registered(UBatchContext(ubatch_id, 2)):
                for size in range(1, 40):
                    manager.get_simultaneous(((size * 4096 + ubatch_id,), torch.uint8))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=grow, args=(i,), daemon=True) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    resizes = [r for r in caplog.records if "resized" in r.getMessage()]
    assert len(resizes) == manager.stats().num_resizes
