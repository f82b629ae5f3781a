"""Scratch memory handed out as views of one preallocated byte buffer per ubatch slot.

Hot-path modules (attention, MoE routing, ...) need temporary tensors every step.
Allocating them with `torch.empty` costs allocator time and fragments device memory.
`WorkspaceManager` keeps one 1-D `torch.uint8` buffer per ubatch slot and returns
typed views into it, so that after warmup the hot path never allocates.

Contract of `get_simultaneous` (see its docstring): views of one call never overlap,
each starts at an address that is a multiple of 256 bytes, and they stay valid until the
*same slot's* next call, which reuses the same bytes.
"""

from __future__ import annotations

import logging
import numbers
import operator
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import dbo
from dbo._checks import check_num_ubatches
from dbo._context import current_registration, registration_of_thread

_get_ident = threading.get_ident

ALIGNMENT_BYTES = 256
"""Every view starts at an absolute address that is a multiple of this."""

_MAX_CACHED_REQUESTS = 1024
"""Distinct requests remembered per slot; beyond this the cache starts over."""

_MAX_CALL_SITES = 64
"""Call sites remembered for `stats()`; beyond this the smallest are forgotten (generated
code, e.g. from torch.compile, can create a new site per recompilation)."""

_INT64_MAX = 2**63 - 1
_MAX_BUFFER_BYTES = _INT64_MAX - (ALIGNMENT_BYTES - 1)
"""The largest slot torch can address (sizes are int64), spare alignment bytes included."""

_QUANTIZED_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)
"""Views of raw bytes cannot carry a quantizer (scale, zero point)."""

_MB = float(1 << 20)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

logger = logging.getLogger("workspace")


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
    """Bytes each slot holds now (0: not allocated yet; < capacity: realized lazily later)."""
    num_resizes: int
    """How many times the shared capacity rose."""
    num_allocations: int
    """How many slot buffers were allocated, all slots together."""
    locked: bool
    """Whether growth is forbidden."""
    top_call_sites: tuple[tuple[str, int], ...]
    """Up to 5 `(file:line:function, bytes)`: the call sites that asked for the most bytes,
    largest first. A site is recorded when its request is first seen by a slot; repeated
    requests take the fast path, which does not inspect the stack."""


def _round_up(num_bytes: int, multiple: int) -> int:
    return (num_bytes + multiple - 1) // multiple * multiple


def _caller_outside_package() -> str:
    """`file:line:function` of the innermost frame outside the workspace package."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == (
        _PACKAGE_DIR
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}"


def _debug_enabled() -> bool:
    value = os.environ.get("DBO_DEBUG_WORKSPACE", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


_own_handler: logging.Handler | None = None
"""The stderr handler `_debug_log` attached, while nothing else handles its messages."""


def _debug_log(message: str, *args: Any) -> None:
    """Log at INFO when DBO_DEBUG_WORKSPACE is set.

    Asking for the logs with the variable should show them even in a program that never
    configured `logging`: in that case a stderr handler is attached once.
    """
    global _own_handler
    if not _debug_enabled():
        return
    if _own_handler is not None and logging.getLogger().handlers:
        # The program configured logging since (`logging.basicConfig` after the first
        # message): its handlers print now, and ours would print every message twice.
        logger.removeHandler(_own_handler)
        _own_handler = None
    if not logger.hasHandlers():
        _own_handler = logging.StreamHandler()
        logger.addHandler(_own_handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.info(message, *args)


@dataclass(frozen=True)
class _Layout:
    """Where each tensor of one request lives in a slot: byte offsets 256-aligned from 0."""

    items: tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int], ...]
    """(dtype, shape, contiguous stride, byte offset) per requested tensor."""
    total_bytes: int


def _normalize_request(index: int, request: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Check one `(shape, dtype)` request; raise TypeError/ValueError naming it."""
    if not isinstance(request, Sequence) or isinstance(request, str) or len(request) != 2:
        raise TypeError(
            f"workspace request {index} must be a (shape, dtype) pair, got {request!r}"
        )
    shape, dtype = request
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"workspace request {index}: dtype must be a torch.dtype, got {dtype!r} "
            f"of type {type(dtype).__name__}"
        )
    if dtype in _QUANTIZED_DTYPES:
        raise TypeError(
            f"workspace request {index}: {dtype} is a quantized dtype; a view of raw bytes "
            "has no quantizer. Ask for its integer storage dtype (e.g. torch.int8) instead"
        )
    if isinstance(shape, (int, torch.SymInt, str, bytes, bytearray)) or not isinstance(
        shape, Sequence
    ):
        raise TypeError(
            f"workspace request {index}: shape must be a sequence of ints "
            f"(e.g. (4, 8) or torch.Size), got {shape!r}"
        )
    dims = []
    for dim in shape:
        if isinstance(dim, bool) or (isinstance(dim, torch.Tensor) and dim.dtype == torch.bool):
            raise TypeError(f"workspace request {index}: dimension {dim!r} is a bool, not an int")
        try:
            dims.append(operator.index(dim))
        except TypeError:
            raise TypeError(
                f"workspace request {index}: dimension {dim!r} in shape {tuple(shape)!r} "
                "is not an integer"
            ) from None
    if any(dim < 0 for dim in dims):
        raise ValueError(
            f"workspace request {index}: shape {tuple(dims)} has a negative dimension"
        )
    if any(dim > _INT64_MAX for dim in dims):
        raise ValueError(
            f"workspace request {index}: shape {tuple(dims)} has a dimension beyond int64, "
            "which no torch tensor can have"
        )
    return tuple(dims), dtype


