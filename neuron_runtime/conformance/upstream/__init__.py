"""Device-generic test files (PyTorch's and ours over the wheel's databases) run on `neuron` and on CPU.

`python -m neuron_runtime.conformance.upstream --out docs/coverage/upstream.json` runs each chosen file
twice through `instantiate_device_type_tests` (`PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1`, then `cpu`),
in worker processes that survive a crashing or hanging test, and classifies every test: passes on both,
fails only on neuron, fails on CPU too, skipped (with the reason). See `_report.py` for the classes and
docs/coverage/README.md for the results."""

from __future__ import annotations

from ._files import KNOWN, SAMPLE_DTYPES, UPSTREAM, UPSTREAM_COMMIT, WHEEL
from ._report import build, classify, markdown
from ._runner import Task, run

__all__ = ["KNOWN", "SAMPLE_DTYPES", "UPSTREAM", "UPSTREAM_COMMIT", "WHEEL", "Task", "build", "classify",
           "markdown", "run"]
