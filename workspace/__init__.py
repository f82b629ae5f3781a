"""workspace: scratch memory as views of one preallocated byte buffer per ubatch slot (the
"workspace" logger logs resizes, lock and unlock at DEBUG level).

    init_workspace_manager("cuda", num_ubatches=2)          # once
    q, idx = current_workspace_manager().get_simultaneous(  # in every step
        ((T, H), torch.bfloat16), ((T, K), torch.int32))
    lock_workspace()  # after warm-up with the largest batch: fixed addresses from then on
"""

import inspect
import logging
import math
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Any

import torch

import dbo

__all__ = [
    "ALIGNMENT_BYTES", "WorkspaceAllocationError", "WorkspaceLockedError", "WorkspaceManager",
    "WorkspaceStats", "current_workspace_manager", "init_workspace_manager", "lock_workspace",
    "is_workspace_manager_initialized", "reset_workspace_manager", "unlock_workspace",
]

ALIGNMENT_BYTES = 256  # every view starts at an absolute address that is a multiple of this
_MAX_CACHED_REQUESTS = 1024  # distinct requests a slot remembers before it starts over
_MB = float(1 << 20)
logger = logging.getLogger("workspace")
_Makers = tuple[Callable[[], torch.Tensor], ...]  # a prepared request: one maker per tensor
_Device = torch.device | str | int
_Request = tuple[Sequence[int], torch.dtype]


class WorkspaceLockedError(RuntimeError):
    """A request needed more bytes than the locked capacity."""


class WorkspaceAllocationError(RuntimeError):
    """The device could not allocate a slot's buffer; the manager stays usable."""


@dataclass(frozen=True)
class WorkspaceStats:
    """A snapshot of a manager's memory, from `WorkspaceManager.stats()`."""

    capacity_bytes: int  # the shared capacity: the size of every realized slot
    realized_bytes_per_slot: tuple[int, ...]  # 0: not allocated yet; < capacity: outdated
    num_resizes: int  # how many times the capacity rose
    num_allocations: int  # slot buffers allocated, all slots together
    locked: bool  # whether growth is forbidden


def _caller() -> str:
    """`file:line:function` of the innermost frame outside this package."""
    frame = inspect.currentframe()
    while frame and frame.f_globals.get("__name__", "").partition(".")[0] == __name__:
        frame = frame.f_back
    assert frame is not None, "the workspace is always called from outside"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}"


def _format_bytes(num_bytes: int) -> str:
    return f"{num_bytes} B" if num_bytes < 1 << 20 else f"{num_bytes / _MB:.2f} MB ({num_bytes} B)"


