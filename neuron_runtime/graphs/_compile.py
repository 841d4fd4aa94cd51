"""`torch.compile(backend="neuron")`: each captured graph becomes one cached executable (docs/compile.md).

    Dynamo captures a graph (graph breaks run the rest in eager neuron, as usual)
      └─ AOTAutograd: forward and backward (or inference) graphs of aten ops, functionalized
           └─ per graph: `_graph.signature` → a graph signature, keyed like any op
                └─ `Resolver.resolve` (memory → local → fleet store → compile): one AOTInductor package
                   of the whole graph, through the same cache, envelopes, single-flight and CLI as ops

A call runs the executable on host memory (CPU views of the neuron inputs) and relabels its outputs.
Until the executable is in (background mode, `TORCH_NEURONX_COMPILE_MODE`), and for good when the
compiler refuses the graph, the graph runs op by op in eager neuron (one warning for a refusal;
`TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1` makes it an error).

Registered through the `torch_dynamo_backends` entry point, so `backend="neuron"` needs no import.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._native import GRAPHS, NATIVE, trace_run
from ..aten import alias, runtime, wrap
from . import _graph, _split

log = logging.getLogger(__name__)

_MODES = (None, "default")
_lock = threading.Lock()
#: Non-aten ops AOTAutograd writes as aten ops (`neuron_runtime.kernel`s and their backwards register here
#: through `decompose`), so a graph that calls one stays one executable instead of being refused.
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}


def decompose(op: Any, fn: Callable[..., Any]) -> None:
    """Trace `op` as `fn` (a function of aten ops) in every graph compiled from now on."""
    DECOMPOSITIONS[op] = fn


class GraphCompileError(RuntimeError):
    """A graph the compiler refused while TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1."""


def _bump(name: str, n: int = 1) -> None:
    """Count in the current runtime's `graph_counts` (`stats()["graphs"]`)."""
    counts = runtime().graph_counts  # (not `_runtime()`: one call less on every graph run)
    with _lock:
        counts[name] += n


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
            options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The Dynamo backend: AOTAutograd with a compiler that turns each graph into one executable."""
    if mode not in _MODES:
        raise ValueError(f"torch.compile(backend='neuron', mode={mode!r}): only mode='default' is supported "
                         "(each graph is one AOTInductor executable; there is no autotuning or CUDA graphs)")
    if options:
        raise ValueError(f"torch.compile(backend='neuron', options={sorted(options)}): the neuron backend takes "
                         "no options (the compiler is chosen by TORCH_NEURONX_COMPILER)")
    if any(_symbolic(v) for v in example_inputs):
        return _Specialised(gm)
    return _aot(gm, example_inputs)


def _aot(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd

    # keep_inference_input_mutations: an inference graph (an optimizer step) keeps its input mutations as
    # `copy_` nodes, which its executable performs in place (`GraphPlan.writes`); without it AOTAutograd
    # copies each updated parameter and moment back itself, one neuron op per tensor after every call.
    return aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
                        inference_compiler=_compiler("inference"),
                        keep_inference_input_mutations=True,
                        decompositions=dict(DECOMPOSITIONS))(gm, example_inputs)


def _symbolic(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return not all(isinstance(d, int) for d in (*v.shape, *v.stride()))
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


class _Specialised:
    """A graph Dynamo made dynamic (`dynamic=True`, or automatically after a shape changed): each
    executable is compiled for static shapes, so each call's concrete shapes, strides and size values get
    a graph of their own, traced through AOTAutograd on first sight (docs/compile.md: dynamic shapes)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.by_shape: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.stride(), a.dtype, a.device.type, a.requires_grad)
                    if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args)
        fn = self.by_shape.get(key)
        if fn is None:
            try:
                fn = _aot(self.gm, list(args))
            except Exception as e:  # noqa: BLE001 - e.g. a float Dynamo made an input, read with .item()
                if not _runtime().cfg.graph_fallback:
                    raise GraphCompileError(f"neuron: a dynamic torch.compile graph cannot be specialised "
                                            f"({type(e).__name__}: {str(e)[:200]}) and "
                                            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1") from e
                warnings.warn(f"neuron: a dynamic torch.compile graph cannot be specialised to static shapes "
                              f"({type(e).__name__}); it runs op by op (compile with dynamic=False)",
                              UserWarning, stacklevel=2)
                _bump("graphs_refused")
                fn = self.gm
            self.by_shape[key] = fn
        return fn(*args)


def _runtime() -> Any:
    """The current runtime (a test or `neuron_runtime.reset()` may have replaced the one a graph met first)."""
    return runtime()


def _compiler(kind: str) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        parent = _split.split(gm, lambda part: _partition(part, kind))
        return CompiledGraph(gm, kind) if parent is None else SplitGraph(parent)
    return compile_graph


def _partition(part: _split.Partition, kind: str) -> Callable[..., Any]:
    """What a split graph's parent calls for `part`: its `CompiledGraph`, or its own code."""
    if not part.compiled:
        gm = part.gm

        def as_is(*args: Any) -> Any:
            return gm.forward(*args)
        return as_is
    graph, single = CompiledGraph(part.gm, kind), part.single

    def partition(*args: Any) -> Any:
        out = graph(list(args))
        return out[0] if single else tuple(out)
    return partition


class SplitGraph:
    """A graph split at the ops no executable can hold (`_split`): its partitions' executables and those
    ops' own launches, in order. Called as a `CompiledGraph` is (boxed)."""

    def __init__(self, parent: torch.fx.GraphModule) -> None:
        self._boxed_call = True
        self.parent = parent

    def __call__(self, args: list[Any]) -> Any:
        out = self.parent.forward(*args)
        args.clear()
        return list(out)


class CompiledGraph:
    """One AOTAutograd graph: called with the list of its inputs (a boxed call, which lets it free them
    early), returns the list of its outputs."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str) -> None:
        self._boxed_call = True  # an instance attribute: Dynamo's wrappers copy `__dict__`
        self.gm = gm
        self.kind = kind
        self.exe: Any = None
        self.native: Any = None  # the executable behind the native runner (NATIVE.GraphRunner)
        self.refused: str | None = None
        self.plan: _graph.GraphPlan | None = None
        self.key = ""
        try:
            self.plan = _graph.signature(gm, kind)
        except _graph.GraphRefused as e:
            self._refuse(str(e))
            return
        if self.plan.n_ops == 0:  # nothing to compute: outputs are inputs or constants
            return
        self.key = _runtime().resolver.key(self.plan.signature)
        _bump("graphs")
        self._resolve()

    def _refuse(self, why: str) -> None:
        self.refused = why
        _bump("graphs_refused")
        msg = f"neuron: a torch.compile {self.kind} graph cannot be compiled ({why}); it runs op by op"
        if not _runtime().cfg.graph_fallback:
            raise GraphCompileError(msg.replace("; it runs op by op", "") +
                                    " and TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1 forbids running it op by op")
        warnings.warn(msg, UserWarning, stacklevel=3)

    def _resolve(self) -> None:
        from ..compiler import CompileRefused

        assert self.plan is not None
        try:
            self.exe, _ = _runtime().resolver.resolve(self.plan.signature)
        except CompileRefused as e:
            self._refuse(str(e))
        else:
            if self.exe is not None:
                log.info("graph %s %s: executable %s (%d ops)", self.kind, self.key[:12], "ready",
                         self.plan.n_ops)
                self.native = _native_runner(self.exe, self.plan)

    def __call__(self, args: list[Any]) -> Any:
        plan = self.plan
        if plan is None or self.refused is not None:
            return self._eager(args)
        if plan.n_ops == 0:
            out = [args[v] if how == "in" else v for how, v in plan.outputs]
            args.clear()
            return out
        native = self.native
        if native is not None:
            out = native(args)
            if out is not None:
                _bump("graph_executions")
                return out
        if self.exe is None:
            self._resolve()
            if self.exe is None:
                return self._eager(args)
        return self._run(plan, args)

    def ran_natively(self) -> None:
        """Count a call of `native` a caller made itself (a kernel's launch, kernels/_kernel.py)."""
        _bump("graph_executions")

    def _eager(self, args: list[Any]) -> Any:
        _bump("graph_eager_runs")
        out = self.gm(*args)
        args.clear()
        return out

    def _run(self, plan: _graph.GraphPlan, args: list[Any]) -> list[Any]:
        consts = plan.constants
        ins = [alias(t) if t.device.type == "neuron" else t
               for t in (args[p] if p >= 0 else consts[-1 - p] for p in plan.inputs)]
        outs = trace_run(self.exe, ins, (), GRAPHS)
        # Input mutations (an optimizer's parameters and moments): the executable wrote those the graph
        # reads (`plan.writes`); the others are copied on the host, into the inputs' CPU views. Version
        # counters are bumped as the in-place op would have.
        for p in plan.writes:
            _bump_version(args[p])
        for p, i in plan.copies:
            t = args[p]
            if t.device.type == "neuron":
                alias(t).copy_(outs[i])
                _bump_version(t)
            else:
                t.copy_(outs[i])
        _bump("graph_executions")
        on_device = plan.on_device
        made: dict[int, Any] = {}  # a result returned twice is one tensor, as in the graph
        out = []
        for how, v in plan.outputs:
            if how == "x":
                o = made.get(v)
                if o is None:
                    o = made[v] = wrap(outs[v]) if on_device[v] else outs[v]
                out.append(o)
            else:
                out.append(args[v] if how == "in" else v)
        args.clear()
        return out


_bump_version = torch.autograd.graph.increment_version
_OUTPUT_KINDS = {"x": 0, "in": 1, "const": 2}


def _native_runner(exe: Any, plan: _graph.GraphPlan) -> Any:
    """`_run` in C++ (one call: CPU views in, relabelled results out), or None without the native layer."""
    if NATIVE is None:
        return None
    outputs = [(_OUTPUT_KINDS[how], v if how != "const" else 0) for how, v in plan.outputs]
    return NATIVE.GraphRunner(exe, plan.inputs, plan.copies, plan.writes, outputs, plan.on_device,
                                       plan.constants)

