"""Ops as data: how each aten op runs on `neuron`, decided once from its schema.

Kinds:
  view      returns an alias of an input: the CPU kernel runs on the neuron tensor itself (metadata only;
            storage sharing, `_base` and version counters stay native). Never compiled.
  compute   functional, returns tensors: signature -> executable.
  mutating  in-place or out=: the functional variant's executable, then a copy into the mutated args.
  host      runs the op itself on CPU views of the inputs. Every entry has a reason (see `host_reason`).
  special   its own kernel in `_special.py` (allocation, copies, resizes).
"""

from __future__ import annotations

import dataclasses
import keyword
from typing import Any

import torch

# Arg kinds (how an argument enters the key and the executable).
TENSOR = "tensor"          # Tensor: metadata in the key, memory passed to the executable
OPT_TENSOR = "tensor?"     # Tensor?
TENSORS = "tensors"        # Tensor[]
OPT_TENSORS = "tensors?"   # Tensor?[]
SCALAR = "scalar"          # Scalar (and Scalar?): type in the key, value at run time
SCALARS = "scalars"        # Scalar[]: types in the key, values at run time
VALUE = "value"            # everything structural (ints, bools, dims, dtypes, strings): value in the key
GENERATOR = "generator"
OTHER = "other"            # Storage, Stream, ... never compiled
LIST_KINDS = frozenset({TENSORS, OPT_TENSORS})                      # a list of tensors (Nones allowed in one)
TENSOR_KINDS = frozenset({TENSOR, OPT_TENSOR, TENSORS, OPT_TENSORS})  # holds tensors: memory, not a key value


def tensors_in(kind: str, value: Any) -> list[Any]:
    """The tensors (or tensor descriptions) an argument of `kind` holds, in order, Nones left out: the one
    switch on an argument's kind that the layers share."""
    if kind == TENSOR:
        return [value]
    if kind == OPT_TENSOR or kind in LIST_KINDS:
        if value is None:
            return []
        return [value] if kind == OPT_TENSOR else [v for v in value if v is not None]
    return []

# Float arguments that decide output shapes, so they must be keyed by value, not fed at run time.
STRUCTURAL_FLOATS = {"scale_factors", "scales", "scales_h", "scales_w", "scales_d",
                     "ord",  # ord: a norm's kind (export cannot trace a data-dependent choice of algorithm)
                     "correction"}  # var/std's Bessel correction: a constant, and a float to the prims
                                    # underneath (a Scalar there cannot be a run-time input)

# Matmul-class ops whose Scalar arguments (beta, alpha) are keyed by value, not fed at run time: compilers
# specialise their epilogue on them (beta == 0 must ignore `self`; AOTInductor cannot guard on a run-time
# value there), and models pass constants (nn.Linear: 1 and 1). The range factories too: their Scalars
# (start, end, step) decide the output's length, and code calls them with constants (positions, windows).
# lerp's weight: Inductor's lowering branches on it (weight < 0.5), so it cannot be a run-time value; Adam's
# `_foreach_lerp_(exp_avgs, grads, 1 - beta1)` passes a constant. Likewise a norm's order p and the
# shrinkage/margin constants whose kernels branch on their value (export: "Could not guard on
# data-dependent expression"). `pow`'s exponent (`STRUCTURAL_SCALAR_ARGS`): models pass constants (RMSNorm's
# `x.pow(2)`, its backward's `pow(x, 1)`), and a compiler specialises on it (`x * x`); fed at run time it is
# a generic `powf` per element inside every RMSNorm region (issue 39). `pow.Scalar`'s base stays run time.
# `float` arguments that change every step and are fed at run time like a Scalar (keyed by type), with
# why: the fused optimizers' learning rate follows the LR scheduler (the Trainer's default is linear
# decay), so keyed by value it made a new key, and a new compile or host run, every step. A compiler that
# cannot take a run-time value for a `float` (aoti: `_examples.check_scalar_schema`) refuses the key once instead,
# and the op then runs on the host (in place, on the tensors' own memory).
RUNTIME_FLOATS = {op: {"lr": "the LR scheduler changes it every step"}
                  for op in ("aten::_fused_adamw_", "aten::_fused_adamw", "aten::_fused_adam_", "aten::_fused_adam",
                             "aten::_fused_sgd_", "aten::_fused_sgd")}

