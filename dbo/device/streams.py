"""Stream leases: each live runner's streams are distinct device queues, none another's."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Collection
from typing import Any

import torch

from dbo.device.backends import DeviceBackend

_MAX_STREAM_DRAWS = 128
"""New streams drawn, at most, looking for distinct ones (from a backend whose pool aliases)."""


def distinct_streams(backend: DeviceBackend, count: int, taken: Collection[Any] = ()) -> list[Any]:
    """`count` new streams that are distinct queues, none of them the caller's current
    stream nor one whose key is in `taken`; RuntimeError when the device cannot give that
    many (a shared queue would serialize two ubatches)."""
    refused = {*taken, backend.stream_key(backend.current_stream())}
    streams: list[Any] = []
    drawn: list[Any] = []
    while len(streams) < count and len(drawn) < _MAX_STREAM_DRAWS:
        role = "compute" if len(streams) % 2 == 0 else "comm"
        drawn.append(backend.new_stream(f"{role}{len(streams) // 2}"))
        key = backend.stream_key(drawn[-1])
        if key not in refused:
            refused.add(key)
            streams.append(drawn[-1])
    kept = {id(stream) for stream in streams} if len(streams) == count else set()
    for stream in drawn:
        if id(stream) not in kept:
            backend.release_stream(stream)
    if len(streams) < count:
        raise RuntimeError(
            f"could not get {count} distinct streams on {backend.device} (got "
            f"{len(streams)} in {len(drawn)} draws, {len(taken)} held by live runners): "
            "use fewer ubatches, or fewer live runners (close the UBatchRunners you no "
            "longer use)"
        )
    return streams


class StreamLease:
    """A runner's streams on one device, none another live runner's, until `release()`
    or until nothing refers to the lease (a run the watchdog gave up on keeps it)."""

    def __init__(self, streams: list[Any], give_back: Any) -> None:
        self.streams = streams
        self.release = weakref.finalize(self, give_back)
        self.release.atexit = False


class _HeldStreams:
    """The stream keys that live runners hold, per device, in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[torch.device, set[Any]] = {}
        self._returned: list[tuple[DeviceBackend, list[Any]]] = []
        """Released, still in `_keys`: a release may come from the garbage collector
        inside `lease`, under the lock, so it only appends."""

    def lease(self, backend: DeviceBackend, count: int) -> StreamLease:
        with self._lock:
            while self._returned:
                returned_by, streams = self._returned.pop()
                held = self._keys.setdefault(returned_by.device, set())
                held.difference_update(returned_by.stream_key(stream) for stream in streams)
                for stream in streams:
                    returned_by.release_stream(stream)
            held = self._keys.setdefault(backend.device, set())
            streams = distinct_streams(backend, count, held)
            held.update(backend.stream_key(stream) for stream in streams)
        return StreamLease(streams, functools.partial(self._returned.append, (backend, streams)))

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._keys.clear()
        self._returned.clear()


held_streams = _HeldStreams()
