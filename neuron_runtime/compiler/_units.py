"""One op's C++ *unit*: the code AOTInductor generates for it, minus AOTInductor's runtime.

AOTInductor (torch 2.13) writes, for each model, a wrapper translation unit that inlines its whole runtime
(`interface.cpp`, which includes `model_container.h` and `model_base.h`: ~2,800 lines of templates) around
the model's own code (a constructor that states the inputs and outputs, `run_impl`: allocations, kernel
and library calls), and a kernel unit (the generated loops). g++ re-optimised that runtime for every op:
74 % of the wrapper's compile (docs/compilers.md). Here the generated code is taken *before* AOTInductor
builds it (`generated`) and rewritten into a unit that holds only the op's code (`unit_source`):

    namespace neuron_op_<k> {
      <the kernels>                        (AOTInductor's kernel code, `extern "C"` dropped)
      static void run(...) { <run_impl> }  (its body, `this->device_idx_` a parameter)
      static const OpInfo info = {n_inputs, n_outputs, in_spec, out_spec, names}
    }
    extern "C" hidden neuron_op_run_<k>, neuron_op_info_<k>   (what the shared runtime calls)

The shared runtime (`_aoti_runtime.py`: `interface.cpp` and the model class's members, compiled once
per host and fingerprint) forwards `AOTInductorModel`'s constructor and `run_impl` to those two entry
points, so a linked op is a complete AOTInductor model `.so` that AOTInductor's own runner loads. Several units fit
in one translation unit (one g++ run for a batch of signatures); the link picks one by `--defsym`.

The rewrite is strict: generated code of any other shape than the one read here (constants, a proxy
executor for ops without a C shim, model members used in `run_impl`, a new top-level construct) is
`Unsupported`, and the op is built the way AOTInductor builds it (`_lowering.aot_lower`), slower but
whole. A new torch is a new fingerprint, so a changed code generator never meets an old rewrite
unnoticed: `tests/compiler/test_units.py` checks the rewrite against this torch's generator.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


class Unsupported(Exception):
    """The generated code has a shape the rewrite does not know; build the op the classic way."""


@dataclass
class Generated:
    """What AOTInductor's code generator produced for one op (before any C++ compile)."""

    wrapper: str
    kernel: str
    extern_nodes: str | None
    n_constants: int


class _Captured(BaseException):
    """Raised from inside AOTInductor to carry the op's unit out (a BaseException, so no `except
    Exception` on the way wraps or swallows it)."""

    def __init__(self, unit: Unit) -> None:
        super().__init__("generated")
        self.unit = unit


@contextlib.contextmanager
def capturing(classic: dict[str, Any]) -> Iterator[None]:
    """For the duration: AOTInductor stops where it would build its generated C++ and raises `_Captured`
    with the op's unit; generated code the rewrite does not know (`Unsupported`) is built by AOTInductor
    as usual, and `classic` gets why and the seconds that build took.

    AOTInductor has no hook between code generation and its C++ build (`AotCodeCompiler.compile`, looked
    up by `compile_fx` at call time), so the class attribute is swapped for the duration, under the
    compiler's process-wide lock (`_aoti._worker`: one compile at a time, as for Inductor's config)."""
    import torch._inductor.codecache as codecache

    original = codecache.AotCodeCompiler.__dict__["compile"]

    def capture(cls: Any, graph: Any, wrapper_code: str, kernel_code: str, extern_nodes: str | None,
                **kwargs: Any) -> Any:
        n_constants = sum(1 for n in graph.constants if n not in graph.folded_constants)
        try:
            u = unit(Generated(wrapper_code, kernel_code, extern_nodes, n_constants))
        except Unsupported as e:
            classic["why"] = str(e)
            t0 = time.perf_counter()
            try:
                return original.__func__(cls, graph, wrapper_code, kernel_code, extern_nodes, **kwargs)
            finally:
                classic["seconds"] = time.perf_counter() - t0
        raise _Captured(u)

    codecache.AotCodeCompiler.compile = classmethod(capture)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        codecache.AotCodeCompiler.compile = original  # type: ignore[method-assign]