STRUCTURAL_SCALAR_OPS = {"addmm", "addmv", "addbmm", "baddbmm", "addr", "_addmm_activation",
                         "arange", "linspace", "logspace", "lerp", "_foreach_lerp",
                         "norm", "renorm", "dist", "multi_margin_loss", "multi_margin_loss_backward",
                         "softshrink", "softshrink_backward", "hardshrink", "hardshrink_backward"}
# Single Scalar arguments keyed by value, by op (its name without overload or trailing `_`).
STRUCTURAL_SCALAR_ARGS = {"pow": {"exponent"}}

# Factories with out= (op -> its functional factory, which takes dtype/layout/device where these take out).
FACTORY_OUT = {"arange.out": "arange", "arange.start_out": "arange.start_step", "linspace.out": "linspace",
               "logspace.out": "logspace", "eye.out": "eye", "eye.m_out": "eye.m"}

# Ops with a kernel of their own (see _special.py); the reason is why the generic path cannot serve them.
SPECIAL = {
    "aten::empty.memory_format": "allocates host memory for a neuron tensor",
    "aten::empty_strided": "allocates host memory for a neuron tensor",
    "aten::copy_": "copies between neuron and CPU memory",
    "aten::_copy_from": "copies between neuron and CPU memory",
    "aten::_copy_from_and_resize": "copies between neuron and CPU memory",
    "aten::clone": "a copy into new host memory (PyTorch's composite: empty_like + copy_), one host clone",
    "aten::resize_": "grows storage with a new host buffer",
    "aten::set_.source_Storage": "rebinds storage (metadata only)",
    "aten::set_.source_Storage_storage_offset": "rebinds storage (metadata only)",
    "aten::set_.source_Tensor": "rebinds storage (metadata only)",
    "aten::set_": "rebinds storage (metadata only)",
    "aten::convolution_overrideable": "PrivateUse1's convolution entry point; computed as aten::convolution",
    "aten::convolution_backward_overrideable": "computed as aten::convolution_backward",
    "aten::_efficientzerotensor": "CPU's ZeroTensor has no memory (null data pointer); neuron gets real zeros "
                                  "(_decomp.py)",
    "aten::_native_batch_norm_legit": "mutates the running stats and returns fresh tensors: computed by "
                                      "_native_batch_norm_legit_functional + copies (_decomp.py)",
    "aten::_batch_norm_with_update": "mutates the running stats and returns fresh tensors: computed by "
                                     "_batch_norm_with_update_functional + copies (_decomp.py)",
    "aten::mode.values": "no CPU kernel; its composite kernel refuses devices other than CPU/CUDA/XPU, so the "
                         "generic out= kernel serves it (_decomp.py)",
    "aten::_local_scalar_dense": "reads one value back to the host (.item()): a device-to-host copy, no compute",
    "aten::equal": "returns a Python bool: computed as eq(a, b).all() (compiled), then read, as CUDA does "
                   "(_decomp.py)",
    # Factories with out=: arange/linspace/logspace/eye call these for every device (the functional factory is
    # `empty` + `*.out`). Computed by the functional factory's executable, then copied into `out` (_decomp.py).
    **{f"aten::{op}": "factory with out=: the functional factory compiles, its result is copied into out "
                      "(_decomp.py)" for op in FACTORY_OUT},
}

# In-place ops whose functional variant has another overload name than the rule in `_find_functional` finds.
FUNCTIONAL = {
    "aten::pow_.Scalar": "aten::pow.Tensor_Scalar",
    "aten::pow_.Tensor": "aten::pow.Tensor_Tensor",
    "aten::floor_divide_.Tensor": "aten::floor_divide",
}

# Ops run on the host on purpose (not counted as fallbacks), with the reason.
HOST = {
    "aten::is_set_to": "returns a Python bool",
    "aten::nonzero": "output shape depends on the data",
    "aten::nonzero_static": "reads data on the host",
    "aten::unique_consecutive": "output shape depends on the data",
    "aten::_unique2": "output shape depends on the data",
    "aten::_unique": "output shape depends on the data",
    "aten::unique_dim": "output shape depends on the data",
    "aten::masked_select": "output shape depends on the data",
    "aten::_assert_async": "host-side check",
    "aten::_assert_async.msg": "host-side check",
    "aten::_fused_sdp_choice": "returns a Python int",
    # Factories with out= whose range ends are tensors: they read the ends with .item() first.
    **{f"aten::{op}": "factory with out= whose ends are tensors: fills the out tensor on the host"
       for op in ("linspace.Tensor_Tensor_out", "linspace.Tensor_Scalar_out", "linspace.Scalar_Tensor_out",
                  "logspace.Tensor_Tensor_out", "logspace.Tensor_Scalar_out", "logspace.Scalar_Tensor_out")},
}

