"""Scratch memory handed out as views of one preallocated byte buffer per ubatch slot,
so that after warmup the hot path never allocates (contract: `WorkspaceManager`)."""

from __future__ import annotations

import functools
import logging
import operator
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import dbo

ALIGNMENT_BYTES = 256
"""Every view starts at an absolute address that is a multiple of this."""

_MAX_CACHED_REQUESTS = 1024
"""Distinct requests remembered per slot; beyond this the slot's cache starts over."""

_MAX_CALL_SITES = 64
"""Call sites remembered for `stats()`; beyond this the smallest are forgotten (generated
code, e.g. from torch.compile, can create a new site per recompilation)."""

_MB = float(1 << 20)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_get_ident = threading.get_ident
_RUN_TOKEN = "workspace.run_token"


def _run_token() -> object | None:
    """A small object that stands for the calling thread's overlap run (None outside one):
    kept in `dbo.run_state()`, dropped with the run."""
    state = dbo.run_state()
    if state is None:
        return None
    token = state.get(_RUN_TOKEN)
    if token is None:
        token = state[_RUN_TOKEN] = object()
    return token

logger = logging.getLogger("workspace")

_Entry = tuple[Callable[[], torch.Tensor], ...]
"""A cached request of one slot: one zero-argument maker per requested tensor."""


class WorkspaceLockedError(RuntimeError):
    """A request needed more bytes than the locked capacity."""


class WorkspaceAllocationError(RuntimeError):
    """The device could not allocate a slot's buffer; the manager stays usable."""


@dataclass(frozen=True)
class WorkspaceStats:
    """A snapshot of a manager's memory, from `WorkspaceManager.stats()`."""

    capacity_bytes: int
    """The shared capacity: the size every slot has once it is realized."""
    realized_bytes_per_slot: tuple[int, ...]
    """Bytes each slot holds now (0: not allocated yet; < capacity: realized later)."""
    num_resizes: int
    """How many times the shared capacity rose."""
    num_allocations: int
    """How many slot buffers were allocated, all slots together."""
    locked: bool
    """Whether growth is forbidden."""
    top_call_sites: tuple[tuple[str, int], ...]
    """Up to 5 `(file:line:function, bytes)`, largest first: the call sites that asked for
    the most bytes, recorded when a slot first sees their request."""


def _in_package(filename: str) -> bool:
    return os.path.dirname(os.path.abspath(filename)) == _PACKAGE_DIR


def _caller_outside_package() -> str:
    """`file:line:function` of the innermost frame outside the workspace package."""
    frame: Any = sys._getframe(1)
    while frame is not None and _in_package(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}"


