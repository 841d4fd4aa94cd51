"""Kernels given as source: `kernel(name, source=CPP)` (docs/kernels.md, "The lower-level form").

    @kernel("mylib::axpy", source=CPP)      the typed function gives the schema and, unless `outputs` is
    def axpy(x, y, a: float): ...           given, is the reference body (CPU, fake shapes, the check,
                                            the backward); with `outputs`, CPU runs the source too
      └─ neuron / CPU call  →  signature {"op": "source:mylib::axpy", "source": ..., "inputs": [[dtype, rank]],
                               "outputs": ..., "scalars": n}  →  resolver (every cache tier, signed,
                               manifests, warm)  →  the tier's compile of the source (compiler/_source.py)
      └─ torch.compile      a region boundary (`graphs.call_between`): the graph is split at the call,
                            its partitions compiled, the kernel's own launch in between

The signature holds no sizes: the ABI passes sizes and strides at run time, so one artifact serves every
shape. In a process, each call key (shapes, strides, number arguments) keeps its output shapes (from
the body or `outputs` on meta tensors) and, with a reference body, is checked once against it on CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .._native import GRAPHS, trace_run
from ..aten import alias, flush_fusion
from ..compiler import CompileRefused
from ..graphs import call_between
from ._kernel import (
    Kernel,
    KernelError,
    _backward_kernel,
    _clean,
    _register_neuron,
    _returns_tuple,
)

_NUMBERS = ("float", "int", "bool", "SymInt")


def kernel(name: str, *, mutates_args: Iterable[str] | str = (), source: str | None = None,
           outputs: Callable[..., Any] | None = None, language: str = "c++") -> Callable[[Callable[..., Any]], Kernel]:
    """`neuron_runtime.kernel`: `_kernel.kernel` (a body of torch ops, one executable per call on neuron),
    or with `source` (C++ text, the ABI of docs/kernels.md) a `SourceKernel` running that source, whose
    function is its reference body unless `outputs` gives the outputs' shapes. Returns a `Kernel`."""
    def wrap(fn: Callable[..., Any]) -> Kernel:
        if source is None:
            if outputs is not None:
                raise KernelError(f"kernel {name}: outputs= describes a source kernel's outputs; give source= too")
            return Kernel(name, fn, mutates_args)
        if mutates_args not in ((), []):
            raise KernelError(f"kernel {name}: a source kernel writes only its outputs (no mutates_args)")
        return SourceKernel(name, fn, source, outputs, language)
    return wrap


