"""The generated kernels of compute and mutating ops: the hit path (DESIGN §2).

A kernel is Python source generated from the op's schema (`generate`), so arguments bind natively, the key
is one tuple and the executable one call:

  key tuple -> executable (the op's table, `_runtime.kernel_table`) -> outputs relabelled to neuron

A mutating op runs its functional variant's executable, then copies into the mutated arguments (or an
in-place executable writes them). Everything that is not a hit goes to `Runtime.slow_call`. The names a
kernel calls are bound into its globals when it is built (`_SCOPE`): the hit path looks up no module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..signatures import LIST_KINDS, OPT_TENSOR, OPT_TENSORS, OpInfo, SCALAR, SCALARS, TENSOR, TENSORS, VALUE
from . import _fusion
from ._host import NUMBERS, _alias_get, alias, alias_mutated, alias_slow, copy_back_all, copy_back_out, wrap
from ._runtime import FAST, kernel_table, runtime
from ._writes import full_overlap_ok, spans_meet, spans_meet_full, spans_meet_lists, spans_touch

#: The globals every generated kernel shares; each kernel adds its own (`_zDF`, `_zEG`, `_zEXES`, `_zINFO`).
_SCOPE: dict[str, Any] = {
    "_zAG": _alias_get, "_zAS": alias_slow, "_zASM": alias_mutated, "_zAL": alias,
    "_zRT": runtime, "_zW": wrap, "_zN": FAST,
    "_zCB": copy_back_out, "_zCBA": copy_back_all, "_zNUM": NUMBERS, "_zFC": torch._foreach_copy_,
    "_zPENDING": _fusion.PENDING, "_zFLUSH": _fusion.flush, "_zSUBMIT": _fusion.submit,
    "_zQUEUES": _fusion.queues, "_zOUTMETA": _fusion.outmeta, "_zIV": torch._C._increment_version,
    "_zOV": spans_meet, "_zOVF": spans_meet_full, "_zOVL": spans_meet_lists, "_zOVO": spans_touch,
}


def _tensor_key(x: str) -> str:
    return f"({x}.dtype, {x}.shape, {x}.stride())"


#: Argument kinds keyed and fed by expressions of the argument alone (`{n}`, its name): its key item, the
#: list it adds to (`tens`: the executable's tensors, `scal`: its scalars, "": none) and what it adds.
_BY_KIND: dict[str, tuple[str, str, str]] = {
    OPT_TENSOR: (f"(None if {{n}} is None else {_tensor_key('{n}')})",
                 "tens", "*(() if {n} is None else (_zAL({n}),))"),
    OPT_TENSORS: (f"tuple([None if _zt is None else {_tensor_key('_zt')} for _zt in {{n}}])",
                  "tens", "*[_zAL(_zt) for _zt in {n} if _zt is not None]"),
    SCALARS: ("(None if {n} is None else tuple([_zs.__class__ for _zs in {n}]))",
              "scal", "*(() if {n} is None else {n})"),
    VALUE: ("(tuple({n}) if {n}.__class__ is list else {n})", "", ""),
}


@dataclasses.dataclass
class _Parts:
    """What a kernel's arguments contribute to its source: statements and expressions."""

    key_lines: list[str] = dataclasses.field(default_factory=list)    # statements before the key
    alias_lines: list[str] = dataclasses.field(default_factory=list)  # statements taking CPU views
    key_items: list[str] = dataclasses.field(default_factory=list)    # the key tuple's items
    tens: list[str] = dataclasses.field(default_factory=list)         # expressions building the tensor list
    scal: list[str] = dataclasses.field(default_factory=list)         # expressions building the scalar list
    mutated: dict[str, str] = dataclasses.field(default_factory=dict)  # arg name -> expression of its CPU view(s)


