"""Picks a storage by its spec (apart from the base class, which the storages import)."""

from __future__ import annotations

from ._base import Storage


def open_storage(spec: str, max_bytes: int) -> Storage:
    """`s3://bucket/prefix` → S3 storage (s3fs), anything else → a local directory."""
    if spec.startswith("s3://"):
        from .s3 import S3Storage

        return S3Storage(spec, max_bytes)
    from .disk import DiskStorage

    return DiskStorage(spec, max_bytes)
