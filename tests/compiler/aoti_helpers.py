"""Helpers shared by the `aoti` tests (on sys.path as the tests' directory, like tests/rt_helpers.py)."""

from __future__ import annotations

from typing import Any


def forged(payload: bytes, change: Any) -> bytes:
    """An `aoti` artifact whose metadata (`extra/neuron_runtime.json`) `change(meta)` edited in place."""
    import io
    import json
    import zipfile

    from neuron_runtime.compiler._package import META_PATH

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(payload)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith(META_PATH):
                meta = json.loads(data)
                change(meta)
                data = json.dumps(meta).encode()
            dst.writestr(info, data)
    return out.getvalue()
