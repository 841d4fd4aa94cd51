"""The `aoti` tier's artifact: a `.pt2` zip as AOTInductor's packager lays one out, written member by
member (the op's `.so`, JSON metadata, the archive markers, and ours at `META_PATH`; nothing pickled, no
sources), and read back in one pass over its central directory (`read`, `read_meta`)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

from ..signatures import canonical
from ._base import CompileRefused

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = "neuron-aoti-v2"
META_PATH = "extra/neuron_runtime.json"  # the .pt2 archive's place for extra files; the loader ignores it

# Files an artifact may hold, by suffix: the .so, JSON metadata, and for ops AOTInductor calls through its
# proxy executor (no C shim) the JSON description of that call. An allow-list, so nothing pickled (weights saved
# with torch.save, exported programs) can ever ride along; sources are dropped because nothing loads them.
_KEEP_SUFFIXES = (".so", ".json", "archive_format", "archive_version", "byteorder", ".data/version",
                  "serialization_id")
_DROP_SUFFIXES = (".cpp", ".h")


class ArtifactMismatch(RuntimeError):
    """An artifact built for another host, toolchain or format was offered to `load`; it is never loaded.

    The fingerprint is part of every cache key, so this means a corrupt or misplaced entry: treat it like
    an integrity failure (recompile), never as an op error."""


def package(qualname: str, so: bytes | None, meta: dict[str, Any]) -> bytes:
    """A .pt2 zip as AOTInductor's packager lays one out: the op's .so (none for a library call), its
    metadata, the archive markers, and our metadata (`META_PATH`)."""
    from torch._inductor.codecache import get_device_information

    info = {"AOTI_DEVICE_KEY": "cpu", **get_device_information("cpu")}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/archive_format", "pt2")
        z.writestr("archive/archive_version", "0")
        z.writestr("archive/byteorder", sys.byteorder)
        z.writestr("archive/.data/version", "6\n")
        if so is not None:
            z.writestr("archive/data/aotinductor/model/model.so", so)
            z.writestr("archive/data/aotinductor/model/model_metadata.json", json.dumps(info))
        z.writestr("archive/" + META_PATH, canonical(meta))
    return out.getvalue()


def repackage(qualname: str, raw: bytes, meta: dict[str, Any], tmp: str) -> bytes:
    """The .pt2 zip rebuilt with only allow-listed files, plus our metadata."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        prefix = ""
        for info in src.infolist():
            name = info.filename
            if name.endswith("/archive_format"):
                prefix = name[: -len("archive_format")]
            if name.endswith(_DROP_SUFFIXES):
                continue
            if not name.endswith(_KEEP_SUFFIXES):
                raise CompileRefused(f"{qualname}: AOTInductor package holds an unexpected file {name!r}; "
                                     "refusing it (artifacts carry only the .so and JSON metadata)")
            data = src.read(name)
            dst.writestr(info, _strip(data, tmp) if name.endswith(".so") else data)
        dst.writestr(prefix + META_PATH, canonical(meta))
    return out.getvalue()


def _strip(so: bytes, tmp: str) -> bytes:
    """The .so without its static symbol table (~20 % of it): nothing resolves those symbols; the dynamic
    ones the runner looks up (`AOTInductorModelContainer*`) stay. Unchanged if binutils' strip is absent."""
    tool = shutil.which("strip")
    if tool is None:
        return so
    with tempfile.TemporaryDirectory(prefix="strip-", dir=tmp) as d:
        path = os.path.join(d, "model.so")
        with open(path, "wb") as f:
            f.write(so)
        done = subprocess.run([tool, "--strip-unneeded", path], capture_output=True, timeout=60, check=False)
        if done.returncode != 0:
            log.debug("aoti: strip failed (%s); keeping symbols", done.stderr.decode(errors="replace")[:200])
            return so
        with open(path, "rb") as f:
            return f.read()


# -- reading ----------------------------------------------------------------------------------------
def _members(payload: bytes, wanted: Any) -> dict[str, bytes | memoryview]:
    """The archive members whose names satisfy `wanted`, read in one pass over the central directory.

    Stored (uncompressed) members are sliced out of the payload without a copy or a CRC pass: the entry's
    sha256 was verified before `load`, and this is the hit path's load."""
    view = memoryview(payload)
    out: dict[str, bytes | memoryview] = {}
    with zipfile.ZipFile(io.BytesIO(payload)) as z:
        for info in z.infolist():
            if not wanted(info.filename):
                continue
            local = payload[info.header_offset: info.header_offset + 30]
            if info.compress_type == zipfile.ZIP_STORED and local[:4] == b"PK\x03\x04":
                start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + \
                    int.from_bytes(local[28:30], "little")
                out[info.filename] = view[start: start + info.file_size]
            else:
                out[info.filename] = z.read(info)
    return out


def read_meta(payload: bytes) -> dict[str, Any]:
    """The `extra/neuron_runtime.json` of an artifact (raises `ArtifactMismatch` if it has none)."""
    return read(payload)[0]


def read(payload: bytes) -> tuple[dict[str, Any], dict[str, bytes | memoryview]]:
    """(our metadata, the .so and proxy-executor JSON members) of an artifact."""
    try:
        members = _members(payload, lambda n: n.endswith(("/" + META_PATH, ".so", ".wrapper.json")))
        meta_name = next((n for n in members if n.endswith("/" + META_PATH)), None)
        if meta_name is None:
            raise ArtifactMismatch(f"not an {ARTIFACT_FORMAT} artifact: no {META_PATH}")
        meta: dict[str, Any] = json.loads(bytes(members.pop(meta_name)))
        return meta, members
    except (zipfile.BadZipFile, ValueError, KeyError) as e:
        raise ArtifactMismatch(f"not an {ARTIFACT_FORMAT} artifact: {e}") from e
