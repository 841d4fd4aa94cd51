"""What a call is, as data: shared by `aten/` (which builds signatures), `executables/` (which keys and
resolves them) and `compiler/` (which compiles them). The bottom of the runtime; imports only torch.

    _ops.py        an aten op's kind and argument kinds, decided once from its schema (ops as data);
                   `OpInfo.call_args` splits a call's values, `tensors_in` is the one switch on an
                   argument's kind
    _signature.py  a call's signature (canonical JSON, canonical strides) and its cache key (sha256 with the
                   fingerprint)
    _shapes.py     shape classes: one executable for a family of shapes; `kind_of` says what a signature
                   is (op, class, fused group, graph) and `nodes_of` gives a group's or graph's ops

What the other packages use is named here; nothing here is public API.
"""

from ._ops import (
    FACTORY_OUT,
    GENERATOR,
    LIST_KINDS,
    OPT_TENSOR,
    OPT_TENSORS,
    OTHER,
    RANDOM,
    SCALAR,
    SCALARS,
    TENSOR,
    TENSOR_KINDS,
    TENSORS,
    VALUE,
    OpInfo,
    classify,
    cpu_ops,
    qualname_of,
    resolve_op,
    scalar_overload,
    tensors_in,
)
from ._shapes import (
    MINIMUMS,
    bind_symbols,
    describe as describe_shapes,
    example as class_example,
    classes as shape_classes,
    flat_class,
    graph_has_symbols,
    has_nodes,
    has_symbols,
    is_class,
    is_flat,
    kind_of,
    nodes_of,
    other_instance,
    policy_allows,
    tensor_descs,
)
from ._packed import PACK_MAX_NUMEL, dense, is_packed
from ._signature import (
    SignatureError,
    build as build_signature,
    cache_key,
    canonical,
    canonical_signature,
    canonical_strides,
    decode_dtype,
    decode_value,
    encode_value,
    is_wrapped,
    tensor_meta,
)

__all__ = [
    "FACTORY_OUT", "GENERATOR", "LIST_KINDS", "MINIMUMS", "OPT_TENSOR", "OPT_TENSORS", "OTHER", "PACK_MAX_NUMEL",
    "RANDOM", "SCALAR", "SCALARS", "TENSOR", "TENSORS", "TENSOR_KINDS", "VALUE", "OpInfo", "SignatureError", "bind_symbols",
    "build_signature", "cache_key", "canonical",
    "canonical_signature", "canonical_strides",
    "class_example", "classify", "cpu_ops", "decode_dtype", "dense", "decode_value", "describe_shapes", "encode_value",
    "flat_class", "graph_has_symbols", "has_nodes", "has_symbols", "is_class", "is_flat", "is_packed", "is_wrapped", "kind_of", "nodes_of",
    "other_instance",
    "policy_allows", "qualname_of", "resolve_op", "scalar_overload", "shape_classes", "tensor_descs", "tensor_meta",
    "tensors_in",
]
