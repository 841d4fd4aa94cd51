"""Test names across devices: `instantiate_device_type_tests` names a test
`{Class}{DEVICE}::{test}{_params}_{device}{_dtype...}`; its key replaces the device in both places by
`{dev}`, so a test's CPU and neuron runs meet under one key. No torch import (the parent is light)."""

from __future__ import annotations

import re

# The device names a class or test may carry: PrivateUse1's generic name, ours, CPU's.
_DEVICES = ("privateuse1", "neuron", "cpu")
_CLASS_SUFFIX = re.compile(r"(PRIVATEUSE1|NEURON|CPU)$")
# torch's dtype names as they appear in test names (`common_utils.dtype_name`).
DTYPES = frozenset({
    "float16", "float32", "float64", "bfloat16", "complex32", "complex64", "complex128", "bool", "uint8", "int8",
    "int16", "int32", "int64", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "quint8", "qint8", "qint32", "quint4x2", "quint2x4",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
})


def key(nodeid: str) -> str:
    """`dir/test_x.py::TestFooCPU::test_bar_cpu_float32` -> `TestFoo{dev}::test_bar_{dev}_float32` (the file
    is known from the run)."""
    parts = nodeid.split("::")[1:] or [nodeid]
    if len(parts) >= 2:
        parts[0] = _CLASS_SUFFIX.sub("{dev}", parts[0])
    parts[-1] = _test_key(parts[-1])
    return "::".join(parts)


def _test_key(name: str) -> str:
    comps = name.split("_")
    # The device is the last device token followed only by dtype names.
    for i in range(len(comps) - 1, 0, -1):
        if comps[i] in _DEVICES and _all_dtypes(comps[i + 1:]):
            comps[i] = "{dev}"
            return "_".join(comps)
    return name


def _all_dtypes(comps: list[str]) -> bool:
    return all(c in DTYPES for c in _join_dtypes(comps))


def _join_dtypes(comps: list[str]) -> list[str]:
    """Dtype names split at `_` put together again (`float8_e4m3fn`)."""
    out: list[str] = []
    for c in comps:
        if out and f"{out[-1]}_{c}" in DTYPES:
            out[-1] = f"{out[-1]}_{c}"
        else:
            out.append(c)
    return out


def dtypes_of(test_name: str) -> list[str]:
    """The dtypes a test's name ends with (after its device), [] if none."""
    comps = test_name.split("_")
    for i in range(len(comps) - 1, 0, -1):
        if comps[i] in _DEVICES or comps[i] == "{dev}":
            rest = _join_dtypes(comps[i + 1:])
            if all(c in DTYPES for c in rest):
                return rest
    return []
