"""Fixtures of the kernels/ tests (helpers live in tests/rt_helpers.py)."""

from __future__ import annotations

from rt_helpers import fresh_runtime  # noqa: F401 - a fixture
