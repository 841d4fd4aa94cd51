"""The stores' answers, fuzzed (`_storefuzz`): a bounded run here; `benchmarks/store_fuzz.py` runs
>= 10,000 cases for the record (docs/benchmarks.md). `NEURON_STORE_FUZZ_CASES` sets this run's count."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from _storefuzz import Case, cases, check_case  # type: ignore[import-not-found]

CASES = int(os.environ.get("NEURON_STORE_FUZZ_CASES", "12"))


@settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_store_answers_never_hang_lie_through_or_read_unbounded(case: Case) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_case(case, Path(tmp))