# Random ops run on the host by design: they draw from the CPU generator (a pure-Python backend cannot own
# a `torch.Generator`), so `torch.manual_seed` reproduces CPU's values on neuron, call for call, and no
# compile ever runs one (a self-check against eager, or an executable with random numbers of its own,
# would move or leave the user's stream). An op draws if it takes a Generator or PyTorch tags it
# `nondeterministic_seeded` (`native_dropout` takes no Generator and draws from the global one).
RANDOM = "random: draws from the CPU generator, so torch.manual_seed reproduces CPU"

# Ops tagged `nondeterministic_seeded` that draw nothing on CPU, so they compile like any op (why each).
SEEDED_NO_DRAW = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "tagged for its dropout_p, but CPU's flash kernel "
                                                         "refuses dropout_p > 0 (SDPA takes the math path, "
                                                         "whose dropout is native_dropout, then)",
}


@dataclasses.dataclass
class Arg:
    name: str
    kind: str
    kwarg_only: bool
    default: Any
    has_default: bool
    mutable: bool
    optional: bool = False


@dataclasses.dataclass
class OpInfo:
    qualname: str                 # "aten::add.Tensor"
    op: Any                       # torch OpOverload
    args: list[Arg]
    kind: str                     # view | compute | mutating | host | special
    reason: str = ""              # why host/special
    functional: "OpInfo | None" = None   # for mutating: the functional variant
    mutable: list[str] = dataclasses.field(default_factory=list)  # mutated args, in order
    returns_args: list[str] = dataclasses.field(default_factory=list)  # mutating: the arg each return is
    n_returns: int = 0
    returns_list: bool = False    # returns a single Tensor[]

    def call_args(self, values: Any, outs: bool = True) -> tuple[list[Any], dict[str, Any]]:
        """`values` (one per schema argument, in order) as a call's positional and keyword-only arguments;
        `outs=False` leaves out the mutable keyword-only ones (an out= op's outputs)."""
        args = [v for a, v in zip(self.args, values) if not a.kwarg_only]
        kwargs = {a.name: v for a, v in zip(self.args, values) if a.kwarg_only and (outs or not a.mutable)}
        return args, kwargs

    def functional_values(self, values: Any) -> tuple[Any, ...]:
        """`values` without those of the mutable keyword-only arguments (an out= op's outputs): the values
        of its functional variant's arguments."""
        return tuple(v for a, v in zip(self.args, values) if not (a.mutable and a.kwarg_only))

    @property
    def writes_lists(self) -> bool:
        """A mutating op that writes tensor lists, every mutated argument positional (`_foreach_mul_`,
        `_fused_adamw_`): one an in-place executable can serve (`compiler._base`, `writes_inputs`)."""
        if self.kind != "mutating" or not self.mutable:
            return False
        by_name = {a.name: a for a in self.args}
        mutated = [by_name[m] for m in self.mutable]
        return not any(a.kwarg_only for a in mutated) and any(a.kind == TENSORS for a in mutated) and \
            all(a.kind in (TENSOR, TENSORS) for a in mutated)


def _arg_kind(a: Any) -> str:
    t = str(a.type)
    if t == "Tensor":
        return TENSOR
    if t == "Optional[Tensor]":
        return OPT_TENSOR
    if t == "List[Tensor]":
        return TENSORS
    if t == "List[Optional[Tensor]]":
        return OPT_TENSORS
    if "Generator" in t:
        return GENERATOR
    if "Storage" in t or "Stream" in t or "Tensor" in t:
        return OTHER
    if a.name in STRUCTURAL_FLOATS:
        return VALUE
    # Only `Scalar` arguments are run-time inputs: they carry what changes every step (alphas, learning
    # rates and bias corrections of the foreach optimizers). Arguments the schema types `float` (eps,
    # momentum, dropout p, attention scale) are hyperparameters, keyed by value: a compiler cannot take
    # them as inputs (AOTInductor rejects a symbolic float there), and they stay constant across steps.
    if t in ("number", "Optional[number]"):
        return SCALAR
    if t == "List[number]":
        return SCALARS
    return VALUE


