"""The server's and client's named errors.

Each maps to one gRPC status code, so a handler raises the error and one wrapper turns it into the status
(and the client turns the status back into the same error).
"""

from __future__ import annotations

import grpc


class CacheServerError(Exception):
    """Base of every error cache_server raises."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(CacheServerError, ValueError):
    """A flag, environment variable or file the server cannot use (raised at start, never per request)."""


class InvalidKey(CacheServerError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidRequest(CacheServerError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CacheServerError, KeyError):
    code = grpc.StatusCode.NOT_FOUND


class TooLarge(CacheServerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(CacheServerError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(CacheServerError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(CacheServerError):
    """Uploaded bytes did not match the declared size or sha256; nothing was stored."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(CacheServerError):
    """The storage backend failed (disk, S3) or the server is shutting down. Worth a retry."""

    code = grpc.StatusCode.UNAVAILABLE


class StreamRequired(CacheServerError):
    """The entry is larger than one unary message; fetch it with GetStream."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, message: str, size: int = 0) -> None:
        super().__init__(message)
        self.size = size


_BY_CODE: dict[grpc.StatusCode, type[CacheServerError]] = {
    cls.code: cls
    for cls in (InvalidKey, NotFound, TooLarge, Unauthenticated, PermissionDenied, DataLoss, Unavailable,
                StreamRequired)
}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable


def from_status(code: grpc.StatusCode, details: str) -> CacheServerError:
    """The named error for a status a server returned (unknown codes become the base class)."""
    cls = _BY_CODE.get(code, CacheServerError)
    err = cls(f"{code.name}: {details}")
    err.code = code
    return err