_LIST_OR_TUPLE = (list, tuple)


def _tuple_form(requests: tuple[Any, ...]) -> Any:
    """`requests` with list shapes and list pairs as tuples (the key the slow path caches
    them under); None for anything else (the slow path then validates it: a dict or a set
    would otherwise turn into a valid-looking tuple here)."""
    form = []
    for request in requests:
        if type(request) not in _LIST_OR_TUPLE or len(request) != 2:
            return None
        shape, dtype = request
        if not isinstance(shape, _LIST_OR_TUPLE):
            return None
        form.append((tuple(shape), dtype))
    return tuple(form)


def _normalized_device(device: torch.device | str | int) -> torch.device:
    """The one spelling of `device` that tensors report: "cpu" for cpu:N, and "cuda:i"
    with the current index for a bare "cuda" (so every slot lands on the same GPU, and
    two spellings of one device compare equal)."""
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
    """`num_bytes` for a message: exact below 1 MiB (a small request read "0.00 MB")."""
    if num_bytes < 1 << 20:
        return f"{num_bytes} B"
    return f"{num_bytes / _MB:.2f} MB ({num_bytes} B)"


def _keep_until_stream_done(buffer: torch.Tensor) -> None:
    """Before a CUDA slot buffer is dropped inside an overlap: keep the caching allocator
    from reusing its block before the calling ubatch's current stream is past it.

    Only this ubatch's kernels use its slot, on its compute and comm streams, and the
    switch events order whichever of the two it left behind the current one, so the
    current stream covers them. Outside an overlap every earlier use is ordered before
    the caller's stream (ubatch streams are joined into it), so nothing is needed. No
    host synchronization: a sync under the baton would also wait for the other
    ubatch's in-flight collectives.
    """
    stream = dbo.current_stream()
    if isinstance(stream, torch.cuda.Stream):
        buffer.record_stream(stream)


_MAX_INT64 = 2**63 - 1


def _make_layout(requests: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> _Layout:
    items = []
    offset = 0
    for index, (shape, dtype) in enumerate(requests):
        stride = []
        running = 1
        for dim in reversed(shape):
            stride.append(running)
            running *= max(dim, 1)
        if 0 in shape and running > _MAX_INT64:
            # Sizes and strides are int64. (A non-empty shape that large needs more bytes
            # than can be allocated: the capacity check says so.)
            raise ValueError(
                f"workspace request {index}: shape {shape} has sizes or strides beyond "
                "int64 (torch.empty would fail the same way)"
            )
        numel = 1
        for dim in shape:
            numel *= dim
        items.append((dtype, shape, tuple(reversed(stride)), offset))
        offset += _round_up(numel * dtype.itemsize, ALIGNMENT_BYTES)
    return _Layout(tuple(items), offset)


def _joined_graph(entry: _Entry) -> bool:
    """Whether a typed view of `entry` joined an autograd graph. A function, so that no
    loop variable of the caller keeps a typed view (and its buffer) alive."""
    for base in entry.bases:  # noqa: SIM110 - any(<generator>) costs ~0.5 us more per call
        if base.requires_grad:
            return True
    return False


class _Entry:
    """A cached request for one slot: how to cut each view, and the typed views cut from."""

    __slots__ = ("views", "bases")

    def __init__(
        self,
        views: list[tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...], int]],
        bases: tuple[torch.Tensor, ...],
    ) -> None:
        self.views = views
        """Per tensor: (`as_strided` bound to a typed view of the buffer, shape, stride,
        element offset); one call builds the view."""
        self.bases = bases
        """The typed views of the buffer that `views` cut from, one per view (checked
        for autograd history on every call, see `_Slot.forget_history`)."""