def generate(info: OpInfo) -> Callable[..., Any]:
    """Generate the kernel of a compute or mutating op from its schema; it owns a new table of executables
    (`_runtime.kernel_table`). `kernel.__neuron_source__` is its source, `kernel.__neuron_lookup__` the
    function that says which executable a call would use (the native hit path learns from it).

    Every name the generated code introduces starts with `_z` (no schema argument does), so an op's
    arguments (`N`, `key`, `out`, ...) never shadow them."""
    fuse = runtime().fusion is not None  # decided when the kernel is built: flag off, nothing changes
    can_queue = fuse and _fusion.fusible(info)
    # 1. The Python signature, defaults bound from the schema.
    sig, defaults = _signature(info)
    # 2. Each argument's part of the key, the CPU views and the executable's inputs.
    parts = _arg_parts(info)
    # 3. The kernel, then the lookup the native hit path learns its entries from.
    lines = _kernel_lines(info, parts, sig, fuse, can_queue)
    lines += _lookup_lines(parts, sig, can_queue)
    src = "\n".join(lines) + "\n"
    # 4. Compiled with its own globals: the shared ones, its defaults, info and table.
    exes = kernel_table(info)
    scope: dict[str, Any] = {**_SCOPE, "_zDF": defaults, "_zEG": exes.get, "_zEXES": exes, "_zINFO": info}
    exec(compile(src, f"<neuron kernel {info.qualname}>", "exec"), scope)  # noqa: S102 - generated above
    kernel: Callable[..., Any] = scope["kernel"]
    kernel.__neuron_source__ = src  # type: ignore[attr-defined]
    kernel.__neuron_lookup__ = scope["lookup"]  # type: ignore[attr-defined]
    return kernel


def _signature(info: OpInfo) -> tuple[str, list[Any]]:
    """The kernel's parameter list (keyword-only ones after `*`) and its defaults (`_zDF[i]`)."""
    params: list[str] = []
    kwonly: list[str] = []
    defaults: list[Any] = []
    for a in info.args:
        if a.has_default:
            defaults.append(a.default)
            p = f"{a.name}=_zDF[{len(defaults) - 1}]"
        else:
            p = a.name
        (kwonly if a.kwarg_only else params).append(p)
    return ", ".join(params + (["*"] + kwonly if kwonly else [])), defaults


def _arg_parts(info: OpInfo) -> _Parts:
    """Each argument of the functional variant, by its kind: how it is keyed, viewed on the CPU and fed."""
    fnames = {a.name for a in (info.functional or info).args}
    p = _Parts()
    for j, a in enumerate(arg for arg in info.args if arg.name in fnames and not (arg.mutable and arg.kwarg_only)):
        n, k = a.name, a.kind
        if k == TENSOR:
            # A Python number here is a "wrapped number" (`x * 2`): keyed by type, passed as is.
            p.key_lines.append(f"_zk{j} = {n}.__class__ if {n}.__class__ in _zNUM else {_tensor_key(n)}")
            p.alias_lines += [
                f"if _zk{j}.__class__ is type: _zc{j} = {n}",
                "else:",
                f"    _ze = _zAG(id({n}))",
                f"    _zc{j} = _ze[0] if _ze is not None and _ze[2] == _zk{j} and _ze[1] == {n}.data_ptr() "
                f"else {'_zASM' if a.mutable else '_zAS'}({n}, _zk{j})",
            ]
            p.key_items.append(f"_zk{j}")
            p.tens.append(f"_zc{j}")
            p.mutated[n] = f"_zc{j}"
        elif k == TENSORS:
            p.key_items.append(f"tuple([{_tensor_key('_zt')} for _zt in {n}])")
            p.alias_lines.append(f"_zl{j} = [_zAL(_zt) for _zt in {n}]")
            p.tens.append(f"*_zl{j}")
            p.mutated[n] = f"_zl{j}"
        elif k == SCALAR:
            p.key_items.append(f"{n}.__class__")
            p.scal.append(f"*(() if {n} is None else ({n},))" if a.optional else n)
        elif k in _BY_KIND:
            key_item, into, item = _BY_KIND[k]
            p.key_items.append(key_item.format(n=n))
            if into:
                (p.tens if into == "tens" else p.scal).append(item.format(n=n))
        else:  # pragma: no cover - classify() never sends these here
            raise AssertionError(f"{info.qualname}: {n} of kind {k}")
    return p


