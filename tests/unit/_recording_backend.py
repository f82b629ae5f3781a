"""A CPU backend that logs what the runtime asks of it: the stream-order tests read it."""

from __future__ import annotations

from dbo.device.backends import CpuBackend, CpuEvent, CpuStream


class Recording(CpuBackend):
    """Logs each event recorded ("record", stream), each wait ("wait", waiting stream,
    event's stream) and each stream made current ("current", stream), into `log`."""

    def __init__(self, log: list[tuple[str, ...]] | None = None) -> None:
        super().__init__()
        self.log: list[tuple[str, ...]] = [] if log is None else log

    def record_event(self, stream: CpuStream) -> CpuEvent:
        self.log.append(("record", stream.name))
        return super().record_event(stream)

    def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
        self.log.append(("wait", stream.name, event.stream.name))
        super().wait_event(stream, event)

    def set_current_stream(self, stream: CpuStream) -> None:
        self.log.append(("current", stream.name))
        super().set_current_stream(stream)

    def ordering(self) -> list[tuple[str, ...]]:
        """The records and waits, in order (the streams made current left out)."""
        return [entry for entry in self.log if entry[0] != "current"]

    def waits(self) -> list[tuple[str, ...]]:
        """(waiting stream, event's stream) of each wait, in order."""
        return [entry[1:] for entry in self.log if entry[0] == "wait"]