class SourceKernel(Kernel):
    """A kernel whose neuron implementation is its `source` (C++ over the tensors' data, sizes and
    strides; the ABI is compiler/_source.py's). `outputs(*args)`, if given, returns tensors with the
    outputs' shapes and dtypes (called on meta tensors) and makes the body a declaration only."""

    def __init__(self, name: str, fn: Callable[..., Any], source: str, outputs: Callable[..., Any] | None,
                 language: str = "c++") -> None:
        if "::" not in name:
            raise KernelError(f"kernel {name!r}: name it 'namespace::name' (e.g. 'mylib::{name}')")
        if not isinstance(source, str) or not source.strip():
            raise KernelError(f"kernel {name}: source= takes the kernel's source text")
        self.name, self.fn, self.mutates = name, fn, False
        self.source, self.language, self.reference = source, language, outputs is None
        self.shapes_of = fn if outputs is None else outputs  # without a reference, every device runs the source
        try:
            schema_text = torch.library.infer_schema(fn, mutates_args=())
            self.op = torch.library.custom_op(name, fn if self.reference else self._neuron, mutates_args=(),
                                              schema=schema_text)
        except Exception as e:  # noqa: BLE001 - a missing annotation, an unsupported type, a taken name
            raise KernelError(f"kernel {name}: {e}") from e
        ns, short = name.split("::", 1)
        self.overload = getattr(getattr(torch.ops, ns), short).default
        schema = self.overload._schema
        for a in schema.arguments:
            if str(a.type) != "Tensor" and str(a.type) not in _NUMBERS:
                raise KernelError(f"kernel {name}: argument {a.name} is {a.type}; a source kernel takes "
                                  "tensors and numbers (int, float, bool)")
        for r in schema.returns:
            if str(r.type) != "Tensor":
                raise KernelError(f"kernel {name}: it returns {r.type}; a source kernel returns tensors "
                                  "(one, or a tuple)")
        self.launches: dict[tuple[Any, ...], _SourceLaunch] = {}  # type: ignore[assignment]
        self.runtime: Any = None
        self.lock = threading.Lock()
        self.op.register_fake(self._traceable(self.shapes_of))
        _register_neuron(self.op, self._neuron)
        call_between(self.overload)  # in a torch.compile graph: a region boundary, its own launch
        self.backward: Kernel | None = None
        self.direct, self.saving = self.reference, None
        if self.reference:  # the body's VJP, a kernel of its own (one executable on neuron)
            self.backward = _backward_kernel(self, schema)
            self.op.register_autograd(self._grad, setup_context=self._save)

    def __repr__(self) -> str:
        return f"<neuron_runtime.kernel {self.name} (source)>"

    def _launch(self, args: Sequence[Any], rt: Any) -> Any:
        return _SourceLaunch(self, args, rt)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class _SourceLaunch:
    """One call key: its signature's executable, the outputs' shapes, and the check against the body."""

    autograd = None  # (no graph: autograd records a call through Python's `_Direct`, and never learns)

    def learns(self) -> bool:
        return False

    def __init__(self, k: SourceKernel, args: Sequence[Any], rt: Any) -> None:
        self.k = k
        self.rt = rt
        self.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.scalar_at = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        metas = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                 if isinstance(a, torch.Tensor) else a for a in args]
        got = _clean(lambda: k._traceable(k.shapes_of)(*metas))
        outs = list(got) if isinstance(got, (tuple, list)) else [got]
        self.outputs = [(tuple(o.shape), o.dtype) for o in outs]
        self.returns = _returns_tuple(k)
        self.signature = {
            "op": f"source:{k.name}", "schema": str(k.overload._schema), "args": [], "language": k.language,
            "source": k.source,
            "inputs": [[_dtype_name(args[i].dtype), args[i].dim()] for i in self.tensor_at],
            "outputs": [[_dtype_name(d), len(s)] for s, d in self.outputs],
            "scalars": len(self.scalar_at),
        }
        try:
            self.exe, self.key = rt.resolver.resolve(self.signature, wait=True)
        except CompileRefused as e:
            raise KernelError(str(e) if str(e).startswith(f"kernel {k.name}") else f"kernel {k.name}: {e}") from None
        self.checked = not k.reference
        self.boundary = f"kernel:{k.name}"

    def __call__(self, args: Sequence[Any]) -> Any:
        rt = self.rt
        tensors = [args[i] for i in self.tensor_at]
        device = tensors[0].device if tensors else torch.device("cpu")
        on_neuron = device.type == "neuron"
        if on_neuron:
            flush_fusion(self.boundary)  # the kernel reads its inputs' memory: queued ops run first
        outs = [torch.empty(s, dtype=d, device=device) for s, d in self.outputs]
        views = [alias(t) if t.device.type == "neuron" else t for t in (*tensors, *outs)]
        check = not self.checked
        host = [v.clone() for v in views[: len(tensors)]] if check else None
        trace_run(self.exe, views, [args[i] for i in self.scalar_at], GRAPHS)
        if on_neuron:
            with rt.lock:
                rt.counts["executions"] += 1
        if check:
            self._check(args, host, views[len(tensors):])
        return tuple(outs) if self.returns else outs[0]

    def _check(self, args: Sequence[Any], host: list[torch.Tensor] | None, got: list[torch.Tensor]) -> None:
        """The kernel's outputs against the reference body run on the host copies of the inputs."""
        assert host is not None
        it = iter(host)
        cpu_args = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
        want = _clean(lambda: self.k.fn(*cpu_args))
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        for i, (w, g) in enumerate(zip(want, got)):
            try:
                torch.testing.assert_close(g, w, equal_nan=True)
            except AssertionError as e:
                raise KernelError(f"kernel {self.k.name}: output {i} of its source ({self.key[:12]}) differs "
                                  f"from its reference body on CPU: {str(e).splitlines()[1:3]}; refused") from None
        self.checked = True