def draws_random(qualname: str, op: Any, args: list[Arg]) -> bool:
    """`op` draws random numbers (`RANDOM`): it takes a Generator, or is tagged `nondeterministic_seeded`
    and not known to draw nothing (`SEEDED_NO_DRAW`)."""
    return any(a.kind == GENERATOR for a in args) or (
        torch.Tag.nondeterministic_seeded in op.tags and qualname not in SEEDED_NO_DRAW)


def qualname_of(op: Any) -> str:
    s = op._schema
    return s.name + ("." + s.overload_name if s.overload_name else "")


def resolve_op(qualname: str) -> Any:
    base, _, overload = qualname[len("aten::"):].partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _signature_of(schema: Any, skip_mutable: bool) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not (skip_mutable and a.alias_info and a.alias_info.is_write)]


def _find_functional(qualname: str, schema: Any, mutable: list[Any]) -> Any | None:
    """The functional overload that computes what this in-place/out= op writes, or None."""
    base, _, overload = qualname[len("aten::"):].partition(".")
    out_style = all(a.kwarg_only for a in mutable)
    candidates: list[tuple[str, str]] = []
    if qualname in FUNCTIONAL:
        fbase, _, fov = FUNCTIONAL[qualname][len("aten::"):].partition(".")
        candidates = [(fbase, fov or "default")]
        wanted = [(a.name, str(a.type)) for a in schema.arguments]
    elif out_style:
        candidates = [(base, o) for o in getattr(torch.ops.aten, base).overloads()]
        wanted = _signature_of(schema, skip_mutable=True)
    else:
        if base.startswith("__i") and base.endswith("__"):
            fbase = "__" + base[3:]
        elif base.endswith("_"):
            fbase = base[:-1]
        else:
            return None
        if not hasattr(torch.ops.aten, fbase):
            return None
        candidates = [(fbase, overload or "default")]
        wanted = [(a.name, str(a.type)) for a in schema.arguments]
    for fbase, fov in candidates:
        try:
            f = getattr(getattr(torch.ops.aten, fbase), fov)
        except AttributeError:
            continue
        fs = f._schema
        if any(a.alias_info is not None for a in fs.arguments) or any(r.alias_info is not None for r in fs.returns):
            continue
        if [(a.name, str(a.type)) for a in fs.arguments] != wanted:
            continue
        n_ret = len(fs.returns)
        if n_ret != len(mutable):
            continue
        for r, m in zip(fs.returns, mutable):
            if str(r.type) != str(m.type).replace("Optional[", "").rstrip("]") and str(r.type) != str(m.type):
                break
        else:
            return f
    return None


def _returns(schema: Any) -> tuple[int, bool, bool]:
    """(number of returns, returns a single Tensor[], all returns are tensors)."""
    rets = [str(r.type) for r in schema.returns]
    all_tensors = all(r in ("Tensor", "List[Tensor]") for r in rets)
    return len(rets), rets == ["List[Tensor]"], all_tensors


