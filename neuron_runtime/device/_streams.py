"""`torch.neuron.Stream` / `Event` / `stream()` / `current_stream()`: the stream API that device-generic
PyTorch code (FSDP2's overlap of communication and compute) expects of a device module.

Every neuron op runs synchronously on the host, in program order, so there is one stream and every
ordering request is already satisfied: waits are no-ops and events are complete once recorded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


class Stream:
    """A neuron stream: ops issued "on" any stream run in program order on the host."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority

    def wait_event(self, event: Event) -> None:
        """Nothing to wait for: the event's work has already run."""

    def wait_stream(self, stream: Stream) -> None:
        """Nothing to wait for: the other stream's work has already run."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream priority={self.priority}>"


class Event:
    """A neuron event: complete as soon as it is recorded (nothing runs asynchronously)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between two recorded events."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end._t - self._t) * 1000.0


_DEFAULT = Stream()


def current_stream(device: Any = None) -> Stream:
    return _DEFAULT


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """`with torch.neuron.stream(s):` — accepted; ops keep running in program order."""
    yield