def captured(e: BaseException) -> Unit | None:
    """The unit an exception chain carries, if it was raised by `capturing`."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, _Captured):
            return x.unit
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return None


# -- the rewrite --------------------------------------------------------------------------------------
#: The header every unit is compiled with (precompiled once per host: `_aoti_runtime.HostRuntime`): what
#: the kernels need (cpp_prefix.h) and what `run_impl` needs (the C shim and AOTInductor's RAII helpers),
#: but not `model.h`/`model_base.h`, whose templates alone cost 0.8 s of CPU per translation unit.
HEADER = """\
#pragma once
#include <torch/csrc/inductor/cpp_prefix.h>
#include <torch/csrc/inductor/aoti_runtime/utils.h>
#include <torch/csrc/inductor/aoti_runtime/scalar_to_tensor.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>
#include <c10/util/generic_math.h>
#include <sstream>
namespace neuron_rt {
// aoti_include/common.h's helper, which generated code may call (that header includes model.h).
[[maybe_unused]] inline int64_t align(int64_t nbytes) { return (nbytes + 64 - 1) & -64; }
}  // namespace neuron_rt
"""


@dataclass
class Unit:
    """One op's code, ready to be placed in a translation unit as unit number `k` (`source(k)`)."""

    n_inputs: int
    n_outputs: int
    in_spec: str
    out_spec: str
    in_names: list[str]
    out_names: list[str]
    cache_lines: list[str]
    includes: list[str]
    kernels: str
    body: str

    def source(self, k: int) -> str:
        names_in = ", ".join(_c_string(n) for n in self.in_names) or '""'
        names_out = ", ".join(_c_string(n) for n in self.out_names) or '""'
        return f"""
namespace neuron_op_{k} {{
using namespace torch::aot_inductor;
using neuron_rt::align;
{chr(10).join(self.cache_lines)}
{self.kernels}
// AOTI_RUNTIME_CHECK_INPUTS checks are left out: an executable runs only for the signature it was
// compiled for (the runtime keys every call), and their stringstreams cost ~0.4 s of g++ per op.
static constexpr bool _check_aoti_runtime_check_inputs_env() {{ return false; }}
static void run(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles, int32_t device_idx_,
                [[maybe_unused]] AOTIProxyExecutorHandle proxy_executor) {{
{self.body}
}}
static const char* const in_names[] = {{{names_in}}};
static const char* const out_names[] = {{{names_out}}};
static const NeuronOpInfo info = {{{self.n_inputs}, {self.n_outputs}, {self.in_spec}, {self.out_spec}, in_names, out_names}};
}}  // namespace neuron_op_{k}
extern "C" __attribute__((visibility("hidden"))) const NeuronOpInfo* neuron_op_info_{k}() {{
  return &neuron_op_{k}::info;
}}
extern "C" __attribute__((visibility("hidden"))) void neuron_op_run_{k}(
    AtenTensorHandle* in, AtenTensorHandle* out, int32_t device_idx, AOTIProxyExecutorHandle pe) {{
  neuron_op_{k}::run(in, out, device_idx, pe);
}}
"""


#: What `NeuronOpInfo` is, for units and the shared runtime alike (the runtime's build prepends it to
#: aoti_runtime.cpp).
OP_INFO = """\
struct NeuronOpInfo {
  long n_inputs;
  long n_outputs;
  const char* in_spec;
  const char* out_spec;
  const char* const* in_names;
  const char* const* out_names;
};
"""


def translation_unit(header_path: str, units: list[Unit]) -> tuple[str, list[tuple[int, int]]]:
    """One translation unit holding `units` as units 0..n-1, and each unit's line range in it (1-based,
    inclusive): what maps a compiler error back to the signature it belongs to."""
    includes = sorted({inc for u in units for inc in u.includes})
    head = f'#include "{header_path}"\n' + "".join(f"{inc}\n" for inc in includes) + OP_INFO
    parts, ranges = [head], []
    line = head.count("\n") + 1
    for k, u in enumerate(units):
        text = u.source(k)
        n = text.count("\n")
        ranges.append((line, line + n))
        parts.append(text)
        line += n
    return "".join(parts), ranges


def _c_string(s: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.]*", s):
        raise Unsupported(f"unexpected parameter name {s!r}")
    return f'"{s}"'


@functools.cache
def interface_text() -> str:
    """AOTInductor's runtime interface source, as its code generator splices it into every wrapper."""
    path = os.path.join(os.path.dirname(torch.__file__), "_inductor", "codegen", "aoti_runtime", "interface.cpp")
    with open(path, encoding="utf-8") as f:
        return f.read()


# Statements of the generated constructor that the shared runtime's constructor performs itself
# (aoti_runtime.cpp): anything else there means a model the rewrite does not know.
_CTOR_KNOWN = re.compile("|".join([
    r'inputs_info_\[\d+\]\.name = "\w+";',
    r'outputs_info_\[\d+\]\.name = "\w+";',
    r"update_constants_map\(std::move\(constants_map\)\);",
    r"update_constants_array\(std::move\(constants_array\)\);",
    r'in_spec_ = R"\(.*?\)";',
    r'out_spec_ = R"\(.*?\)";',
    r"this->kernels_ = std::make_unique<AOTInductorModelKernels>\(\);",
]), re.S)
_RUN_IMPL = "void AOTInductorModel::run_impl("
_RUN_END = "} // AOTInductorModel::run_impl"
_KERNELS_LINE = "[[maybe_unused]] auto& kernels = static_cast<AOTInductorModelKernels&>(*this->kernels_.get());"
# The input checks AOTInductor generates (run only under AOTI_RUNTIME_CHECK_INPUTS): dropped, see Unit.
_CHECK_FN = re.compile(r"AOTI_NOINLINE static void (?:check_input_\d+|__check_inputs_outputs)\(")
_CHECK_ENV_FN = "static bool _check_aoti_runtime_check_inputs_env() {"
# The device headers a wrapper starts with (ours replaces them): cpu.h, or common.h when the graph has no
# device at all (`zero` of an empty tensor: no kernel, only an allocation).
_DEVICE_HEADERS = ("#include <torch/csrc/inductor/aoti_include/cpu.h>",
                   "#include <torch/csrc/inductor/aoti_include/common.h>")
