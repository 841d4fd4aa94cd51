from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RawChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: bytes
    def __init__(self, digests: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: bytes
    def __init__(self, present: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("key", "size", "sha256")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    sha256: bytes
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EntryInfo(_message.Message):
    __slots__ = ("key", "size", "mtime")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    mtime: float
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., mtime: _Optional[float] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("key", "ttl_ms", "holder")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    key: str
    ttl_ms: int
    holder: str
    def __init__(self, key: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., holder: _Optional[str] = ...) -> None: ...

class AcquireLeaseResponse(_message.Message):
    __slots__ = ("acquired", "lease_id", "exists")
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    acquired: bool
    lease_id: str
    exists: bool
    def __init__(self, acquired: _Optional[bool] = ..., lease_id: _Optional[str] = ..., exists: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("key", "lease_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease_id: str
    def __init__(self, key: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WaitForRequest(_message.Message):
    __slots__ = ("key", "timeout_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_ms: int
    def __init__(self, key: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WaitForResponse(_message.Message):
    __slots__ = ("state",)
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[WaitForResponse.State]
        STORED: _ClassVar[WaitForResponse.State]
        RELEASED: _ClassVar[WaitForResponse.State]
        TIMEOUT: _ClassVar[WaitForResponse.State]
        NO_LEASE: _ClassVar[WaitForResponse.State]
    STATE_UNSPECIFIED: WaitForResponse.State
    STORED: WaitForResponse.State
    RELEASED: WaitForResponse.State
    TIMEOUT: WaitForResponse.State
    NO_LEASE: WaitForResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: WaitForResponse.State
    def __init__(self, state: _Optional[_Union[WaitForResponse.State, str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("entries", "bytes", "max_bytes", "hits", "misses", "puts", "evictions", "active_leases", "storage", "version")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    active_leases: int
    storage: str
    version: str
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[int] = ..., active_leases: _Optional[int] = ..., storage: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