def _kernel_lines(info: OpInfo, parts: _Parts, sig: str, fuse: bool, can_queue: bool) -> list[str]:
    """The kernel's source lines: 1. the key, cheap: a miss needs nothing else; 2. CPU views; 3. run
    (or queue, with fusion on); 4. outputs."""
    values = "(" + "".join(f"{a.name}, " for a in info.args) + ")"
    key = "(" + "".join(f"{x}, " for x in parts.key_items) + ")"
    call_tensors = "[" + ", ".join(parts.tens) + "]"
    call_scalars = "[" + ", ".join(parts.scal) + "]"
    slow = f"return _zRT().slow_call(_zINFO, {{}}, _zkey, {values})"  # the slow path, the key not learnt
    # 1. The key; a miss goes to the slow path, which learns it.
    lines = [f"def kernel({sig}):"]
    if fuse and not can_queue:
        lines.append(f"    if _zPENDING: _zFLUSH({('op:' + info.qualname)!r})")
    lines += ["    " + b for b in parts.key_lines]
    lines.append(f"    _zkey = {key}")
    lines.append("    _zexe = _zEG(_zkey)")
    lines.append("    if _zexe is None:")
    lines.append(f"        return _zRT().slow_call(_zINFO, _zEXES, _zkey, {values})")
    overlap = _overlap_test(info)
    if overlap:  # a write that may partially overlap an input: the slow path applies CPU's rule
        lines.append(f"    if {overlap}:")
        lines.append(f"        {slow}")
    # 2. CPU views.
    lines += ["    " + b for b in parts.alias_lines]
    ret_line = _return_line(info)
    # 3. Queued, with fusion on; else run.
    if can_queue:
        lines.append(f"    _zT, _zS = {call_tensors}, {call_scalars}")
        if info.kind == "mutating":  # fusible in-place ops update their first argument
            m = parts.mutated[info.mutable[0]]
            lines.append(f"    if _zSUBMIT(_zINFO, _zkey, _zexe, _zT, _zS, {m if m.startswith('_zl') else f'[{m}]'}):")
            lines.append("    " + ret_line)
        else:
            lines.append("    _zr = _zSUBMIT(_zINFO, _zkey, _zexe, _zT, _zS)")
            lines.append("    if _zr is not None:")
            lines.append("        return _zr")
        call_tensors, call_scalars = "_zT", "_zS"
    lines.append("    try:")
    lines.append(f"        _zouts = _zexe({call_tensors}, {call_scalars})")
    lines.append("    except Exception:")
    lines.append(f"        {slow}")
    lines.append("    _zN[0] += 1")
    # 4. Outputs: copied into the mutated arguments, or relabelled to neuron.
    lines += _copy_back_lines(info, parts.mutated, values, slow)
    lines.append(ret_line)
    lists = [a.name for a in info.args if a.mutable and a.kind == TENSORS]
    if lists:
        # The tensors of a written list changed in place: bump their version counters, as CUDA's foreach
        # kernels do (no ADInplaceOrView kernel does it for list ops), before every return.
        bump = f"_zIV({lists[0]})" if len(lists) == 1 else f"_zIV([{', '.join('*' + n for n in lists)}])"
        lines = [ln for line in lines for ln in _bump_before_return(line, bump)]
    return lines


def _return_line(info: OpInfo) -> str:
    """The kernel's last line: a mutating op returns the arguments it returns; the others their outputs,
    relabelled to neuron."""
    if info.kind == "mutating":
        rets = info.returns_args
        return ("    return None" if info.n_returns == 0 else f"    return {rets[0]}" if info.n_returns == 1
                else f"    return ({', '.join(rets)},)")
    if info.returns_list:
        return "    return [_zW(_zo) for _zo in _zouts]"
    if info.n_returns == 1:
        return "    return _zW(_zouts[0])"
    # An output may be undefined (None), e.g. a backward op with a False output_mask entry.
    return "    return tuple([None if _zo is None else _zW(_zo) for _zo in _zouts])"