class _Slot:
    """One ubatch's buffer and its cached requests.

    Only the slot's own thread realizes its buffer (or `lock()`, when no overlap runs);
    other threads at most clear `entries`, which makes the owner's next request take the
    slow path and realize the buffer to the shared capacity.
    """

    __slots__ = ("buffer", "entries", "last_entry", "registration", "user")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.entries: dict[Any, _Entry] = {}
        self.last_entry: _Entry | None = None
        """The entry of the request handed out last (its views are checked for a graph
        at the next request, whichever it is)."""
        self.user: int | None = None
        """`threading.get_ident()` of the thread that asked last (see `_take_slot`)."""
        self.registration = 0
        """That thread's registration number when it asked (`dbo._context`: unique per
        registration, 0 outside an overlap). A number, so that the slot keeps nothing
        of a finished run alive."""

    @property
    def num_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def drop_buffer(self) -> None:
        self.entries.clear()
        self.last_entry = None
        self.buffer = None

    def held_by_a_running_ubatch(self) -> bool:
        """Whether the thread that asked last still runs the very ubatch registration it
        asked from (then no other thread may take or reallocate the slot)."""
        return (
            self.user is not None
            and self.registration != 0
            and registration_of_thread(self.user) == self.registration
        )

    def forget_history(self) -> None:
        """Drop the cached requests after one of their typed views joined a graph.

        Writing into a view from a tensor that requires grad (`view.copy_(activation)`)
        makes the typed view it was cut from part of that graph; views cut from it later
        would inherit the graph, require grad and keep every old step's graph alive.
        The typed views are recut from the (uint8, history-free) buffer at the next
        request: same bytes, same data pointers.
        """
        self.entries.clear()
        self.last_entry = None

    def typed_view(self, dtype: torch.dtype) -> torch.Tensor:
        """A new `dtype` view of the whole buffer: an autograd base of its own.

        Each view a request hands out is cut from a typed view of its own, so that
        writing a tensor that requires grad into one view (which puts that typed view
        into the graph) leaves the other views of the call as plain as `torch.empty`'s.
        Made once per cached request, on the slow path.
        """
        assert self.buffer is not None, "slot must be realized before it hands out views"
        # A dtype view made in inference mode would be an inference tensor, whose views
        # refuse in-place writes outside inference mode.
        with torch.inference_mode(False):
            return self.buffer.view(dtype)


