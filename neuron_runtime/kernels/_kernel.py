"""`neuron_runtime.kernel`: a typed Python function of torch ops as a PyTorch operator that runs on
`neuron` as ONE cached executable (docs/kernels.md).

    @kernel("mylib::swiglu")              torch.library.custom_op: schema from the annotations
      ├─ fake (meta) implementation       the body itself, on fake tensors
      ├─ CPU (and every other device)     the body itself
      ├─ neuron                           the body traced (make_fx) into an aten graph for the call's shapes
      │                                   → `graphs.CompiledGraph` → a graph signature `graph:kernel:<name>`,
      │                                     resolved like any signature (shape classes, every cache tier,
      │                                     envelopes and signing, job manifests, `neuron-cache warm`)
      ├─ autograd                         `<name>_backward`, itself such a kernel: the body's VJP, traced
      │                                   the same way (one executable on neuron); a user's own
      │                                   `register_autograd` replaces it
      └─ torch.compile(backend="neuron")  Dynamo keeps the op as one node; AOTAutograd writes it (and its
                                          backward) as its aten ops (`graphs.decompose`), so the graph
                                          around it stays one executable

A kernel is a graph signature with a name: no second compile path exists. The first neuron call of each
key in a process compares the executable's outputs with the body run on CPU copies of the inputs; a kernel
whose executable differs from its own body is refused (`KernelError`) before its result is used.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .._native import NATIVE
from ..aten import alias, flush_fusion, runtime
from ..graphs import CompiledGraph, decompose

log = logging.getLogger(__name__)

_DEVICE = "neuron"


class KernelError(RuntimeError):
    """A kernel that cannot be defined, traced or compiled, or whose executable differs from its body.
    The message names the kernel (and, for an error in the body, the file and line)."""


def kernel(name: str, *, mutates_args: Iterable[str] | str = ()) -> Callable[[Callable[..., Any]], Kernel]:
    """Decorate a typed function of torch ops: it becomes `torch.ops.<ns>.<name>` (see the module
    docstring). `name` is "namespace::name"; `mutates_args` as in `torch.library.custom_op` (kernels that
    mutate their inputs run their body op by op on neuron: an executable of a graph returns fresh tensors).
    Returns a `Kernel`, called like the function."""
    def wrap(fn: Callable[..., Any]) -> Kernel:
        return Kernel(name, fn, mutates_args)
    return wrap


class Kernel:
    """One kernel: `self(*args)` calls the operator (`self.op`, the `torch.library.CustomOpDef`).
    `register_autograd(backward, setup_context=...)` replaces the backward made from the body."""

    hot: Any = None  # the `_Launch.autograd` of the last call `__call__` made with it

    def __init__(self, name: str, fn: Callable[..., Any], mutates_args: Iterable[str] | str = ()) -> None:
        if "::" not in name:
            raise KernelError(f"kernel {name!r}: name it 'namespace::name' (e.g. 'mylib::{name}')")
        self.name = name
        self.fn = fn
        self.mutates = mutates_args != () and mutates_args != []
        try:
            self.op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        except Exception as e:  # noqa: BLE001 - a missing annotation, an unsupported type, a taken name
            raise KernelError(f"kernel {name}: {e}") from e
        ns, short = name.split("::", 1)
        self.overload: torch._ops.OpOverload = getattr(getattr(torch.ops, ns), short).default
        schema = self.overload._schema
        for a in schema.arguments:
            if str(a.type) in ("List[Tensor]", "List[Optional[Tensor]]"):
                raise KernelError(f"kernel {name}: argument {a.name} is a list of tensors; pass the tensors "
                                  "one by one (a kernel's tensors are its executable's inputs)")
        self.launches: dict[tuple[Any, ...], _Launch] = {}
        self.runtime: Any = None  # the runtime `launches` were made with
        self.lock = threading.Lock()
        self.op.register_fake(self._traceable(fn))
        _register_neuron(self.op, self._neuron)
        decompose(self.overload, fn)
        self.backward: Kernel | None = None
        # A plain eager call's autograd.Function of the kernel's own (`saving_backward`), else `_Direct`.
        self.saving: Callable[..., Any] | None = None
        # `_Direct` (an autograd.Function) returns a tensor or a tuple of them, not a list.
        self.direct = not self.mutates and str(schema.returns[0].type) != "List[Tensor]" if schema.returns else False
        if not self.mutates:
            self.backward = _backward_kernel(self, schema)
            self.op.register_autograd(self._grad, setup_context=self._save)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The operator. A plain eager call on neuron tensors (no tracing, no mode, no profiler, no
        keyword arguments) goes straight to the executable: the same launch and backward as the
        dispatcher's route, without torch.library's Python layers around it, its key derived once; a call
        autograd records with the arguments of the last such call is one C++ call (`hot`)."""
        if not kwargs and self.direct:
            hot = self.hot
            if hot is not None and not _compiling():  # (Dynamo first: it cannot trace a C++ call)
                out = hot.try_call(*args)
                if out is not None:
                    return out
            how, key = _plain(args)
            if how == 2:
                saving = self.saving
                # (with saving_backward, the forward kernel takes these arguments: the same key)
                launch = (self if saving is None else saving[0])._find(key, args)
                native = launch.autograd
                if native is not None:
                    out = native(*launch.flat(args))
                    if out is not None:
                        self.hot = native
                        return out
                return (_direct if saving is None else _saving)(self, launch, *args)
            if how == 1:
                return self._find(key, args)(args)
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<neuron_runtime.kernel {self.name}>"

    def register_autograd(self, backward: Callable[..., Any], *,
                          setup_context: Callable[..., Any] | None = None) -> None:
        """A backward of the user's own (torch.library's contract), instead of the body's VJP."""
        self.direct = False  # the user's backward is registered with the operator only
        self.op.register_autograd(backward, setup_context=setup_context)

    def saving_backward(self, forward: Kernel, backward: Kernel) -> None:
        """A plain eager call that records autograd runs `forward` and `backward` instead of this kernel
        and its body's VJP, so the backward does not recompute what the forward knew. `forward` takes
        this kernel's arguments (all tensors) and returns its outputs, then the tensors the backward
        needs; `backward` takes the outputs' gradients, the arguments and those tensors, and returns the
        arguments' gradients. Both must compute what the body computes; the dispatcher's route
        (profiler, modes, torch.compile) keeps the body's VJP."""
        schema = self.overload._schema
        if any(str(a.type) != "Tensor" for a in schema.arguments):
            raise KernelError(f"kernel {self.name}: saving_backward takes a kernel of tensors only")
        self.saving = (forward, backward, len(schema.returns))

    # -- neuron -----------------------------------------------------------------------------------
    def _neuron(self, *args: Any) -> Any:
        """The neuron implementation: the executable of this call's graph (traced on first sight of its
        shapes, dtypes, strides and constant arguments)."""
        return self._find(_call_key(args), args)(args)

    def _find(self, key: tuple[Any, ...], args: Sequence[Any]) -> Any:
        """The launch of `key` (`_call_key(args)`), made on its first call."""
        rt = runtime()
        if rt is not self.runtime:  # `neuron_runtime.reset()`: another compiler, cache and counters
            with self.lock:
                self.launches, self.runtime = {}, rt
        launch = self.launches.get(key)
        if launch is None:
            with self.lock:
                launch = self.launches.get(key)
                if launch is None:
                    launch = self.launches[key] = self._launch(args, rt)
        return launch

    def _launch(self, args: Sequence[Any], rt: Any) -> Any:
        """What runs this call's shapes on neuron (made once per key): the body's traced graph's executable."""
        return _Launch(self, args, rt)

    def _traceable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with errors raised in it turned into a KernelError naming this kernel and the line."""
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except KernelError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the kernel's name and line
                raise KernelError(f"kernel {self.name}: {type(e).__name__}: {e}{_where(e, fn)}") from e
        return run

    # -- autograd (the body's VJP, itself a kernel) ------------------------------------------------
    def _save(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.tensor_at = tensors
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        ctx.others = [None if i in tensors else a for i, a in enumerate(inputs)]
        ctx.save_for_backward(*(inputs[i] for i in tensors))

    def _grad(self, ctx: Any, *grads: Any, direct: bool = False) -> tuple[Any, ...]:
        return self._input_grads(*self._backward_args(ctx, grads), direct=direct)

    def _backward_args(self, ctx: Any, grads: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor]]:
        """The call's arguments (its tensors as saved) and its outputs' gradients (zeros for an output
        nobody used)."""
        grads_in = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                    for g, (shape, dtype, device) in zip(grads, ctx.out_meta)]
        return _placed(ctx.others, ctx.tensor_at, ctx.saved_tensors), grads_in

    def _input_grads(self, args: list[Any], grads_in: list[torch.Tensor], direct: bool) -> tuple[Any, ...]:
        """The body's VJP: a gradient per differentiable argument, None for the others."""
        assert self.backward is not None
        got = list(self.backward._neuron(grads_in, *args) if direct and _plain(grads_in)[0]
                   else self.backward(grads_in, *args))
        result: list[Any] = []
        for a in args:
            result.append(got.pop(0) if _differentiable(a) else None)
        return tuple(result)


