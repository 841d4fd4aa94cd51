"""The `reference` tier: no compiler. The artifact is a JSON op descriptor (never pickle) that runs the
aten op eagerly on host memory. It exercises every path of the runtime (keys, caches, envelopes) in
milliseconds, which is what the bulk of the test suite runs on."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from typing import Any

import torch

from ..signatures import (
    LIST_KINDS,
    OPT_TENSOR,
    SCALAR,
    SCALARS,
    TENSOR,
    VALUE,
    bind_symbols,
    canonical,
    decode_value,
    graph_has_symbols,
    has_nodes,
    has_symbols,
    is_wrapped,
    resolve_op,
    scalar_overload,
    tensors_in,
)
from . import _source
from ._base import CompileRefused, Compiler, Executable


def resolve(qualname: str) -> Any:
    """The aten op `qualname` names (`signatures.resolve_op`); one this torch lacks is a refusal."""
    try:
        return resolve_op(qualname)
    except AttributeError as e:
        raise CompileRefused(f"unknown op {qualname}") from e


def build_call(signature: dict[str, Any], op: Any, wrapped_as_tensors: bool = False) -> Executable:
    """A function (tensors, scalars) -> list of outputs that calls `op` with the signature's arguments.

    Generated as Python source once per executable, so a call costs one op call, not a walk of the
    signature. Wrapped numbers (`x % 4` from C++) arrive in their Tensor slots as Python numbers, which
    only the overload taking a Scalar there accepts; `wrapped_as_tensors`: the caller passes 0-d tensors
    there instead (the aoti tier's graph inputs), so `op` itself is called. A graph class's size
    argument that is a symbol (`signatures.bind_symbols`) is computed from `E`, the symbols' sizes, which
    `run(T, S, E)` then takes (`build_graph` passes them)."""
    if not wrapped_as_tensors:
        op = scalar_overload(op, {name for name, kind, desc in signature["args"]
                                       if kind == TENSOR and is_wrapped(desc)})
    consts: list[Any] = []
    pos: list[str] = []
    kw: list[str] = []
    taken = {"T": 0, "S": 0}  # how many tensors (T) and run-time scalars (S) the arguments so far took

    def take(seq: str, present: bool = True, n: int | None = None) -> str:
        """The next item of `seq` (`n`: the next n, as a slice), or "None" for an absent argument: an
        absent optional keeps its place in the call (and in a list), but takes no input."""
        if not present:
            return "None"
        i = taken[seq]
        taken[seq] += 1 if n is None else n
        return f"{seq}[{i}]" if n is None else f"{seq}[{i}:{i + n}]"

    schema_args = {a.name: a for a in op._schema.arguments}
    for name, kind, desc in signature["args"]:
        if kind == TENSOR:
            expr = take("T")
        elif kind == OPT_TENSOR:
            expr = take("T", desc is not None)
        elif kind in LIST_KINDS:
            expr = "[" + ", ".join(take("T", d is not None) for d in desc) + "]"
        elif kind == SCALAR:
            expr = take("S", desc is not None)
        elif kind == SCALARS:
            expr = take("S", desc is not None, n=len(desc) if desc is not None else 0)
        elif kind == VALUE and has_symbols(desc):
            consts.append(desc)
            expr = f"decode(bind(C[{len(consts) - 1}], E))"
        elif kind == VALUE:
            consts.append(decode_value(desc))
            expr = f"C[{len(consts) - 1}]"
        else:
            raise CompileRefused(f"{signature['op']}: cannot pass argument {name} ({kind})")
        a = schema_args.get(name)
        if a is None:
            raise CompileRefused(f"{signature['op']}: schema has no argument {name}")
        (kw if a.kwarg_only else pos).append(expr if not a.kwarg_only else f"{name}={expr}")
    n_ret = len(op._schema.returns)
    ret_list = [str(r.type) for r in op._schema.returns] == ["List[Tensor]"]
    call = f"OP({', '.join(pos + kw)})"
    if signature.get("writes"):  # in place (`compiler._base`): the op writes into its arguments' memory
        body = f"{call}\n    return []"
    elif ret_list:
        body = f"return {call}"
    elif n_ret == 1:
        body = f"return [{call}]"
    else:
        body = f"return list({call})"
    src = f"def run(T, S, E=None):\n    {body}\n"
    # The OpOverload's underlying builtin: one Python frame less per call.
    scope: dict[str, Any] = {"OP": getattr(op, "_op", op), "C": consts, "bind": bind_symbols, "decode": decode_value}
    exec(compile(src, f"<reference {signature['op']}>", "exec"), scope)  # noqa: S102 - our own generated source
    run: Executable = scope["run"]
    return run


class ReferenceCompiler(Compiler):
    name = "reference"
    format_version = 1
    writes_inputs = True  # an in-place signature runs the in-place aten op on the CPU views themselves

    def fingerprint(self) -> dict[str, Any]:
        return {"tier": self.name, "format": self.format_version, "torch": torch.__version__,
                "machine": platform.machine()}

    def compile(self, signature: dict[str, Any]) -> bytes:
        if _source.is_source(signature):  # kernel source: the host compiler, for the machine's baseline
            return _source.compile_source(signature, self.fingerprint(), [])
        if has_nodes(signature):
            build_graph(signature)
        else:
            build_call(signature, resolve(signature["op"]))  # refuse now, not at load time
        return canonical({"format": "reference-v1", "signature": signature})

    def payload_signature(self, payload: bytes) -> dict[str, Any] | None:
        if _source.is_artifact(payload):
            return _source.read_meta(payload).get("signature")
        desc = json.loads(payload)
        if not isinstance(desc, dict) or desc.get("format") != "reference-v1":
            raise ValueError("not a reference-v1 descriptor")
        sig = desc.get("signature")
        return sig if isinstance(sig, dict) else None

    def load(self, payload: bytes) -> Executable:
        if _source.is_artifact(payload):
            return _source.load(payload, self.fingerprint())
        desc = json.loads(payload)
        if desc.get("format") != "reference-v1":
            raise CompileRefused(f"not a reference-v1 descriptor: {desc.get('format')!r}")
        sig = desc["signature"]
        if has_nodes(sig):
            return build_graph(sig)
        return aten_executable(sig)


def aten_executable(sig: dict[str, Any]) -> Executable:
    """The executable that is the signature's aten op itself, on host memory (shape classes included:
    the op serves any shape). The native hit path calls the op directly (`__neuron_aten__`)."""
    run = build_call(sig, resolve(sig["op"]))
    run.__neuron_aten__ = sig["op"]  # type: ignore[attr-defined]
    if sig.get("writes"):
        run.__neuron_inplace__ = True  # type: ignore[attr-defined]
    return run


def build_graph(signature: dict[str, Any], wrapped_as_tensors: bool = False,
                choose: Callable[[dict[str, Any], Any], Any] | None = None) -> Executable:
    """A fused group (see `neuron_runtime.aten._fusion`): its ops in order, each reading the group's inputs
    (`["e", i]`) or an earlier op's result (`["n", j]`: its output 0, `["n", j, k]`: its output k, an
    element of a `_foreach_` op's list); returns the results listed in `outputs` (`j` or `[j, k]`), and
    writes those listed in `into` (`[result, i]`) into input `i` in place. Intermediates pass from op to
    op without being copied anywhere. `wrapped_as_tensors`: see build_call;
    `choose(node signature, op)`: what to call for a node instead of its op (a compiler's stand-in)."""
    steps = []
    symbolic = graph_has_symbols(signature)
    where: dict[str, tuple[int, int]] = {}  # a graph class's symbols: (input, dim) of a size each one is
    for node in signature["graph"]:
        op = resolve(node["sig"]["op"])
        call = build_call(node["sig"], choose(node["sig"], op) if choose else op, wrapped_as_tensors)
        wiring = [(w[0] == "n", int(w[1]), int(w[2]) if len(w) > 2 else 0) for w in node["in"]]
        n_scalars = sum(1 if kind == SCALAR and desc is not None else
                        len(desc) if kind == SCALARS and desc is not None else 0
                        for _, kind, desc in node["sig"]["args"])
        steps.append((call, wiring, n_scalars))
        if not symbolic:
            continue
        slots = [d for _, kind, desc in node["sig"]["args"] for d in tensors_in(kind, desc)]
        for (internal, i, _), d in zip(wiring, slots):
            for dim, n in enumerate(d.get("sizes", ()) if not internal and isinstance(d, dict) else ()):
                if isinstance(n, str):
                    where.setdefault(n, (i, dim))

    def result(o: Any) -> tuple[int, int]:
        return (int(o), 0) if isinstance(o, int) else (int(o[0]), int(o[1]))

    outputs = [result(o) for o in signature["outputs"]]
    into = [(result(o), int(i)) for o, i in signature.get("into", [])]

    def run(T: Any, S: Any) -> list[Any]:
        results: list[Any] = []
        si = 0
        env = {s: T[i].shape[dim] for s, (i, dim) in where.items()} if where else None
        for call, wiring, n_scalars in steps:
            ins = [results[i][k] if internal else T[i] for internal, i, k in wiring]
            results.append(call(ins, S[si:si + n_scalars], env))
            si += n_scalars
        for (j, k), i in into:
            T[i].copy_(results[j][k])
        return [results[j][k] for j, k in outputs]

    return run