def _debug_log(message: str, *args: Any) -> None:
    """Log at INFO when DBO_DEBUG_WORKSPACE is set; to stderr if `logging` has no handler."""
    value = os.environ.get("DBO_DEBUG_WORKSPACE", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    if logger.hasHandlers():
        logger.info(message, *args)
    else:
        print(message % args, file=sys.stderr)


def _normalize_request(index: int, request: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Check one `(shape, dtype)` request; raise TypeError/ValueError naming it."""
    if not isinstance(request, (tuple, list)) or len(request) != 2:
        raise TypeError(
            f"workspace request {index} must be a (shape, dtype) pair, got {request!r}"
        )
    shape, dtype = request
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"workspace request {index}: dtype must be a torch.dtype, got {dtype!r} "
            f"of type {type(dtype).__name__}"
        )
    if not isinstance(shape, (tuple, list)):
        raise TypeError(
            f"workspace request {index}: shape must be a tuple, list or torch.Size of ints, "
            f"got {shape!r}"
        )
    try:
        dims = tuple(operator.index(dim) for dim in shape)
    except TypeError:
        raise TypeError(
            f"workspace request {index}: a dimension in shape {tuple(shape)!r} is not an "
            "integer"
        ) from None
    if any(dim < 0 for dim in dims):
        raise ValueError(f"workspace request {index}: shape {dims} has a negative dimension")
    return dims, dtype


def _normalized_device(device: torch.device | str | int) -> torch.device:
    """The spelling of `device` that tensors report ("cpu" for cpu:N, "cuda:i" with the
    current index for a bare "cuda"), so that two spellings of one device compare equal."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"workspace device {device}: CUDA is not available in this process "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use 'cpu'"
            )
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    return device


def _format_bytes(num_bytes: int) -> str:
    """`num_bytes` for a message: exact below 1 MiB, in MB above."""
    if num_bytes < 1 << 20:
        return f"{num_bytes} B"
    return f"{num_bytes / _MB:.2f} MB ({num_bytes} B)"


def _layout(
    requests: Sequence[tuple[tuple[int, ...], torch.dtype]],
) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, byte count) per request, each rounded up to 256 bytes; the total."""
    items = []
    offset = 0
    for shape, dtype in requests:
        num_bytes = dtype.itemsize
        for dim in shape:
            num_bytes *= dim
        items.append((offset, num_bytes))
        offset += -(-num_bytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    return items, offset


class _Slot:
    """One ubatch's buffer, its cached requests and its last user.

    Only the slot's own thread realizes its buffer (or `lock()`, when no overlap runs);
    other threads at most clear `entries`, which sends the owner's next request to the
    slow path, where the buffer is realized at the shared capacity.
    """

    __slots__ = ("buffer", "entries", "run_token", "running", "user")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.entries: dict[Any, _Entry] = {}
        self.user: int | None = None
        """`threading.get_ident()` of the thread that asked last."""
        self.run_token: object | None = None
        """The overlap run it asked from (`_run_token`; None outside an overlap): a small
        object of the run's, so that the slot keeps nothing of a finished run alive."""
        self.running = False
        """Whether that ubatch still runs: set when it takes the slot, cleared when its
        function returns or fails (`dbo.at_ubatch_exit`)."""

    @property
    def num_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


