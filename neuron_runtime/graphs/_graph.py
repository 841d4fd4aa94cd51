"""An FX graph of aten ops as a graph signature (docs/compile.md: the key).

`torch.compile(backend="neuron")` hands each graph AOTAutograd produced (forward, backward, or an
inference graph) to `signature(gm)`, which writes it in the fused groups' graph format
(`compiler._reference.build_graph`): its ops in order, each an op signature (overload, schema, every
tensor argument's dtype/sizes/strides, every other argument by value and type), wired to the graph's
inputs (`["e", i]`) or an earlier op's result (`["n", j, k]`). So a graph is keyed, cached, compiled,
explained and shared exactly as an op or a fused group is, and the key is stable across processes and
hosts: it holds no node names, object ids, file paths or hash seeds, only what decides what the graph
computes.

Graph constants (`x * 2.0`, `dim=1`, a dropout p) are what Dynamo specialised on: they are in the key by
value. A graph that cannot be written this way (an op outside aten, a random op, symbolic shapes, a
non-tensor input) raises `GraphRefused` with the reason; the caller runs it op by op.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from ..signatures import (
    GENERATOR,
    LIST_KINDS,
    OPT_TENSOR,
    OPT_TENSORS,
    OTHER,
    OpInfo,
    SignatureError,
    TENSOR,
    VALUE,
    classify,
    encode_value,
    qualname_of,
    tensor_meta,
)

_DEVICE = "neuron"


class GraphRefused(Exception):
    """This graph cannot become one executable; the message says why."""


@dataclasses.dataclass
class GraphPlan:
    """How to call a graph's executable and rebuild the graph's outputs from what it returns.

    `inputs`: the placeholder index feeding each executable input `e{i}`, or -(k + 1) for `constants[k]`,
    a tensor the graph holds as an attribute (`get_attr`: a mask or a scalar the model built in its
    forward), passed to the executable as an input like any other, so its value is never baked into the
    kernel or the key (two graphs that differ only in a constant's value share one executable correctly).
    `outputs`: per graph output, ("x", i) the executable's output i, ("in", p) placeholder p itself,
    ("const", v) a constant (None).
    `on_device`: per executable output, whether it is a neuron tensor (else it stays on CPU).
    Input mutations (`copy_` into a placeholder, an optimizer's parameters and moments): `writes`, the
    placeholders the executable writes in place itself (the signature's `into`, as a fused group's: the
    kernel stores the new values into the input's buffer, no result and no copy), used for every input the
    graph also reads; `copies`, (placeholder, executable output) pairs the caller copies back, for an input
    the graph only writes (an executable input needs a slot that describes it)."""

    signature: dict[str, Any]
    inputs: list[int]
    outputs: list[tuple[str, Any]]
    on_device: list[bool]
    copies: list[tuple[int, int]]
    n_ops: int
    writes: list[int] = dataclasses.field(default_factory=list)
    constants: list[torch.Tensor] = dataclasses.field(default_factory=list)


_INFOS: dict[str, OpInfo] = {}


def _no_dropout(target: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    """An attention kernel tagged as drawing random numbers for its dropout, called with `dropout_p` 0
    (CPU's flash attention, which SDPA picks on neuron as on CPU): it draws none."""
    for i, a in enumerate(target._schema.arguments):
        if a.name == "dropout_p":
            v = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else a.default_value)
            return isinstance(v, (int, float)) and v == 0
    return False


def _info(op: Any) -> OpInfo:
    q = qualname_of(op)
    info = _INFOS.get(q)
    if info is None:
        info = _INFOS[q] = classify(q, special=False)
    return info


def _fake(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _meta(node: torch.fx.Node, what: str) -> dict[str, Any]:
    val = _fake(node)
    if not isinstance(val, torch.Tensor):
        raise GraphRefused(f"{what} is a {type(val).__name__}, not a tensor")
    if not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
        raise GraphRefused(f"{what} has symbolic shape {list(val.shape)} (dynamic shapes are not compiled: "
                           "use torch.compile(..., dynamic=False))")
    if val.layout != torch.strided:
        raise GraphRefused(f"{what} has layout {val.layout}")
    return tensor_meta(val)


def _value(v: Any, where: str) -> Any:
    """A constant argument, keyed by value; the device is host memory whatever the graph says."""
    if isinstance(v, torch.device) and v.type in (_DEVICE, "cpu"):
        return {"device": "cpu"}
    if isinstance(v, torch.fx.Node):
        raise GraphRefused(f"{where} is computed in the graph ({v.target}), not a tensor")
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in v):
        raise GraphRefused(f"{where} holds values computed in the graph")
    try:
        return encode_value(v)
    except SignatureError as e:
        raise GraphRefused(f"{where}: {e}") from None


def signature(gm: torch.fx.GraphModule, kind: str) -> GraphPlan:
    """The graph signature of an AOTAutograd graph `gm` and how to call its executable (see GraphPlan)."""
    # 1. Walk the nodes: placeholders and constants become the executable's inputs, ops its nodes.
    w = _Walk(gm)
    for node in gm.graph.nodes:
        w.visit(node)
    # 2. The graph's outputs, then its input mutations (both may add executable outputs, in this order).
    outputs = w.outputs()
    plan_copies, writes, into = w.mutations()
    sig: dict[str, Any] = {"op": f"graph:{kind}", "graph": w.nodes, "outputs": w.results}
    if into:
        sig["into"] = into
    return GraphPlan(sig, w.ext_order, outputs, w.on_device, plan_copies, len(w.nodes), writes, w.constants)


class _Walk:
    """One walk over an AOTAutograd graph, collecting what `signature` returns."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.placeholders: dict[torch.fx.Node, int] = {}
        self.ext: dict[int, int] = {}       # placeholder index -> executable input index
        self.ext_order: list[int] = []
        self.produced: dict[torch.fx.Node, tuple[int, int]] = {}  # node -> (op index, output index)
        self.nodes: list[dict[str, Any]] = []
        self.copies: list[tuple[int, torch.fx.Node]] = []
        self.written: dict[torch.fx.Node, int] = {}  # a `copy_` into a placeholder -> that placeholder
        self.constants: list[torch.Tensor] = []
        self.const_index: dict[torch.fx.Node, int] = {}  # a get_attr tensor -> -(its index in `constants` + 1)
        self.out_node: torch.fx.Node | None = None
        self.results: list[Any] = []
        self.result_index: dict[tuple[int, int], int] = {}
        self.on_device: list[bool] = []

    def wire(self, v: torch.fx.Node, where: str) -> tuple[list[Any], dict[str, Any]]:
        """Where an op's tensor input comes from (`["e", input]` or `["n", node(, output)]`) and its metadata."""
        if v in self.placeholders or v in self.const_index:
            p = self.placeholders[v] if v in self.placeholders else self.const_index[v]
            if p not in self.ext:
                self.ext[p] = len(self.ext_order)
                self.ext_order.append(p)
            if p < 0:  # a constant: described by the tensor itself (get_attr nodes may carry no fake value)
                return ["e", self.ext[p]], tensor_meta(self.constants[-1 - p])
            return ["e", self.ext[p]], _meta(v, where)
        if v in self.produced:
            j, k = self.produced[v]
            return (["n", j] if k == 0 else ["n", j, k]), _meta(v, where)
        raise GraphRefused(f"{where} comes from {v.op} {v.target}, which is not compiled")

    def visit(self, node: torch.fx.Node) -> None:
        if node.op == "placeholder":
            self.placeholders[node] = len(self.placeholders)
            return
        if node.op == "output":
            self.out_node = node
            return
        if node.op == "get_attr":
            value: Any = self.gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
                raise GraphRefused(f"node {node.name} is a get_attr of a {type(value).__name__}")
            self.constants.append(value)
            self.const_index[node] = -len(self.constants)
            return
        if node.op != "call_function":
            raise GraphRefused(f"node {node.name} is a {node.op} ({node.target})")
        target = node.target
        if target is operator.getitem:
            src, k = node.args
            if src not in self.produced or self.produced[src][1] != 0 or not isinstance(k, int):
                raise GraphRefused(f"getitem of {src} is not of an op's outputs")
            self.produced[node] = (self.produced[src][0], k)
            return
        if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
            raise GraphRefused(f"{target} is not an aten op")
        if torch.Tag.nondeterministic_seeded in target.tags and not _no_dropout(target, node):
            raise GraphRefused(f"{target} draws random numbers: run op by op, the CPU generator gives the "
                               "same values as eager neuron")
        if target is torch.ops.aten.copy_.default and node.args[0] in self.placeholders:
            # An input mutation AOTAutograd kept in the graph: the executable returns the new value,
            # the caller writes it into the input (as eager would, in place).
            self.copies.append((self.placeholders[node.args[0]], node.args[1]))
            self.written[node] = self.placeholders[node.args[0]]  # `copy_` returns its input: `s.add_(x)` returns s
            return
        info = _info(target)
        if info.kind == "mutating" or any(a.mutable for a in info.args):
            raise GraphRefused(f"{info.qualname} mutates its inputs inside the graph")
        args, wiring = self.op_args(info, node)
        self.produced[node] = (len(self.nodes), 0)
        self.nodes.append({"sig": {"op": info.qualname, "schema": str(target._schema), "args": args}, "in": wiring})

    def op_args(self, info: OpInfo, node: torch.fx.Node) -> tuple[list[list[Any]], list[list[Any]]]:
        """An op node's arguments as a signature's (`[name, kind, description]`) and its tensors' wiring."""
        args: list[list[Any]] = []
        wiring: list[list[Any]] = []
        for i, (a, sa) in enumerate(zip(info.args, node.target._schema.arguments)):  # type: ignore[union-attr]
            if i < len(node.args):
                v = node.args[i]
            elif a.name in node.kwargs:
                v = node.kwargs[a.name]
            else:
                v = sa.default_value if sa.has_default_value() else None
            where = f"{info.qualname} argument {a.name}"
            if a.kind in (TENSOR, OPT_TENSOR) and isinstance(v, torch.fx.Node):
                w, d = self.wire(v, where)
                wiring.append(w)
                args.append([a.name, a.kind, d])
            elif a.kind in LIST_KINDS and isinstance(v, (list, tuple)):
                descs: list[Any] = []
                for x in v:
                    if x is None and a.kind == OPT_TENSORS:
                        descs.append(None)
                    elif isinstance(x, torch.fx.Node):
                        w, d = self.wire(x, where)
                        wiring.append(w)
                        descs.append(d)
                    else:
                        raise GraphRefused(f"{where} holds {type(x).__name__}")
                args.append([a.name, a.kind, descs])
            elif a.kind == OPT_TENSOR and v is None:
                args.append([a.name, a.kind, None])
            elif a.kind in (GENERATOR, OTHER):
                if v is not None:
                    raise GraphRefused(f"{where} is a {type(v).__name__}")
                args.append([a.name, VALUE, None])
            else:  # Scalars, structural values, a number in a Tensor slot: specialised, keyed by value
                args.append([a.name, VALUE, _value(v, where)])
        return args, wiring

    def result(self, v: torch.fx.Node) -> int:
        """The executable's output index of node output `v` (made one the first time it is asked for)."""
        j, k = self.produced[v]
        if (j, k) not in self.result_index:
            self.result_index[(j, k)] = len(self.results)
            self.results.append(j if k == 0 else [j, k])
            val = _fake(v)
            _meta(v, f"output {v.name}")
            self.on_device.append(val.device.type == _DEVICE)
        return self.result_index[(j, k)]

    def outputs(self) -> list[tuple[str, Any]]:
        """The graph's outputs: a constant None, an input returned as it is, or an executable output."""
        assert self.out_node is not None, "an FX graph ends in its output node"
        outputs: list[tuple[str, Any]] = []
        for v in self.out_node.args[0]:  # type: ignore[union-attr]
            if v is None:
                outputs.append(("const", None))
            elif isinstance(v, torch.fx.Node) and v in self.placeholders:
                outputs.append(("in", self.placeholders[v]))
            elif isinstance(v, torch.fx.Node) and v in self.written:
                outputs.append(("in", self.written[v]))
            elif isinstance(v, torch.fx.Node) and v in self.produced:
                outputs.append(("x", self.result(v)))
            else:
                raise GraphRefused(f"graph output {v} is not a tensor the graph computes")
        return outputs

    def mutations(self) -> tuple[list[tuple[int, int]], list[int], list[list[Any]]]:
        """Input mutations: (copies the caller makes from outputs, inputs the executable writes, and the
        signature's `into` for those)."""
        plan_copies: list[tuple[int, int]] = []
        writes: list[int] = []
        into: list[list[Any]] = []
        for p, src in self.copies:
            if src in self.placeholders:
                raise GraphRefused("an input is overwritten by another input")
            if src not in self.produced:
                raise GraphRefused(f"input {p} is overwritten by {src}, which is not compiled")
            if p in self.ext:  # read by the graph too: written in place by the executable
                j, k = self.produced[src]
                into.append([j if k == 0 else [j, k], self.ext[p]])
                writes.append(p)
            else:
                plan_copies.append((p, self.result(src)))
        return plan_copies, writes, into
