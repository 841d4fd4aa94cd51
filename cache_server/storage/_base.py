"""The storage contract the server relies on."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class EntryInfo:
    key: str
    size: int
    mtime: float


class Writer(abc.ABC):
    """One upload in progress. Bytes are invisible to readers until `commit()`; `abort()` leaves nothing."""

    @abc.abstractmethod
    async def write(self, chunk: bytes) -> None: ...

    @abc.abstractmethod
    async def commit(self) -> bool:
        """Make the entry visible atomically. False when the key already existed (first writer wins)."""

    @abc.abstractmethod
    async def abort(self) -> None: ...


class Storage(abc.ABC):
    """Write-once blobs by validated key. Methods raise OSError (or a subclass) on backend trouble."""

    #: what `Stats` and the start-up log show (a path or an s3:// URL)
    location: str = ""
    #: the byte cap (`--max-size`)
    max_bytes: int = 0
    #: counted by the storage, reported by `Stats` and the metrics
    evictions: int = 0

    async def start(self) -> None:
        """Prepare (create dirs, rebuild indexes, open sessions). Called once inside the server's loop."""

    async def close(self) -> None:
        """Release resources. Idempotent."""

    @abc.abstractmethod
    async def contains_many(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    async def size(self, key: str) -> int | None:
        """The entry's size, or None when absent."""

    @abc.abstractmethod
    async def read(self, key: str) -> bytes | None:
        """The whole entry, or None when absent."""

    @abc.abstractmethod
    def read_chunks(self, key: str, chunk: int) -> AsyncIterator[bytes]:
        """The entry in order in pieces of at most `chunk` bytes (nothing when absent)."""

    @abc.abstractmethod
    async def open_writer(self, key: str, size: int) -> Writer: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def entries(self) -> AsyncIterator[EntryInfo]: ...

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(entries, bytes) as this replica knows them."""
