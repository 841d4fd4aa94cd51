"""Whole-call deadlines for fleet store calls: the caller waits at most the deadline, whatever the store does.

A socket timeout bounds one read, not a call: a store that sends one byte every 2 s never trips a 3 s
timeout, and a hung NFS mount never returns at all. So `DeadlineRunner.run(fn, seconds)` runs `fn` in one
of the store's worker threads and stops waiting after `seconds` (`DeadlineExceeded`); the caller goes on
with a miss. The thread it left is *abandoned*:

  * transports that can see the deadline (`remaining()`, set for the thread running the call) stop there
    themselves: the HTTP body reads and the Redis reply parser check it before every socket read, so an
    abandoned socket call ends within about one read of the deadline;
  * a call blocked in the kernel (a hung filesystem) cannot be stopped; at most `max_abandoned` of a
    store's calls may be left running at once, and past that the store answers every call with
    `StoreHung` at once (a miss) until one of them comes back. Workers are never joined (`_thread`
    threads), so an abandoned one never holds up the interpreter's exit.

Threads are reused (an idle worker waits `IDLE_S` for its next call, then ends), so a call costs a
hand-off between two threads (tens of microseconds), not a thread start.
"""

from __future__ import annotations

import _thread
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

IDLE_S = 30.0
_local = threading.local()


class DeadlineExceeded(TimeoutError):
    """The store did not answer the whole call within its deadline (a miss; the store's breaker opens)."""


class StoreHung(TimeoutError):
    """Too many of the store's earlier calls are still running past their deadline: answered at once."""


def deadline() -> float | None:
    """The `time.monotonic()` deadline of the store call running on this thread (None outside one)."""
    value: float | None = getattr(_local, "deadline", None)
    return value


def remaining(cap: float | None = None) -> float | None:
    """Seconds left of this thread's store call (at most `cap`), or `cap` outside a call. Raises
    `DeadlineExceeded` once the deadline has passed, so a transport that asks before each socket read
    stops there."""
    end = deadline()
    if end is None:
        return cap
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the store call ran past its deadline")
    return left if cap is None else min(cap, left)


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` wrapped to run under this thread's store-call deadline on whichever thread calls it (a call
    that fans out to a pool of its own: its helpers stop at the same deadline)."""
    end = deadline()
    if end is None:
        return fn

    def run(*args: Any) -> T:
        before = getattr(_local, "deadline", None)
        _local.deadline = end
        try:
            return fn(*args)
        finally:
            _local.deadline = before

    return run


class _Call(Generic[T]):
    __slots__ = ("fn", "end", "done", "result", "error", "finished", "abandoned")

    def __init__(self, fn: Callable[[], T], end: float) -> None:
        self.fn, self.end = fn, end
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.finished = self.abandoned = False


class DeadlineRunner:
    """A store's worker threads: `run(fn, seconds)` returns `fn()`'s result, re-raises its exception, or
    raises `DeadlineExceeded` after `seconds`. Thread-safe; see the module docstring."""

    def __init__(self, name: str, max_abandoned: int = 8) -> None:
        self.name = name
        self.max_abandoned = max_abandoned
        self.abandoned = 0  # calls left running past their deadline, not yet come back
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Call[Any]]] = []

    def run(self, fn: Callable[[], T], seconds: float) -> T:
        end = time.monotonic() + seconds
        with self._lock:
            if self.abandoned >= self.max_abandoned:
                raise StoreHung(f"{self.abandoned} earlier calls to this store are still running past their "
                                "deadline (a hung mount or a store that never finishes answering)")
            inbox = self._idle.pop() if self._idle else None
        call: _Call[T] = _Call(fn, end)
        if inbox is None:
            inbox = queue.SimpleQueue()
            # `_thread`, not `threading.Thread(...).start()`: that waits (unbounded) until the new thread
            # runs, which on a loaded host can outlast the deadline itself; nobody joins these threads.
            _thread.start_new_thread(self._work, (inbox,))
        inbox.put(call)
        if not call.done.wait(max(0.0, end - time.monotonic())):
            with self._lock:
                if not call.finished:
                    call.abandoned = True
                    self.abandoned += 1
            if call.abandoned:
                raise DeadlineExceeded(f"no whole answer within the deadline of {seconds:g} s")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _work(self, inbox: queue.SimpleQueue[_Call[Any]]) -> None:
        while True:
            try:
                call = inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                call = inbox.get()  # a caller took this worker just now: its call is on the way
            _local.deadline = call.end
            try:
                call.result = call.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who classifies it
                call.error = e
            finally:
                _local.deadline = None
            with self._lock:
                call.finished = True
                if call.abandoned:
                    self.abandoned -= 1
                    call.result = call.error = None  # nobody reads it: drop the bytes now
                self._idle.append(inbox)
            call.done.set()