_Tensor = torch.Tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # a Parameter dispatches as a tensor (no torch_function)
_profiler = torch.autograd.profiler  # its `_is_profiler_enabled` flag is read at each call
_compiling = torch.compiler.is_compiling
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


_NOT_PLAIN = (0, None)


def _plain(args: Sequence[Any]) -> tuple[int, Any]:
    """Whether a call may skip the dispatcher, and its `_call_key` (read in the same pass): (0, None)
    if not; else 1, or 2 when autograd must record it. It may when some argument is a plain neuron
    tensor, every tensor is one, and nothing watches or transforms the call (Dynamo, a dispatch or
    function mode, functorch, the profiler's op ranges; autocast casts nothing at a custom op)."""
    if _compiling():  # first: Dynamo cannot read the device of a tensor the graph computed (a graph break)
        return _NOT_PLAIN
    plain = 0
    key = []
    for a in args:
        if isinstance(a, _Tensor):
            if type(a) not in _PLAIN_TYPES or a.device.type != _DEVICE:
                return _NOT_PLAIN
            if a.requires_grad:
                plain = 2
            elif not plain:
                plain = 1
            key.append((a.dtype, a.shape, a.stride()))  # (as `_call_key`)
        else:
            key.append(_value_key(a))
    if not plain or _profiler._is_profiler_enabled or _function_mode() or _dispatch_modes() or _functorch():
        return _NOT_PLAIN
    return (plain if plain == 1 or _grad_enabled() else 1), tuple(key)


