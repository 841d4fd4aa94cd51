"""Which device-generic test files run, why, and the known causes of what still fails (ops as data).

Two kinds of file:
  * `wheel`: device-generic tests of ours (`suites/`) over the databases torch's wheel ships in
    `torch.testing._internal` (op_db's error inputs, module_db). They run everywhere, `make test` included.
  * `upstream`: PyTorch's own test files (`test/<name>` of a PyTorch checkout at `UPSTREAM_COMMIT`, given by
    `--pytorch-tests` or TORCH_NEURONX_PYTORCH_TESTS). The wheel does not ship `test/`, and this project
    copies no public code into its tree (README, "Op coverage"), so they are not vendored: the runner reads
    them where they are and fetches nothing. Each report records the file's sha256 and the checkout's commit.
"""

from __future__ import annotations

from pathlib import Path

# torch 2.13.0's `torch.version.git_version`: the upstream files must come from this commit.
UPSTREAM_COMMIT = "cf30153c4c131c8164ee7798e5022d810682e2cb"

SUITES_DIR = Path(__file__).resolve().parent / "suites"

WHEEL: dict[str, str] = {
    "device_op_errors.py": "every op_db entry's error_inputs: the error type and message PyTorch states, "
                           "on the device (device-mismatch, dtype and shape checks: the messages user code "
                           "and libraries match on)",
    "device_modules.py": "every module_db module: forward, input and parameter gradients against CPU in "
                         "train and eval mode; module_error_inputs",
    "device_optims.py": "every optim_db optimizer and configuration the device gets (foreach included): three "
                        "steps against CPU",
}

# PyTorch's device-generic files, in the order they are worth their time (the first ones in `make test`).
UPSTREAM: dict[str, str] = {
    "test_view_ops.py": "views and aliasing (the runtime serves views in place on neuron memory)",
    "test_shape_ops.py": "shape ops, nonzero/flip/roll with out= and devices",
    "test_sort_and_select.py": "sort/topk/kthvalue, stable sorts with index tensors",
    "test_indexing.py": "advanced indexing, index_put_/index_fill_ with CPU index tensors",
    "test_tensor_creation_ops.py": "factories on the device, dtype/device arguments",
    "test_reductions.py": "reductions, out= and dim handling",
    "test_unary_ufuncs.py": "elementwise unary ops over dtypes and extremal values",
    "test_binary_ufuncs.py": "elementwise binary ops, type promotion, CPU scalars",
    "test_torch.py": "TestTorchDeviceType: storage, serialization, copies, device errors",
    "test_type_promotion.py": "result dtypes across devices with CPU scalars",
    "test_linalg.py": "linear algebra (large: full run only)",
    "test_nn.py": "TestNNDeviceType (large: full run only)",
}

# The dtype sample `make test` runs: float32, an integer dtype and bfloat16.
SAMPLE_DTYPES = ["float32", "int64", "bfloat16"]

# Tests that fail on neuron and pass on CPU, by glob over test keys, with the cause (reported beside the
# failure; they are still counted as failures). Delete an entry when it passes.
KNOWN: dict[str, str] = {}