def classify(qualname: str, special: bool = True) -> OpInfo:
    """How `qualname` runs on neuron. `special=False`: as if it had no kernel of its own (for the kernels
    in `_decomp.py` that wrap the generic one)."""
    op = resolve_op(qualname)
    schema = op._schema
    args = [
        Arg(a.name, _arg_kind(a), a.kwarg_only, a.default_value if a.has_default_value() else None,
            a.has_default_value(), bool(a.alias_info and a.alias_info.is_write),
            str(a.type).startswith("Optional["))
        for a in schema.arguments
    ]
    base = qualname.removeprefix("aten::").partition(".")[0].rstrip("_")
    for arg in args:
        if arg.kind == SCALAR and (base in STRUCTURAL_SCALAR_OPS or arg.name in STRUCTURAL_SCALAR_ARGS.get(base, ())):
            arg.kind = VALUE
    for arg in args:
        if arg.name in RUNTIME_FLOATS.get(qualname, ()) and arg.kind == VALUE:
            arg.kind = SCALAR
    n_ret, ret_list, all_tensors = _returns(schema)
    info = OpInfo(qualname, op, args, "compute", n_returns=n_ret, returns_list=ret_list)
    mutable = [a for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    if special and qualname in SPECIAL:
        info.kind, info.reason = "special", SPECIAL[qualname]
    elif any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        info.kind = "view"
    elif qualname in HOST:
        info.kind, info.reason = "host", HOST[qualname]
    elif draws_random(qualname, op, args):
        info.kind, info.reason = "host", RANDOM
    elif any(a.kind == OTHER for a in args):
        info.kind, info.reason = "host", "takes a storage or stream"
    elif any(a.name == "device" for a in args) and not any(a.kind in (TENSOR, TENSORS) for a in args):
        info.kind, info.reason = "host", "factory: fills fresh host memory"
    elif mutable:
        f = _find_functional(qualname, schema, mutable)
        alias_sets = {frozenset(a.alias_info.before_set): a.name for a in mutable}
        returns_args = [alias_sets.get(frozenset(r.alias_info.before_set)) if r.alias_info else None
                        for r in schema.returns]
        if f is None:
            info.kind, info.reason = "host", "mutates its inputs and has no functional variant"
        elif None in returns_args:
            info.kind, info.reason = "host", "mutates its inputs and also returns fresh values"
        else:
            info.returns_args = [r for r in returns_args if r is not None]
            info.kind = "mutating"
            info.functional = classify(qualname_of(f))
            info.mutable = [a.name for a in mutable]
    elif not all_tensors:
        info.kind, info.reason = "host", "returns a Python value"
    if info.kind in ("compute", "mutating") and any(keyword.iskeyword(a.name) for a in args):
        info.kind, info.reason = "host", "an argument name is a Python keyword"
    return info


def scalar_overload(op: Any, numbers: set[str]) -> Any:
    """The overload of `op` that takes a Scalar where `op` takes the Tensor arguments named in `numbers`.

    A Python number in a Tensor slot is a wrapped number (C++ passed `wrapped_scalar_tensor(s)`, e.g.
    `remainder(t, n)` inside take_along_dim); calling the op object with it is refused for all but
    add/sub/mul/div, while the Scalar overload takes it with the wrapped number's type promotion.
    Returns `op` itself when there is none."""
    if not numbers:
        return op
    want = [(a.name, "Scalar" if a.name in numbers else str(a.type)) for a in op._schema.arguments]
    packet = getattr(torch.ops.aten, op._schema.name.removeprefix("aten::"))
    for name in packet.overloads():
        cand = getattr(packet, name)
        if [(a.name, str(a.type).replace("number", "Scalar")) for a in cand._schema.arguments] == want:
            return cand
    return op


# Functional ops whose composite kernel (CompositeExplicitAutograd, which every backend without a kernel
# of its own runs) allocates the result and calls the op's out= variant: on neuron that is an out= call,
# which the hit path does not serve (`abs` took 22 µs through it, 1.3 µs on CPU). Each gets a kernel of
# its own, so it is one executable like any computed op.
VIA_OUT = ("aten::abs", "aten::logical_not", "aten::logical_and", "aten::logical_or", "aten::logical_xor",
           "aten::nan_to_num", "aten::mvlgamma", "aten::polar", "aten::complex", "aten::huber_loss_backward")


# Backward ops whose composite kernel fills zeros and copies the gradient into a view of them: on neuron that
# is a copy between neuron tensors, which runs alone and ends a fusion region (a Llama's `rotate_half`
# slices: 8 of a training step's 25 regions). Each gets a kernel of its own: one executable, fusible.
VIA_COPY = ("aten::slice_backward", "aten::select_backward")


def cpu_ops() -> list[str]:
    """Every aten op with a CPU kernel, plus the `_foreach_*` ops, `VIA_OUT` and `VIA_COPY`: each gets a PrivateUse1
    kernel.

    The foreach ops have no CPU kernel (CPU runs their composite, which loops over per-tensor ops); on
    our device that loop would pay a dispatch per tensor, so they get one kernel (one executable) each."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return sorted(n for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and (has(n, "CPU") or n.startswith("aten::_foreach_") or n in VIA_OUT
                                                 or n in VIA_COPY))