# AOTInductor declares every kernel before the model (the unit defines them first instead).
_KERNEL_DECL = re.compile(r'extern "C"\s+void\s+\w+\([^;{}]*\);')


def unit(g: Generated) -> Unit:
    """The unit of one op's generated code (raises `Unsupported` for a shape not described above)."""
    if g.extern_nodes:
        raise Unsupported("ops called through AOTInductor's proxy executor")
    if g.n_constants:
        raise Unsupported(f"{g.n_constants} constant(s) in the graph")
    iface = interface_text().strip()
    if g.wrapper.count(iface) != 1:
        raise Unsupported("AOTInductor's runtime is not spliced into the wrapper as expected")
    head, _, rest = g.wrapper.partition(iface)
    ns = rest.find("namespace torch::aot_inductor {")
    if ns < 0:
        raise Unsupported("no model namespace")
    top, model = rest[:ns], rest[ns:]

    # 1. Top level: the device header (ours replaces it), kernel declarations (the kernels themselves
    #    come first in the unit), the cached dtype/device handles.
    cache_lines: list[str] = []
    includes: list[str] = []
    for line in _KERNEL_DECL.sub("", head + top).splitlines():
        s = line.strip()
        if not s or s.startswith("//") or s in _DEVICE_HEADERS:
            continue
        if s.startswith("CACHE_TORCH_"):
            cache_lines.append(s)
        elif s.startswith("#include <") and "inductor/aoti_torch/generated/extend/" in s:
            includes.append(s)
        else:
            raise Unsupported(f"top-level line {s[:80]!r}")

    # 2. The constructor: how many inputs and outputs, their names, the pytree specs.
    m = re.search(r"AOTInductorModelBase\((\d+),\s*(\d+),\s*(\d+),\s*device_str,", model)
    if m is None:
        raise Unsupported("constructor not found")
    n_in, n_out, n_const = (int(x) for x in m.groups())
    if n_const:
        raise Unsupported("constants")
    body_start = model.index("{", m.end())
    ctor_end = model.index("\n}\n", body_start)
    ctor = model[body_start + 1: ctor_end]
    if _CTOR_KNOWN.sub("", ctor).strip():
        raise Unsupported("constructor does more than name inputs and outputs")
    in_names = re.findall(r'inputs_info_\[\d+\]\.name = "(\w+)";', ctor)
    out_names = re.findall(r'outputs_info_\[\d+\]\.name = "(\w+)";', ctor)
    specs = re.findall(r'(?:in|out)_spec_ = (R"\(.*?\)");', ctor, re.S)
    if len(in_names) != n_in or len(out_names) != n_out or len(specs) != 2:
        raise Unsupported("inputs, outputs or specs not as declared")

    # 3. Between the constant-folding stubs and run_impl: only the input checks (dropped).
    const_stub = model.find("void AOTInductorModel::_const_run_impl(")
    run_at = model.find(_RUN_IMPL)
    if const_stub < 0 or run_at < 0 or "use_runtime_constant_folding=False" not in model[:const_stub]:
        raise Unsupported("constant folding or run_impl not as expected")
    helpers = model[model.index("{}", const_stub) + 2: run_at]
    if _strip_checks(helpers).strip():
        raise Unsupported("helper code besides the input checks")

    # 4. run_impl's body, its one member (the device index) a parameter.
    open_at = model.index(") {", run_at) + 3
    end = model.find(_RUN_END, open_at)
    if end < 0:
        raise Unsupported("end of run_impl not found")
    body = model[open_at:end].replace(_KERNELS_LINE, "").replace("this->device_idx_", "device_idx_")
    body = body.replace("__check_inputs_outputs(input_handles, output_handles);", "")
    if "this->" in body or re.search(r"\b(?:constants_|kernels_|constants_info_)\b", body):
        raise Unsupported("run_impl uses model members")

    # 5. The kernels, as C++ functions of the unit's namespace.
    kernels: list[str] = []
    for line in g.kernel.splitlines():
        s = line.strip()
        if s == "#include <torch/csrc/inductor/cpp_prefix.h>":
            continue
        if s.startswith("#") and not s.startswith("#pragma"):
            raise Unsupported(f"preprocessor line in the kernels {s[:80]!r}")
        kernels.append(line)
    kernel_text = re.sub(r'extern "C"\s+', "", "\n".join(kernels))
    return Unit(n_in, n_out, specs[0], specs[1], in_names, out_names, cache_lines, includes, kernel_text, body)


def _strip_checks(text: str) -> str:
    """`text` without AOTInductor's input-check functions (each ends at the first `}` in column 0)."""
    out, i = [], 0
    while True:
        m = _CHECK_FN.search(text, i)
        j = text.find(_CHECK_ENV_FN, i)
        starts = [x for x in (m.start() if m else -1, j) if x >= 0]
        if not starts:
            out.append(text[i:])
            return "".join(out)
        start = min(starts)
        out.append(text[i:start])
        close = text.find("\n}", start)
        if close < 0:
            raise Unsupported("unterminated input check")
        i = close + 2