def _apply_of(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """`function.apply` without `Function.apply`'s Python layer (functorch's dead-wrapper unwrap, which
    `_plain` makes moot by sending calls under functorch transforms to the dispatcher): the C++ apply
    itself, a few µs less per call. A Function with a `setup_context` keeps the whole `apply` (it binds
    the forward's default arguments first)."""
    if torch.autograd.function._is_setup_context_defined(function.setup_context):
        return function.apply
    return super(torch.autograd.Function, function).apply  # type: ignore[misc]


class _Direct(torch.autograd.Function):
    """A kernel's eager call on neuron: forward and backward are the kernel's and its VJP's launches."""

    @staticmethod
    def forward(ctx: Any, k: Kernel, launch: Any, *args: Any) -> Any:
        out = launch(args)
        k._save(ctx, args, out)
        ctx.kernel, ctx.launch = k, launch
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        k, fwd = ctx.kernel, ctx.launch
        args, grads_in = k._backward_args(ctx, grads)
        got = k._input_grads(args, grads_in, direct=True)
        if fwd.learns():
            key = _call_key([grads_in, *args])
            backward = k.backward.launches.get(key)
            if backward is not None:
                others, tensor_at, n = ctx.others, ctx.tensor_at, len(grads)
                fwd.learn_autograd(k.name, n, backward, list(key[0][1]),
                                   lambda *t: k.backward._neuron(list(t[:n]), *_placed(others, tensor_at, t[n:])),
                                   [j for j, i in enumerate(tensor_at) if _differentiable(args[i])], args)
        return (None, None, *got)


class _Saving(torch.autograd.Function):
    """A kernel's eager call on neuron with `Kernel.saving_backward`: its forward kernel's launch, whose
    extra outputs its backward kernel reads."""

    @staticmethod
    def forward(ctx: Any, k: Kernel, launch: Any, *args: Any) -> Any:
        out = launch(args)
        n = k.saving[2]
        ctx.kernel, ctx.launch, ctx.n_args = k, launch, len(args)
        ctx.save_for_backward(*args, *out[n:])
        return out[0] if n == 1 else out[:n]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        k, fwd = ctx.kernel, ctx.launch
        backward = k.saving[1]
        args = (*grads, *ctx.saved_tensors)
        key = _call_key(args)
        launch = backward._find(key, args)
        out = launch(args)
        if fwd.learns():  # (every argument is a tensor and gets a gradient)
            fwd.learn_autograd(k.name, k.saving[2], launch, list(key[:len(grads)]), backward._neuron,
                               list(range(ctx.n_args)), list(ctx.saved_tensors[:ctx.n_args]))
        return (None, None, *out)


_direct = _apply_of(_Direct)
_saving = _apply_of(_Saving)


def _register_neuron(op: Any, impl: Callable[..., Any]) -> None:
    """`impl` as the op's PrivateUse1 kernel. Registered on the custom op's own library, directly:
    `CustomOpDef.register_kernel` wraps a kernel in a Python checker and a Dynamo-disabling wrapper,
    which cost more than the executable's run on every call."""
    op._lib.impl(op._name, impl, "PrivateUse1")


def _differentiable(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and (a.dtype.is_floating_point or a.dtype.is_complex)


def _backward_kernel(k: Kernel, schema: Any) -> Kernel:
    """`<name>_backward(Tensor[] grads, <the kernel's arguments>) -> Tensor[]`: the gradients of the
    kernel's floating-point tensor arguments, from the body's VJP."""
    body = k.fn

    def vjp(grads: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
        ins = [a.detach().requires_grad_(True) if _differentiable(a) else a for a in args]
        wrt = [a for a in ins if _differentiable(a)]
        with torch.enable_grad():
            out = body(*ins)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs else [None] * len(wrt)
        return [g if g is not None else torch.zeros_like(a) for g, a in zip(got, wrt)]

    text = str(schema)
    args = text[text.index("(") + 1: text.rindex(") ->")]
    vjp_schema = f"(Tensor[] grads, {args}) -> Tensor[]"
    name = k.name + "_backward"
    try:
        # Every device but neuron: the VJP on the kernels' thread (an operator's implementation runs with
        # autograd's dispatch keys excluded, where `torch.autograd.grad` would see no graph).
        op = torch.library.custom_op(name, lambda grads, *a: _clean(lambda: _fresh(vjp(grads, *a), [*grads, *a])),
                                     mutates_args=(), schema=vjp_schema)
    except Exception as e:  # noqa: BLE001
        raise KernelError(f"kernel {k.name}: its backward {name} cannot be registered: {e}") from e
    bk = Kernel.__new__(Kernel)
    bk.name, bk.fn, bk.mutates, bk.op = name, vjp, False, op
    ns, short = name.split("::", 1)
    bk.overload = getattr(getattr(torch.ops, ns), short).default
    bk.launches, bk.runtime, bk.lock, bk.backward, bk.direct, bk.saving = {}, None, threading.Lock(), None, False, None
    op.register_fake(lambda grads, *a: [torch.empty_like(x) for x in a if _differentiable(x)])
    _register_neuron(op, bk._neuron)
    # In a torch.compile graph: the VJP's aten graph, traced apart (autograd cannot run inside the
    # graph's own trace) and called on the graph's tensors, which writes its ops into the graph.
    decompose(bk.overload, lambda grads, *a: _trace(bk, [list(grads), *a])(*grads, *_tensors(a)))
    return bk



def _fresh(outs: list[torch.Tensor], ins: Sequence[Any]) -> list[torch.Tensor]:
    """`outs`, each copied if it shares memory with an input or an earlier output: an operator may not
    return its input (`a * x + y`'s gradient for y is the incoming gradient itself)."""
    seen = {t.untyped_storage().data_ptr() for t in ins if isinstance(t, torch.Tensor)}
    fresh = []
    for o in outs:
        ptr = o.untyped_storage().data_ptr()
        if ptr in seen:
            o = o.clone()
        seen.add(o.untyped_storage().data_ptr())
        fresh.append(o)
    return fresh


def _placed(others: Sequence[Any], tensor_at: Sequence[int], tensors: Sequence[Any]) -> list[Any]:
    """A call's arguments: `others` (None where a tensor goes) with `tensors` at `tensor_at`."""
    args = list(others)
    for i, t in zip(tensor_at, tensors):
        args[i] = t
    return args


def _tensors(args: Iterable[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _call_key(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a call's graph depends on: each tensor's dtype, sizes, strides and device; every other
    argument by type and value (it is a constant of the traced graph)."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):  # (only neuron tensors reach here)
            out.append((a.dtype, a.shape, a.stride()))
        else:
            out.append(_value_key(a))
    return tuple(out)


def _value_key(a: Any) -> tuple[str, Any]:
    """A call key's item for an argument that is not a tensor (`_call_key`, `_plain`)."""
    return (type(a).__name__, _call_key(a)) if isinstance(a, (list, tuple)) else (type(a).__name__, a)


def _trace(k: Kernel, args: Sequence[Any]) -> torch.fx.GraphModule:
    """The body of `k` as an aten graph for `args`' metadata: a function of the call's tensors (lists
    flattened, in order) returning a tuple. Traced on a thread of its own: the caller may be inside a
    dispatch (autograd keys excluded) or another trace, and the body's VJP needs a clean autograd."""
    metas = [_describe(a) for a in args]
    fn = k.fn

    def work() -> torch.fx.GraphModule:
        template = [_materialise(m) for m in metas]
        flat = [t for a in template for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]

        def graph(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            it = iter(tensors)
            call = [[next(it) for _ in a] if isinstance(a, list) else (next(it) if isinstance(a, torch.Tensor)
                                                                       else a) for a in template]
            out = k._traceable(fn)(*call)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        gm = make_fx(graph, tracing_mode="fake")(*flat)
        gm.graph.eliminate_dead_code()  # a VJP's unused forward results
        gm.recompile()
        return gm

    return _clean(work)


def _clean(work: Callable[[], Any]) -> Any:
    """`work()` on a thread of its own: no dispatch keys excluded, no modes, grad mode on. A fresh thread
    each time (once per key, and per backward off neuron): a trace may start another from inside itself,
    or from the autograd engine's thread, which a shared worker would deadlock on."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)

    t = threading.Thread(target=run, name="neuron-kernel-trace", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def _describe(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("t", tuple(a.shape), a.stride(), a.dtype, a.device)
    if isinstance(a, list):
        return [_describe(x) for x in a]
    return ("v", a)


def _materialise(m: Any) -> Any:
    """A tensor with the described metadata (uninitialised: tracing reads only metadata), on the same
    device, so factories in the body (`torch.arange(n, device=x.device)`) are traced for that device."""
    if isinstance(m, list):
        return [_materialise(x) for x in m]
    if m[0] == "v":
        return m[1]
    _, sizes, strides, dtype, device = m
    return torch.empty_strided(sizes, strides, dtype=dtype, device=device)


class _Launch:
    """One key of a kernel in this process: its traced graph's `CompiledGraph` (the executable, or op by
    op until it is compiled / when refused), checked against the body on its first compiled run."""

    def __init__(self, k: Kernel, args: Sequence[Any], rt: Any) -> None:
        self.k = k
        self.rt = rt  # (a kernel drops its launches when the runtime is replaced)
        self.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.list_at = [i for i, a in enumerate(args) if isinstance(a, list)]
        self.all_tensors = len(self.tensor_at) == len(args)  # the executable's inputs are `args` themselves
        gm = _trace(k, args)
        self.graph = CompiledGraph(gm, f"kernel:{k.name}")
        self.checked = False
        self.native: Any = None  # the graph's native runner, once checked: the hot path calls it directly
        self.autograd: Any = None  # a call autograd records, as one C++ node (`learn_autograd`)
        self.lists = bool(self.list_at)
        self.returns = _returns_tuple(k)
        # Whether autograd may record a call as one C++ node: its results alias no argument (the node gives
        # them history) and it takes and returns tensors, not lists.
        plan = self.graph.plan
        self.node_ok = plan is not None and all(how == "x" for how, _ in plan.outputs) and not self.lists \
            and self.returns != "list"
        self.boundary = f"kernel:{k.name}"  # a fusion region ends at a kernel (TORCH_NEURONX_ENABLE_CONCATENATION)

    def __call__(self, args: Sequence[Any]) -> Any:
        flush_fusion(self.boundary)  # the executable reads its inputs' memory: queued ops run first
        native = self.native
        out = native(list(args) if self.all_tensors else self.flat(args)) if native is not None else None
        if out is not None:
            self.graph.ran_natively()
            launched = True
        else:
            out, launched = self.run(args)
        if launched:
            rt = self.rt
            with rt.lock:
                rt.counts["executions"] += 1
        kind = self.returns
        if kind is False:
            return out[0]
        return tuple(out) if kind is True else list(out)

    def learns(self) -> bool:
        """Whether a backward of a call of this launch may still teach it its C++ node (`learn_autograd`)."""
        return self.autograd is None and self.native is not None and self.node_ok

    def learn_autograd(self, name: str, n_out: int, backward: _Launch, want: list[Any], fallback: Callable[..., Any],
                       edges: list[int], args: list[Any]) -> None:
        """After a backward of a call of this launch (Python's autograd.Function): when both this launch and
        the `backward` launch it ran run natively, later calls of this key record autograd as one C++ node
        (`NATIVE.KernelAutograd`: `n_out` results, then outputs saved for the backward; `want`: the
        gradients' (dtype, sizes, strides) `backward` was made for; `fallback(*grads, *tensors, *saved)`:
        Python's backward for other gradients; `edges`: the tensors that get gradients, by index; `name`:
        the kernel the user called, whose name the node takes; `args`: a call of this key)."""
        if NATIVE is not None and self.learns() and backward.native is not None:
            self.autograd = NATIVE.KernelAutograd(name, self.native, n_out, backward.native, want,
                                                  fallback, edges, args)

    def run(self, args: Sequence[Any]) -> tuple[list[Any], bool]:
        """A call through the `CompiledGraph` (the first compiled one checked against the body): its
        outputs, and whether its executable ran (else its ops ran, and counted, one by one). From the
        first checked call on, `__call__` calls the graph's native runner itself."""
        tensors = self.flat(args)
        graph = self.graph
        check = not self.checked and graph.exe is not None
        host = [alias(t).clone() for t in tensors] if check else None
        out = graph(tensors)
        if check:
            self._check(args, host, out)
        launched = graph.exe is not None and graph.refused is None
        if self.checked and launched:
            self.native = graph.native
        return out, launched

    def flat(self, args: Sequence[Any]) -> list[torch.Tensor]:
        if not self.lists:
            return [args[i] for i in self.tensor_at]
        return [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]

    def _check(self, args: Sequence[Any], host: list[torch.Tensor] | None, out: list[Any]) -> None:
        """The executable's outputs against the body run on the host copies of the inputs."""
        assert host is not None
        it = iter(host)
        cpu_args = [[next(it) for _ in a] if isinstance(a, list) else (next(it) if isinstance(a, torch.Tensor)
                                                                       else a) for a in args]
        want = _clean(lambda: self.k.fn(*cpu_args))
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        for i, (w, got) in enumerate(zip(want, out)):
            g = alias(got) if got.device.type == _DEVICE else got
            try:
                torch.testing.assert_close(g, w, equal_nan=True)
            except AssertionError as e:
                raise KernelError(f"kernel {self.k.name}: output {i} of its executable "
                                  f"({self.graph.key[:12]}) differs from its own body on CPU: "
                                  f"{str(e).splitlines()[1:3]}; refused") from None
        self.checked = True


def _returns_tuple(k: Kernel) -> Any:
    """How the op returns: False (one tensor), True (a tuple), "list" (Tensor[])."""
    rets = k.overload._schema.returns
    if len(rets) == 1:
        return "list" if str(rets[0].type) == "List[Tensor]" else False
    return True


def _where(e: BaseException, fn: Callable[..., Any]) -> str:
    """' (file:line: source)' of the innermost frame of `e` in `fn`'s own file, else ''."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    for fs in reversed(traceback.extract_tb(e.__traceback__)):
        if fs.filename == code.co_filename:
            return f" (at {fs.filename}:{fs.lineno}: {(fs.line or '').strip()})"
    return ""