def _copy_back_lines(info: OpInfo, mutated: dict[str, str], values: str, slow: str) -> list[str]:
    """A mutating op's hit: its functional results (`_zouts`) into the tensors it mutates."""
    if info.kind != "mutating":
        return []
    f = info.functional or info
    if len(info.mutable) == 1 and f.returns_list and mutated.get(info.mutable[0], "").startswith("_zl"):
        # One list mutated, one list returned (`_foreach_add_`): copy into the CPU views taken above.
        # An in-place executable (`compiler._base`) returns [] and has written them already.
        return [f"    if _zouts: _zFC({mutated[info.mutable[0]]}, _zouts)"]
    if any(a.kind in LIST_KINDS for a in info.args if a.name in info.mutable):
        # Lists of tensors mutated (fused optimizers); an in-place executable returns [] instead.
        return [f"    if _zouts: _zCBA(_zINFO, {values}, _zouts)"]
    lines = []
    for i, m in enumerate(info.mutable):
        if m in mutated and mutated[m].startswith("_zc"):
            lines.append(f"    {mutated[m]}.copy_(_zouts[{i}])")
        else:  # out= argument: may need a resize; another dtype than the result's: PyTorch's rules
            lines.append(f"    if {m}.dtype != _zouts[{i}].dtype: {slow}")
            lines.append(f"    _zCB({m}, _zouts[{i}])")
    return lines


def _lookup_lines(parts: _Parts, sig: str, can_queue: bool) -> list[str]:
    """`lookup`: the executable a call would use, or None (the native hit path learns its entries from
    it); with fusion on, also whether fusion still queues this call (then the native kernel hands it over)."""
    key = "(" + "".join(f"{x}, " for x in parts.key_items) + ")"
    lines = ["", f"def lookup({sig}):"] + ["    " + b for b in parts.key_lines]
    if can_queue:
        lines += [f"    _zkey = {key}",
                  "    return (_zEG(_zkey), _zQUEUES(_zINFO, _zkey), _zINFO, _zkey, _zOUTMETA(_zINFO, _zkey))"]
    else:
        lines.append(f"    return _zEG({key})")
    return lines


def _overlap_test(info: OpInfo) -> str:
    """The generated kernel's test whether an argument an op writes may overlap one it reads
    (`_writes.spans_meet`), or "" for an op that writes nothing or reads no tensor. Ops that write several
    arguments in place (fused optimizers) are left to their kernels, as on CPU; several out= tensors
    (`sort.values`) are each tested."""
    if info.kind != "mutating" or not info.mutable:
        return ""
    by_name = {a.name: a for a in info.args}
    written = [by_name[m] for m in info.mutable]
    if len(written) > 1 and not all(w.kwarg_only and w.kind == TENSOR for w in written):
        return ""
    tests = []
    for w in written:
        # An out= tensor, or one a non-pointwise op writes in place: the very same tensor as an input counts.
        one = "_zOVO" if w.kwarg_only else "_zOV" if full_overlap_ok(info) else "_zOVF"
        for a in info.args:
            if a.mutable or a.kind not in (TENSOR, OPT_TENSOR, TENSORS):
                continue
            if w.kind == TENSORS and a.kind == TENSORS:
                tests.append(f"_zOVL({w.name}, {a.name})")
            elif w.kind == TENSORS:
                tests.append(f"any({one}(_zt, {a.name}) for _zt in {w.name})")
            elif a.kind == TENSORS:
                tests.append(f"any({one}({w.name}, _zt) for _zt in {a.name})")
            else:
                tests.append(f"{one}({w.name}, {a.name})")
    return " or ".join(tests)


def _bump_before_return(line: str, bump: str) -> list[str]:
    """A generated kernel's line, with `bump` run before it if it returns (`return X` -> `_zr = X`,
    `bump`, `return _zr`)."""
    body = line.lstrip()
    if not body.startswith("return"):
        assert ": return" not in line, line  # every return of a list-mutating kernel is its own line
        return [line]
    pad = line[:len(line) - len(body)]
    return [f"{pad}_zr = {body.removeprefix('return').strip() or 'None'}", f"{pad}{bump}", f"{pad}return _zr"]