class WorkspaceManager:
    """One scratch buffer per ubatch slot; hands out typed views of the caller's slot.

    Args:
        device: where the buffers live (`torch.device`, "cpu", "cuda:0", ...).
        num_ubatches: how many slots, at most 1024; the slot is `dbo.current_ubatch_id()`
            of the caller, so use the overlap's ubatch count. None means 1.

    Semantics:
        - Grow together: all slots share one capacity. A request larger than it raises the
          capacity; the requesting slot is reallocated at once, every other slot at its own
          thread's next request (that thread may still hold views into the old buffer),
          and all of them by `lock()`.
        - Free before allocate: a slot's old buffer is released before the new one is
          allocated, so the peak is max(old, new). A failed allocation raises
          `WorkspaceAllocationError` naming the bytes, and the manager stays usable.
        - Lock: `lock()` realizes every slot and freezes the capacity; data pointers then
          never change and a request that would grow raises `WorkspaceLockedError`.
        - Threads: each slot has one user at a time; growth is serialized by a lock that a
          cached request never takes.
    """

    def __init__(self, device: torch.device | str | int, num_ubatches: int | None = None) -> None:
        num_ubatches = dbo.check_num_ubatches(1 if num_ubatches is None else num_ubatches)
        self._device = _normalized_device(device)
        self._slots = tuple(_Slot() for _ in range(num_ubatches))
        self._capacity_bytes = 0
        self._locked = False
        self._locked_by_capture = False
        self._lock = threading.Lock()
        self._num_resizes = 0
        self._num_allocations = 0
        self._call_site_bytes: dict[str, int] = {}

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

    # ------------------------------------------------------------------ hot path
    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[Sequence[int], torch.dtype]
    ) -> list[torch.Tensor]:
        """Views into the calling ubatch's slot, one per `(shape, dtype)` request.

        Tensor contract:
            - `result[i]` has `shape_i`, `dtype_i`, is contiguous, on `self.device`, starts
              at a `data_ptr()` that is a multiple of 256 bytes, and holds whatever the slot
              held before. It requires no grad and has no autograd history.
            - The views of one call never overlap each other, nor any view of another slot.
            - They are valid until the same slot's next call, which reuses the same bytes:
              take all the tensors a step needs in one call. The same request again
              returns views at the same addresses.
            - All views of a slot share one autograd version counter: a view saved for
              backward reads "modified by an inplace operation" after any in-place write
              to the slot. Clone a view that backward needs.
            - As `out=` of an op whose result has another shape, torch resizes a view in
              place over its neighbours, or past the slot's end moves it to new memory
              (even when locked). Give `out=` the exact shape.
            - A zero-size shape gets a fresh empty tensor; no arguments return `[]`.

        A shape is a tuple, list or torch.Size of integers (what `operator.index` takes);
        quantized dtypes and sizes beyond int64 are unsupported. The slot is
        `dbo.current_ubatch_id()`: slot 0 outside an overlap. A request equal to one the
        slot has seen (`==` on shapes and dtypes) returns from the slot's cache without
        validation; list shapes and tensor dimensions are validated on every call.

        Raises:
            TypeError / ValueError: a malformed request (nothing changes).
            WorkspaceLockedError: the request needs more than the locked capacity.
            WorkspaceAllocationError: the device could not allocate the buffer.
            RuntimeError: no slot for this ubatch id, or another thread runs this slot's
                ubatch of an overlap now.
        """
        ubatch_id = dbo.current_ubatch_id()
        try:
            slot = self._slots[ubatch_id]
        except IndexError:
            raise self._no_slot_error(ubatch_id) from None
        user, token = _get_ident(), _run_token()
        if slot.user != user or slot.run_token is not token:
            self._take_slot(slot, ubatch_id, user, token)
        try:
            entry = slot.entries.get(shapes_and_dtypes)
        except TypeError:  # unhashable (a list shape): validated below
            entry = None
        if entry is None:
            entry = self._prepare(slot, shapes_and_dtypes)
        return [make() for make in entry]

    def _take_slot(self, slot: _Slot, ubatch_id: int, user: int, token: object | None) -> None:
        """Make the calling thread `slot`'s user, unless the last user still runs the
        ubatch it asked from: two threads would then overwrite each other's views (two
        overlaps at once, or a thread outside the overlap using slot 0)."""
        with self._lock:
            if slot.user != user and slot.running:
                raise RuntimeError(
                    f"workspace slot {ubatch_id} is in use by another thread, which runs "
                    f"ubatch {ubatch_id} of an overlap now; two overlaps at once (or a thread "
                    "outside the overlap, which gets slot 0) would overwrite each other's "
                    "views. Run them one after the other, or give each its own WorkspaceManager"
                )
            slot.user, slot.run_token, slot.running = user, token, token is not None
        if token is not None:

            def release() -> None:  # this ubatch's function returned or failed
                if slot.run_token is token:
                    slot.running = False

            dbo.at_ubatch_exit(release, on_failure=release)

    def _no_slot_error(self, ubatch_id: int) -> RuntimeError:
        return RuntimeError(
            f"ubatch {ubatch_id} asked for workspace, but the manager has "
            f"{len(self._slots)} slot(s); create it with num_ubatches >= "
            f"{ubatch_id + 1} (reset_workspace_manager(), then "
            "init_workspace_manager(device, num_ubatches=...))"
        )

    # ------------------------------------------------------------------ slow path
    def _prepare(self, slot: _Slot, requests: tuple[Any, ...]) -> _Entry:
        """Validate a request the slot's cache missed; grow or realize the slot if needed.

        The entry is cached under the validated form (tuples of ints), which also matches
        torch.Size shapes and numpy-int dimensions on the next call.
        """
        normalized = tuple(_normalize_request(i, r) for i, r in enumerate(requests))
        entry = slot.entries.get(normalized)
        if entry is not None:
            return entry
        with self._lock:
            entry, resize_log = self._build_entry(slot, normalized)
            if len(slot.entries) >= _MAX_CACHED_REQUESTS:
                slot.entries.clear()
            slot.entries[normalized] = entry
        if resize_log:  # outside the lock: a logging handler may call stats()
            _debug_log(*resize_log)
        return entry

    def _build_entry(
        self, slot: _Slot, requests: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    ) -> tuple[_Entry, tuple[Any, ...]]:
        """The makers for a validated request (lock held), and a resize message or ()."""
        items, total_bytes = _layout(requests)
        resize_log: tuple[Any, ...] = ()
        if total_bytes > 0:
            caller = _caller_outside_package()
            if total_bytes > self._capacity_bytes:
                resize_log = self._grow(slot, total_bytes, caller)
            elif slot.num_bytes < self._capacity_bytes:
                self._realize(slot, self._capacity_bytes)
            self._record_call_site(caller, total_bytes)
        makers: list[Callable[[], torch.Tensor]] = []
        device = self._device
        for (shape, dtype), (offset, num_bytes) in zip(requests, items, strict=True):
            if num_bytes == 0:
                # A fresh tensor per call: an `out=` that resizes a view onto the buffer
                # would write over its neighbours.
                makers.append(functools.partial(torch.empty, shape, dtype=dtype, device=device))
                continue
            assert slot.buffer is not None, "a slot is realized before it hands out views"
            # Cut outside inference mode (views of an inference tensor refuse in-place
            # writes outside it), and handed out as a `detach()` per call, so that a write
            # from a tensor that requires grad puts only that call's tensor into a graph.
            with torch.inference_mode(False):
                base = slot.buffer[offset : offset + num_bytes].view(dtype).view(shape)
            makers.append(base.detach)
        return tuple(makers), resize_log

    def _record_call_site(self, caller: str, num_bytes: int) -> None:
        if num_bytes > self._call_site_bytes.get(caller, -1):
            self._call_site_bytes[caller] = num_bytes
            if len(self._call_site_bytes) > _MAX_CALL_SITES:
                smallest = min(self._call_site_bytes, key=self._call_site_bytes.__getitem__)
                del self._call_site_bytes[smallest]

    def _grow(self, slot: _Slot, required_bytes: int, caller: str) -> tuple[Any, ...]:
        """Raise the shared capacity; realize `slot` now, the others at their next request.
        Returns the resize message for the debug log."""
        if self._locked:
            fix = (
                "dbo.capture_graph locked it, and it stays locked: captured graphs write into "
                "its buffers, which unlocking to grow would free under their replays; capture "
                "the largest batch first" if self._locked_by_capture else
                "warm up with the largest batch before lock_workspace(), or call "
                "unlock_workspace() to let it grow (not while a captured CUDA graph that uses "
                "the workspace may replay: growing frees its buffers)"
            )
            raise WorkspaceLockedError(
                f"workspace is locked, but the request from '{caller}' needs "
                f"{_format_bytes(required_bytes)} per slot and the locked capacity is "
                f"{_format_bytes(self._capacity_bytes)}; {fix}"
            )
        old_capacity = self._capacity_bytes
        self._realize(slot, required_bytes)
        self._capacity_bytes = required_bytes
        self._num_resizes += 1
        for other in self._slots:
            if other is not slot:
                # Its thread may hold views into its buffer: do not swap it here.
                other.entries.clear()
        return (
            "[workspace] resized from '%s': %.2f MB -> %.2f MB (%d slots, %.2f MB total)",
            caller,
            old_capacity / _MB,
            required_bytes / _MB,
            len(self._slots),
            required_bytes * len(self._slots) / _MB,
        )

    def _realize(self, slot: _Slot, num_bytes: int) -> None:
        """Give `slot` a buffer of `num_bytes`; free the old one first."""
        old = slot.buffer
        if old is not None and old.is_cuda:
            # Inside an overlap, the allocator must not reuse the block before this ubatch's
            # current stream (which its switch events order after its other one) is past it.
            stream = dbo.current_stream()
            if isinstance(stream, torch.cuda.Stream):
                old.record_stream(stream)
        del old
        slot.entries.clear()
        slot.buffer = None
        slot.buffer = self._allocate_aligned(num_bytes)
        self._num_allocations += 1

    def _allocate_aligned(self, num_bytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `num_bytes` whose data_ptr is a multiple of 256: allocators
        promise less (64 bytes on CPU), so it starts at the first aligned spare byte."""
        try:
            raw = self._allocate(num_bytes + ALIGNMENT_BYTES - 1)
        except (RuntimeError, MemoryError) as error:
            raise WorkspaceAllocationError(
                f"could not allocate a workspace buffer of {num_bytes} bytes "
                f"({num_bytes / _MB:.2f} MB) on {self._device}: {error}"
            ) from error
        start = -raw.data_ptr() % ALIGNMENT_BYTES
        return raw[start : start + num_bytes]

    def _allocate(self, num_bytes: int) -> torch.Tensor:
        """The one place that allocates device memory; never an inference tensor, since
        the buffer outlives an `inference_mode` warmup."""
        with torch.inference_mode(False):
            return torch.empty((num_bytes,), dtype=torch.uint8, device=self._device)

    # ------------------------------------------------------------------ lifecycle
    def lock(self, *, by_capture: bool = False) -> None:
        """Realize every slot at the shared capacity, then forbid growth (`by_capture`:
        `dbo.capture_graph` locks it, and a later growth error says so).

        Call it after warmup (and before CUDA-graph capture), outside any overlap: slots
        are reallocated here, so no thread may hold views into an outdated buffer
        (RuntimeError inside an overlap, or while a ubatch still uses its slot). From then
        on data pointers never change.
        """
        if dbo.enabled():
            raise RuntimeError(
                "WorkspaceManager.lock() was called inside an overlap; it reallocates the "
                "slots under the other ubatches' views. Lock outside dbo.overlap, after warmup"
            )
        with self._lock:
            for index, slot in enumerate(self._slots):
                if slot.running:
                    raise RuntimeError(
                        f"WorkspaceManager.lock() was called while ubatch {index} of an "
                        "overlap still uses its slot; it reallocates the slots under their "
                        "views. Lock outside dbo.overlap, after warmup"
                    )
            if self._capacity_bytes > 0:
                for slot in self._slots:
                    if slot.num_bytes != self._capacity_bytes:
                        self._realize(slot, self._capacity_bytes)
            self._locked = True
            self._locked_by_capture = by_capture
        _debug_log(
            "[workspace] locked at %.2f MB per slot (%d slots, %.2f MB total)",
            self._capacity_bytes / _MB,
            len(self._slots),
            self._capacity_bytes * len(self._slots) / _MB,
        )

    def unlock(self) -> None:
        """Allow growth again (for example to warm up for a larger batch)."""
        with self._lock:
            self._locked = self._locked_by_capture = False
        _debug_log("[workspace] unlocked at %.2f MB per slot", self._capacity_bytes / _MB)

    def is_locked(self) -> bool:
        """Whether growth is forbidden."""
        return self._locked

    def stats(self) -> WorkspaceStats:
        """A snapshot of capacity, per-slot bytes, resizes and the largest call sites."""
        with self._lock:
            top = sorted(self._call_site_bytes.items(), key=lambda item: -item[1])[:5]
            return WorkspaceStats(
                capacity_bytes=self._capacity_bytes,
                realized_bytes_per_slot=tuple(slot.num_bytes for slot in self._slots),
                num_resizes=self._num_resizes,
                num_allocations=self._num_allocations,
                locked=self._locked,
                top_call_sites=tuple(top),
            )

    def __repr__(self) -> str:
        return (
            f"WorkspaceManager(device={self._device}, num_ubatches={len(self._slots)}, "
            f"capacity={self._capacity_bytes / _MB:.2f} MB, locked={self._locked})"
        )
