"""The sweep's tables: what is skipped or checked differently, each entry with its reason (ops as data).

Keys are coverage-map names (`OpInfo.name`, or `name.variant_test_name`)."""

from __future__ import annotations

import torch

_SPARSE = "sparse layouts are outside the neuron device's scope (dense strided tensors only)"
_CUDA_ONLY = "CUDA-only kernel: no CPU kernel in any dtype, so there is nothing to compare with"

# Not run at all.
SKIP: dict[str, str] = {
    "to_sparse": _SPARSE,
    "sparse.mm.reduce": _SPARSE,
    "sparse.sampled_addmm": _SPARSE,
    "jiterator_2inputs_2outputs": "jiterator compiles CUDA source at run time (CUDA and ROCm only)",
    "jiterator_4inputs_with_extra_args": "jiterator compiles CUDA source at run time (CUDA and ROCm only)",
    "jiterator_binary": "jiterator compiles CUDA source at run time (CUDA and ROCm only)",
    "jiterator_binary_return_by_ref": "jiterator compiles CUDA source at run time (CUDA and ROCm only)",
    "jiterator_unary": "jiterator compiles CUDA source at run time (CUDA and ROCm only)",
    "torch.ops.aten._flash_attention_forward": _CUDA_ONLY,
    "torch.ops.aten._efficient_attention_forward": _CUDA_ONLY,
    "nn.functional.batch_norm.without_cudnn": "a cuDNN on/off variant of nn.functional.batch_norm (which runs); "
                                              "its OpInfo lists no CPU dtype",
}

# Results whose device is not checked: the samples ask for device 'cpu' explicitly (a CUDA run of the same
# samples returns CPU tensors too).
ANY_DEVICE: dict[str, str] = {
    "to": "its samples pass device 'cpu' positionally: the result is a CPU tensor on every device",
}

# Arguments other than the first that the op requires on CPU (as on CUDA): they stay there.
CPU_ARGS: dict[str, str] = {
    "tensor_split": "tensor_indices_or_sections must be a CPU tensor on every device",
}

# Outputs compared by dtype and shape only: their values are not defined (uninitialized memory), so CPU
# itself gives different values run to run. (OpInfos flagged `has_nondeterministic_output` are added at
# run time.)
METADATA_ONLY: dict[str, str] = {
    "empty": "uninitialized memory",
    "empty_like": "uninitialized memory",
    "new_empty": "uninitialized memory",
    "new_empty_strided": "uninitialized memory",
    "empty_strided": "uninitialized memory",
    "empty_permuted": "uninitialized memory",
    "nn.functional.dropout": "random mask drawn in an order that depends on the kernel",
}

# Backward not checked (forward still is).
NO_BACKWARD: dict[str, str] = {}

# In-place / out= variants not checked.
NO_INPLACE: dict[str, str] = {}
NO_OUT: dict[str, str] = {}

# CUDA-only (op, dtype) pairs the runtime cannot serve yet, and why (keys "name:dtype").
CUDA_ONLY_UNSUPPORTED: dict[str, str] = {}

# Ops that do not match CPU yet, and why (tests/conformance expects them to fail; delete an entry once fixed).
# Empty since the conjugate/negative-bit fix (`_kernels.register_all`: `_copy_from` falls through those keys).
KNOWN_FAILURES: dict[str, str] = {}


def cuda_only_dtypes(op: object) -> list[torch.dtype]:
    """The dtypes CUDA's kernel accepts for `op` and its CPU entry does not list (`dtypesIfCUDA` minus the
    CPU dtypes), for ops with a CPU entry at all."""
    cpu = set(op.supported_dtypes("cpu"))  # type: ignore[attr-defined]
    if not cpu:
        return []
    cuda = set(op.supported_dtypes("cuda"))  # type: ignore[attr-defined]
    return sorted(cuda - cpu, key=str)


def cpu_dtypes(op: object) -> list[torch.dtype]:
    """Every dtype the op's CPU entry lists."""
    return sorted(op.supported_dtypes("cpu"), key=str)  # type: ignore[attr-defined]
