"""Op coverage: PyTorch's OpInfo database (`op_db`) run on `neuron` and compared with CPU.

`python -m neuron_runtime.conformance --tier reference --out docs/coverage/reference.json` writes the
coverage map (JSON + markdown). Needs PyTorch's test utilities (`expecttest`, from the `test` extra).
`neuron_runtime.conformance.upstream` runs device-generic test files (`instantiate_device_type_tests`) on
neuron and on CPU and classifies every difference."""

from __future__ import annotations

from ._check import Result, check_cuda_dtype, check_op, op_key
from ._runner import coverage_map, markdown, sweep

__all__ = ["Result", "check_cuda_dtype", "check_op", "coverage_map", "markdown", "op_key", "sweep"]
