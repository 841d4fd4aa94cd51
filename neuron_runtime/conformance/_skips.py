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

# Compiler refusals a Neuron compiler would make too, by aten op (the refusal's op, not the op_db entry):
# the outputs' shapes depend on the input values, so no executable compiled ahead of the data can hold
# them. These ops run on the host as random ops do, and the coverage map counts them as host by design.
# (A refusal whose reason says the shape depends on the data is counted so too, whatever its op.)
REFUSED_BY_DESIGN: dict[str, str] = {
    "aten::bincount": "output length is the input's largest value + 1",
    "aten::linalg_lstsq": "residuals are empty or not depending on the matrix's computed rank",
    "aten::linalg_lstsq.out": "residuals are empty or not depending on the matrix's computed rank",
    "aten::_ctc_loss": "PyTorch gives it no shape function (tagged dynamic_output_shape): log_alpha's "
                       "length is the longest target's",
    "aten::masked_select": "output length is the number of true mask elements",
}

# Compiler refusals a Neuron compiler would not share, by aten op: why this tier refuses them.
REFUSED_HERE_ONLY: dict[str, str] = {
    "aten::_scaled_mm": "no: Inductor's CPU backend has no float8 code generation; Trainium2 multiplies FP8, "
                        "so a Neuron compiler would compile it",
    "aten::_scaled_mm_v2": "no: Inductor's CPU backend has no float8 code generation; Trainium2 multiplies FP8, "
                           "so a Neuron compiler would compile it",
}

# Words of a refusal that say the output's shape depends on the data (see REFUSED_BY_DESIGN).
DATA_DEPENDENT_WORDS = ("depends on the data", "DynamicOutputShapeException")


def refused_by_design(op: str, why: str) -> bool:
    """Whether a compiler refusal of `op` (with reason `why`) is one any compiler of aten ops would make."""
    return op in REFUSED_BY_DESIGN or any(w in why for w in DATA_DEPENDENT_WORDS)