def _check_request(index: int, request: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """`(shape, dtype)` as (tuple of ints, dtype); TypeError/ValueError naming the request."""
    where = f"workspace request {index}"
    if not isinstance(request, (tuple, list)) or len(request) != 2:
        raise TypeError(f"{where} must be a (shape, dtype) pair, got {request!r}")
    shape, dtype = request
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{where}: shape must be a tuple, list or torch.Size, got {shape!r}")
    try:
        dims = tuple(operator.index(dim) for dim in shape)
    except TypeError:
        raise TypeError(f"{where}: a dimension in shape {tuple(shape)} is not an integer") from None
    if any(dim < 0 for dim in dims):
        raise ValueError(f"{where}: shape {dims} has a negative dimension")
    return dims, dtype


@dataclass(eq=False, slots=True)
class _Slot:
    """One ubatch's buffer (replaced by its own thread or `lock()`) and its last user."""

    buffer: torch.Tensor | None = None  # None until realized
    views: dict[Any, _Makers] = field(default_factory=dict)  # by request; cleared on growth
    user: int | None = None  # `threading.get_ident()` of the thread that asked last
    run_token: object | None = None  # the overlap run it asked from, if any
    running: bool = False  # that ubatch still runs (until its `dbo.at_ubatch_exit`)

    @property
    def realized_bytes(self) -> int:
        """The size of its buffer (0: not realized yet)."""
        return 0 if self.buffer is None else self.buffer.numel()


class WorkspaceManager:
    """One scratch buffer per ubatch slot (`num_ubatches`, None: 1), all of one capacity.

    A larger request raises the capacity: its slot is reallocated at once, the others at
    their own thread's next request (which may hold views into the old buffer) or `lock()`.
    """

    def __init__(self, device: _Device, num_ubatches: int | None = None) -> None:
        num_ubatches = dbo.check_num_ubatches(1 if num_ubatches is None else num_ubatches)
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"workspace device {device!r}: CUDA is not available; use 'cpu'")
        self._device = torch.empty(0, device=device).device  # as tensors spell it: cuda:i
        self._slots = tuple(_Slot() for _ in range(num_ubatches))
        self._capacity_bytes = self._num_resizes = self._num_allocations = 0
        self._locked = self._locked_by_capture = False
        self._lock = threading.Lock()  # serializes growth; a cached request never takes it

    @property
    def device(self) -> torch.device:
        """The device of every slot's buffer."""
        return self._device

    @property
    def num_ubatches(self) -> int:
        """The number of slots."""
        return len(self._slots)

    @property
    def capacity_bytes(self) -> int:
        """The shared per-slot capacity in bytes."""
        return self._capacity_bytes

    def get_simultaneous(self, *shapes_and_dtypes: _Request) -> list[torch.Tensor]:
        """Views, one per `(shape, dtype)`, of the slot `dbo.current_ubatch_id()` (slot 0
        outside an overlap): contiguous, 256-byte aligned, stale, not requiring grad, disjoint
        from each other and from other slots; valid until the slot's next call, which reuses
        the bytes (take all a step needs in one call). A zero-size shape gets a fresh tensor.
        Unlike `torch.empty`'s, a slot's views share an autograd version counter, and an `out=`
        of another shape resizes one over its neighbours. Raises TypeError/ValueError naming a
        bad request, `WorkspaceLockedError`, `WorkspaceAllocationError`, or RuntimeError with
        no slot for this ubatch or while another thread runs its ubatch of an overlap."""
        ubatch_id = dbo.current_ubatch_id()
        if ubatch_id >= len(self._slots):
            raise RuntimeError(f"ubatch {ubatch_id} asked for workspace, but the manager has "
                               f"{len(self._slots)} slot(s); create it with num_ubatches >= "
                               f"{ubatch_id + 1} (reset_workspace_manager(), then "
                               "init_workspace_manager(device, num_ubatches=...))")
        slot, state = self._slots[ubatch_id], dbo.run_state()
        # The run is known by a token kept in (and dropped with) its state.
        token = None if state is None else state.setdefault("workspace.run_token", object())
        if slot.user != threading.get_ident() or slot.run_token is not token:
            self._take_slot(slot, ubatch_id, token)
        try:
            makers = slot.views.get(shapes_and_dtypes)
        except TypeError:  # unhashable (a list shape): validated below
            makers = None
        return [make() for make in makers or self._prepare(slot, shapes_and_dtypes)]

    def _take_slot(self, slot: _Slot, ubatch_id: int, token: object | None) -> None:
        """Make the calling thread `slot`'s user, unless its last user still runs its ubatch."""
        user = threading.get_ident()
        with self._lock:
            if slot.user != user and slot.running:
                raise RuntimeError(f"workspace slot {ubatch_id} is in use by another thread, which "
                                   f"runs ubatch {ubatch_id} of an overlap now; two overlaps at "
                                   "once (or a thread outside it, on slot 0) would overwrite "
                                   "each other's views. Run them one after the other, or give "
                                   "each its own WorkspaceManager")
            slot.user, slot.run_token, slot.running = user, token, token is not None
        if token is not None:
            def release() -> None:  # this ubatch's function returned or failed
                if slot.run_token is token:
                    slot.running = False
            dbo.at_ubatch_exit(release, on_failure=release)

    def _prepare(self, slot: _Slot, requests: tuple[Any, ...]) -> _Makers:
        """Validate, lay out (round each up to 256 bytes, accumulate), grow, cut the views."""
        checked = tuple(_check_request(i, request) for i, request in enumerate(requests))
        cached = slot.views.get(checked)  # torch.Size and numpy-int shapes match it too
        if cached is not None:
            return cached
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in checked]
        offsets = [0, *accumulate(-(-size // ALIGNMENT_BYTES) * ALIGNMENT_BYTES for size in sizes)]
        total_bytes = offsets[-1]
        makers: list[Callable[[], torch.Tensor]] = []
        with self._lock:
            old_capacity = self._capacity_bytes
            if total_bytes > old_capacity and self._locked:
                fix = ("dbo.capture_graph locked it: its graphs write into these buffers, which "
                       "growing would free under their replays; capture the largest batch first"
                       if self._locked_by_capture else "warm up with the largest batch before "
                       "lock_workspace(), or call unlock_workspace() (not while a captured "
                       "graph that uses the workspace may replay)")
                raise WorkspaceLockedError(f"workspace is locked, but the request from "
                                           f"'{_caller()}' needs {_format_bytes(total_bytes)} "
                                           "per slot and the locked capacity is "
                                           f"{_format_bytes(old_capacity)}; {fix}")
            if total_bytes > old_capacity:  # the others follow at their own next request
                self._realize(slot, total_bytes)
                self._capacity_bytes, self._num_resizes = total_bytes, self._num_resizes + 1
                for other in self._slots:
                    if other is not slot:  # its thread may still hold views into its buffer
                        other.views.clear()
            elif total_bytes > 0 and slot.realized_bytes < old_capacity:
                self._realize(slot, old_capacity)
            for offset, num_bytes, (shape, dtype) in zip(offsets, sizes, checked):
                if num_bytes == 0:  # fresh: an `out=` resizing a view would overwrite others
                    makers.append(partial(torch.empty, shape, dtype=dtype, device=self._device))
                    continue
                # Cut outside inference mode (its views refuse in-place writes outside it);
                # a `detach()` per call keeps one call's autograd history out of the next's.
                assert slot.buffer is not None, "a request of some bytes realized its slot"
                with torch.inference_mode(False):
                    view = slot.buffer[offset : offset + num_bytes].view(dtype).view(shape)
                makers.append(view.detach)
            if len(slot.views) >= _MAX_CACHED_REQUESTS:
                slot.views.clear()
            slot.views[checked] = prepared = tuple(makers)
        if total_bytes > old_capacity:  # outside the lock: a logging handler may call stats()
            logger.debug("resized from '%s': %.2f MB -> %.2f MB per slot", _caller(),
                         old_capacity / _MB, total_bytes / _MB)
        return prepared

    def _realize(self, slot: _Slot, num_bytes: int) -> None:
        """Free `slot`'s buffer, then allocate `num_bytes`, 256-byte aligned: peak max(old, new)."""
        old, slot.buffer = slot.buffer, None
        slot.views.clear()
        stream = dbo.current_stream()  # a ubatch's CUDA stream, inside an overlap
        if old is not None and old.is_cuda and isinstance(stream, torch.cuda.Stream):
            old.record_stream(stream)  # not reused before that stream is past it
        del old
        try:
            raw = self._allocate(num_bytes + ALIGNMENT_BYTES - 1)
        except (RuntimeError, MemoryError) as error:
            raise WorkspaceAllocationError(f"could not allocate a workspace buffer of "
                                           f"{_format_bytes(num_bytes)} on {self._device}: "
                                           f"{error}") from error
        start = -raw.data_ptr() % ALIGNMENT_BYTES
        slot.buffer = raw[start : start + num_bytes]
        self._num_allocations += 1

    def _allocate(self, num_bytes: int) -> torch.Tensor:
        """The one allocation; no inference tensor (buffers outlive an inference warm-up)."""
        with torch.inference_mode(False):
            return torch.empty((num_bytes,), dtype=torch.uint8, device=self._device)

    def lock(self, *, by_capture: bool = False) -> None:
        """After warm-up: realize every slot at the capacity and fix its data pointer; growth
        then raises `WorkspaceLockedError` (naming `dbo.capture_graph` if `by_capture`)
        until `unlock()`. RuntimeError inside an overlap or while a ubatch uses its slot."""
        with self._lock:
            running = [index for index, slot in enumerate(self._slots) if slot.running]
            if dbo.enabled() or running:
                where = "inside an overlap" if dbo.enabled() else (
                    f"while ubatch {running[0]} of an overlap still uses its slot")
                raise RuntimeError(f"WorkspaceManager.lock() was called {where}; it reallocates "
                                   "the slots under their views. Lock outside dbo.overlap")
            for slot in self._slots:
                if slot.realized_bytes != self._capacity_bytes:
                    self._realize(slot, self._capacity_bytes)
            self._locked, self._locked_by_capture = True, by_capture
        logger.debug("locked at %.2f MB per slot", self._capacity_bytes / _MB)

    def unlock(self) -> None:
        """Allow growth again (for example to warm up for a larger batch)."""
        with self._lock:
            self._locked = self._locked_by_capture = False
        logger.debug("unlocked at %.2f MB per slot", self._capacity_bytes / _MB)

    def is_locked(self) -> bool:
        """Whether growth is forbidden."""
        return self._locked

    def stats(self) -> WorkspaceStats:
        """A snapshot of the capacity, each slot's bytes, resizes and allocations."""
        with self._lock:
            realized = tuple(slot.realized_bytes for slot in self._slots)
            return WorkspaceStats(self._capacity_bytes, realized, self._num_resizes,
                                  self._num_allocations, self._locked)

    def __repr__(self) -> str:
        return (f"WorkspaceManager(device={self._device}, num_ubatches={len(self._slots)}, "
                f"capacity={self._capacity_bytes / _MB:.2f} MB, locked={self._locked})")


_holder_lock = threading.Lock()  # the process-wide manager, for code deep inside a model
_manager: WorkspaceManager | None = None
_capture_hook_added = False


def _lock_for_capture() -> Callable[[], None] | None:
    """`dbo.capture_graph`'s hook: lock an unlocked manager for good; what undoes that."""
    manager = _manager
    if manager is None or manager.is_locked():
        return None
    manager.lock(by_capture=True)
    return manager.unlock


def init_workspace_manager(device: _Device, num_ubatches: int | None = None) -> WorkspaceManager:
    """Create the process-wide manager, or return the existing one if it matches (with
    `num_ubatches=None`, whatever its slot count; a new one has 1). RuntimeError if one with
    another device or slot count exists: `reset_workspace_manager()` first."""
    global _manager, _capture_hook_added
    wanted = WorkspaceManager(device, num_ubatches)  # validates; allocates nothing
    with _holder_lock:
        if not _capture_hook_added:  # on first use, not at import
            dbo.add_capture_hook(_lock_for_capture)
            _capture_hook_added = True
        if _manager is None:
            _manager = wanted
        elif _manager.device != wanted.device or num_ubatches not in (None, _manager.num_ubatches):
            raise RuntimeError(f"a workspace manager already exists ({_manager!r}); call "
                               "reset_workspace_manager() before initializing one with "
                               f"device={wanted.device}, num_ubatches={wanted.num_ubatches}")
        return _manager


def is_workspace_manager_initialized() -> bool:
    """Whether `init_workspace_manager` has been called (and not reset since)."""
    return _manager is not None


def current_workspace_manager() -> WorkspaceManager:
    """The process-wide manager. RuntimeError if none is initialized."""
    manager = _manager
    if manager is None:
        raise RuntimeError("the workspace manager is not initialized; call "
                           "workspace.init_workspace_manager(device, num_ubatches) first")
    return manager


def lock_workspace() -> None:
    """`current_workspace_manager().lock()`."""
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    """`current_workspace_manager().unlock()`."""
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    """Forget the process-wide manager (no thread may still use it)."""
    global _manager
    with _holder_lock:
        _manager = None
