"""Where the server keeps entries: a local directory or an S3 prefix.

Both storages are driven from the server's one event loop thread, so their in-memory state needs no locks;
anything that can block for long (fsync, network) is awaited.
"""

from __future__ import annotations

from ._base import EntryInfo, Storage, Writer
from ._open import open_storage

__all__ = ["EntryInfo", "Storage", "Writer", "open_storage"]