class WorkspaceManager:
    """One scratch buffer per ubatch slot; hands out typed views of the caller's slot.

    Args:
        device: where the buffers live (`torch.device`, "cpu", "cuda:0", ...).
        num_ubatches: how many slots; the slot is `dbo.current_ubatch_id()` of the caller,
            so use the overlap's ubatch count (at most 1024). None means 1 (no DBO).

    Semantics:
        - Grow together: all slots share one capacity. A request larger than it raises the
          capacity; the requesting slot is reallocated at once, every other slot at its own
          thread's next request (its thread may still hold views into the old buffer), and
          all of them by `lock()`.
        - Free before allocate: a slot's old buffer is released before the new one is
          allocated, so the peak is max(old, new). A failed allocation raises
          `WorkspaceAllocationError` and leaves the manager usable.
        - Lock: after warmup, `lock()` realizes every slot and freezes the capacity; data
          pointers then never change (CUDA graphs stay valid; unless an `out=` of another
          shape resizes a view past the slot's end, see `get_simultaneous`) and a request
          that would grow raises `WorkspaceLockedError`.
        - Threads: each ubatch thread touches its own slot; growth is serialized by a
          lock that the fast path (a request seen before) never takes.
    """

    def __init__(self, device: torch.device | str | int, num_ubatches: int | None = None) -> None:
        if num_ubatches is None:
            num_ubatches = 1
        num_ubatches = check_num_ubatches(num_ubatches)
        self._device = _normalized_device(device)
        self._slots = tuple(_Slot() for _ in range(num_ubatches))
        self._capacity_bytes = 0
        self._locked = False
        self._lock = threading.Lock()
        self._layouts: dict[Any, _Layout] = {}
        self._num_resizes = 0
        self._num_allocations = 0
        self._call_site_bytes: dict[str, int] = {}
        self._deferred_logs: list[tuple[Any, ...]] = []

    # ------------------------------------------------------------------ properties
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
            - `result[i]` has `shape_i`, `dtype_i`, is contiguous, on `self.device`, and
              starts at a `data_ptr()` that is a multiple of 256 bytes. Contents are
              uninitialized (whatever the slot held before).
            - The views of one call never overlap each other, nor any view of another slot.
            - They are valid until the *same slot's* next `get_simultaneous` call, which
              reuses the same bytes: take all the tensors a step needs in one call.
            - The same request again returns views at the same addresses; once the
              capacity suffices, no memory is allocated.
            - Unlike `torch.empty`'s tensors, they share the slot's autograd version
              counter: a view saved for backward reads "modified by an inplace
              operation" after any in-place write to the slot, even to a disjoint view
              (which is how a later call overwriting its bytes is caught). Clone a view
              that backward needs.
            - As `out=` of an op whose result has another shape, torch resizes a view in
              place: it then writes over its neighbours, or, past the slot's end, moves
              the whole slot to new memory (even when locked). Give `out=` the exact shape.

        The slot is `dbo.current_ubatch_id()`: outside an overlap, slot 0.
        No arguments return `[]`; a zero-size shape returns a fresh empty tensor (a view
        there could be resized over its neighbours by an `out=`).

        Raises:
            TypeError / ValueError: a malformed request (nothing changes).
            WorkspaceLockedError: the request needs more than the locked capacity.
            WorkspaceAllocationError: the device could not allocate the buffer.
        """
        ubatch_id = dbo.current_ubatch_id()
        try:
            slot = self._slots[ubatch_id]
        except IndexError:
            raise self._no_slot_error(ubatch_id) from None
        user, registration = _get_ident(), current_registration()
        if slot.user != user or slot.registration != registration:
            self._take_slot(slot, ubatch_id, user, registration)
        try:
            entry = slot.entries.get(shapes_and_dtypes)
        except TypeError:  # unhashable: a list shape; look its tuple form up
            try:
                entry = slot.entries.get(_tuple_form(shapes_and_dtypes))
            except TypeError:  # still unhashable (a 0-d array dim): the slow path says
                entry = None
        if entry is not None:
            # True == 1 and 2.0 == 2 hash alike: a cached int request must not let a bool
            # or float dimension through unchecked. Ints, and integers of other types
            # that compare by value (numpy ints, which the validator accepts and which
            # took the slow path on every call, ~6x slower); not a tensor (an id-hashed
            # key whose value may have changed since).
            for shape, _ in shapes_and_dtypes:
                for dim in shape:
                    if type(dim) is not int and (
                        isinstance(dim, bool) or not isinstance(dim, numbers.Integral)
                    ):
                        entry = None
                        break
            if entry is not None and _joined_graph(entry):
                slot.forget_history()
                entry = None
        previous = slot.last_entry
        if previous is not None and previous is not entry and _joined_graph(previous):
            # The previous request's views joined a graph since (a `copy_` from a
            # tensor that requires grad): its typed views would keep that graph (saved
            # activations) alive until the same request came again, which for requests
            # that vary (sequence lengths) may be never.
            slot.forget_history()
            entry = None
        previous = None  # its typed views keep the old buffer: free before allocate
        if entry is None:
            entry = self._prepare(slot, shapes_and_dtypes)
        slot.last_entry = entry
        return [view(shape, stride, offset) for view, shape, stride, offset in entry.views]

    def _take_slot(self, slot: _Slot, ubatch_id: int, user: int, registration: int) -> None:
        """Make the calling thread (and its registration number, 0 outside an overlap)
        `slot`'s user, unless the last user is another thread still running the very
        ubatch registration it asked from: then two threads would share the slot's bytes
        (two overlaps at once from two caller threads, a thread outside the overlap
        using slot 0 meanwhile, a helper thread inside a ubatch), and each would
        overwrite the other's views without a word. A last user that has moved on (its
        run ended, even if the same worker now runs another overlap) hands the slot on."""
        with self._lock:
            if slot.user != user and slot.held_by_a_running_ubatch():
                raise RuntimeError(
                    f"workspace slot {ubatch_id} is in use by another thread, which runs "
                    f"ubatch {ubatch_id} of an overlap now; one slot per ubatch id means one "
                    "user at a time: two overlaps running at once from two threads (or a "
                    "thread outside the overlap, which gets slot 0) would overwrite each "
                    "other's views. Run them one after the other, or give each caller its "
                    "own WorkspaceManager"
                )
            slot.user, slot.registration = user, registration

    def _no_slot_error(self, ubatch_id: int) -> RuntimeError:
        return RuntimeError(
            f"ubatch {ubatch_id} asked for workspace, but the manager has "
            f"{len(self._slots)} slot(s); create it with num_ubatches >= "
            f"{ubatch_id + 1} (reset_workspace_manager(), then "
            "init_workspace_manager(device, num_ubatches=...))"
        )

    # ------------------------------------------------------------------ slow path
    def _prepare(self, slot: _Slot, requests: tuple[Any, ...]) -> _Entry:
        """Validate a new request, grow or realize the slot if needed, cache the views."""
        normalized = tuple(_normalize_request(i, r) for i, r in enumerate(requests))
        try:
            with self._lock:
                return self._prepare_locked(slot, requests, normalized)
        finally:
            if self._deferred_logs:
                with self._lock:  # take them all at once: other threads flush too
                    logs, self._deferred_logs = self._deferred_logs, []
                for log in logs:
                    _debug_log(*log)

    def _prepare_locked(
        self, slot: _Slot, requests: tuple[Any, ...], normalized: tuple[Any, ...]
    ) -> _Entry:
        """`_prepare` with the lock held."""
        layout = self._layouts.get(normalized)
        if layout is None:
            if len(self._layouts) >= _MAX_CACHED_REQUESTS:
                self._layouts.clear()
            layout = _make_layout(normalized)
            self._layouts[normalized] = layout
        entry: _Entry
        if layout.total_bytes == 0:
            # Only empty tensors: nothing to allocate, and no slot to realize. A fresh
            # tensor per call (no bytes) so that none can inherit another's autograd
            # history.
            entry = _Entry(
                [
                    (self._empty_maker(dtype), shape, stride, 0)
                    for dtype, shape, stride, _ in layout.items
                ],
                (),
            )
        else:
            entry = self._realized_entry(slot, layout)
        if len(slot.entries) >= _MAX_CACHED_REQUESTS:
            slot.entries.clear()
        try:
            slot.entries[requests] = entry
        except TypeError:
            slot.entries[normalized] = entry
        return entry

    def _realized_entry(self, slot: _Slot, layout: _Layout) -> _Entry:
        """Grow or realize `slot` for `layout` (lock held); the views' recipe."""
        caller = _caller_outside_package()
        if layout.total_bytes > self._capacity_bytes:
            self._grow(slot, layout.total_bytes, caller)
        elif slot.buffer is None or slot.num_bytes < self._capacity_bytes:
            self._realize(slot, self._capacity_bytes)
        if layout.total_bytes > self._call_site_bytes.get(caller, -1):
            self._call_site_bytes[caller] = layout.total_bytes  # requests that succeeded
            if len(self._call_site_bytes) > _MAX_CALL_SITES:
                smallest = min(self._call_site_bytes, key=self._call_site_bytes.__getitem__)
                del self._call_site_bytes[smallest]
        views = []
        bases = []
        for dtype, shape, stride, byte_offset in layout.items:
            if 0 in shape:
                # No bytes: a fresh tensor, as for an all-empty request. A view here would
                # be an empty window onto the slot's buffer, and an `out=` that resizes it
                # (torch.cat(..., out=empty)) would write over its neighbours' bytes.
                views.append((self._empty_maker(dtype), shape, stride, 0))
                continue
            typed = slot.typed_view(dtype)  # one per view: see `_Slot.typed_view`
            bases.append(typed)
            element_offset = int(typed.storage_offset()) + byte_offset // dtype.itemsize
            views.append((typed.as_strided, shape, stride, element_offset))
        return _Entry(views, tuple(bases))

    def _empty_maker(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self._device

        def empty(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)

        return empty

    def _grow(self, slot: _Slot, required_bytes: int, caller: str) -> None:
        """Raise the shared capacity to `required_bytes`; realize `slot` now, others lazily."""
        if self._locked:
            raise WorkspaceLockedError(
                f"workspace is locked, but the request from '{caller}' needs "
                f"{_format_bytes(required_bytes)} per slot and the locked capacity is "
                f"{_format_bytes(self._capacity_bytes)}; warm up with the largest batch before "
                "lock_workspace(), or call unlock_workspace() to let it grow"
            )
        old_capacity = self._capacity_bytes
        self._realize(slot, required_bytes)
        self._capacity_bytes = required_bytes
        self._num_resizes += 1
        for other in self._slots:
            if other is not slot:
                # The other slot's thread may hold views into its buffer: do not swap it
                # here. Emptying its cache sends its next request to the slow path,
                # which realizes it at the new capacity.
                other.entries.clear()
        # Logged once the lock is released (`_prepare`): a logging handler may call stats().
        self._deferred_logs.append((
            "[workspace] resized from '%s': %.2f MB -> %.2f MB (%d slots, %.2f MB total)",
            caller,
            old_capacity / _MB,
            required_bytes / _MB,
            len(self._slots),
            required_bytes * len(self._slots) / _MB,
        ))

    def _realize(self, slot: _Slot, num_bytes: int) -> None:
        """Give `slot` a buffer of `num_bytes`; free the old one first."""
        if num_bytes > _MAX_BUFFER_BYTES:
            # Checked before anything is dropped: the manager stays as it was.
            raise WorkspaceAllocationError(
                f"a workspace slot of {num_bytes} bytes cannot be addressed (torch sizes "
                f"are int64, at most {_MAX_BUFFER_BYTES} bytes)"
            )
        old = slot.buffer
        if old is not None and old.is_cuda:
            _keep_until_stream_done(old)
        del old
        slot.drop_buffer()
        slot.buffer = self._allocate_aligned(num_bytes)
        self._num_allocations += 1

    def _allocate_aligned(self, num_bytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `num_bytes` whose data_ptr is 256-byte aligned.

        Allocators differ in the alignment they guarantee (64 bytes on CPU), so allocate
        `ALIGNMENT_BYTES - 1` spare bytes and start at the first aligned address.
        """
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
        """The one place that allocates device memory (tests wrap it to watch the peak).

        Never an inference tensor, even during an `inference_mode` warmup: the buffer
        outlives it, and views of an inference tensor refuse in-place writes outside it.
        """
        with torch.inference_mode(False):
            return torch.empty((num_bytes,), dtype=torch.uint8, device=self._device)

    # ------------------------------------------------------------------ lifecycle
    def lock(self) -> None:
        """Realize every slot at the shared capacity, then forbid growth.

        Call it after warmup (and before CUDA-graph capture), when no overlap runs: slots
        are reallocated here, so no thread may hold views into an outdated buffer. From
        then on data pointers never change, and a request that needs more than the
        capacity raises `WorkspaceLockedError`.
        """
        if dbo.enabled():
            raise RuntimeError(
                "WorkspaceManager.lock() was called inside an overlap; it reallocates the "
                "slots under the other ubatches' views. Lock outside dbo.overlap, after warmup"
            )
        with self._lock:
            for index, slot in enumerate(self._slots):
                if slot.held_by_a_running_ubatch():
                    # A thread outside any ubatch (a helper started inside one) while
                    # that ubatch still runs: its slot would be reallocated under it.
                    raise RuntimeError(
                        f"WorkspaceManager.lock() was called while ubatch {index} of an "
                        "overlap still uses its slot; it reallocates the slots under their "
                        "views. Lock outside dbo.overlap, after warmup"
                    )
            if self._capacity_bytes > 0:  # nothing was ever asked for: nothing to realize
                for slot in self._slots:
                    if slot.buffer is None or slot.num_bytes != self._capacity_bytes:
                        self._realize(slot, self._capacity_bytes)
            self._locked = True
        _debug_log(
            "[workspace] locked at %.2f MB per slot (%d slots, %.2f MB total)",
            self._capacity_bytes / _MB,
            len(self._slots),
            self._capacity_bytes * len(self._slots) / _MB,
        )

    def unlock(self) -> None:
        """Allow growth again (for example to warm up for a larger batch)."""
        with self._lock:
            self._locked = False
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
