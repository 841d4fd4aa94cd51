"""Check one OpInfo on `neuron` against CPU.

For each of the op's first K sample inputs (float32, or the op's first supported dtype if it has no
float32):
  1. run the op on CPU and on `neuron` (the same inputs copied over, the same `torch.manual_seed`, since
     neuron's random ops draw from the CPU generator) and compare every output;
  2. if the OpInfo supports autograd, backpropagate the same random output gradients on both and compare
     the input gradients;
  3. on the first sample, run the in-place variant (when the op has one) and the out= variant (when the
     OpInfo supports out=) and compare the mutated tensors and what the call returned.
While the neuron side runs, every host execution of an aten op is recorded (`_HostLog`): an op `compiled`
only if none of its aten ops ran on the host.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._native import NATIVE
from ..aten import runtime
from ._skips import ANY_DEVICE, CPU_ARGS, METADATA_ONLY, NO_BACKWARD, NO_INPLACE, NO_OUT, SKIP

DEVICE = "neuron"
PREFERRED_DTYPES = (torch.float32, torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8)

# Worst first: the status of an op is the worst status of its checks.
STATUS_ORDER = ("error", "mismatch", "fallback", "compiled", "skipped")


class Mismatch(AssertionError):
    """The neuron result differs from CPU's."""


def op_key(op: Any) -> str:
    """The op's name in the coverage map: `name` or `name.variant`."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@dataclasses.dataclass
class Result:
    status: str
    reason: str = ""
    dtype: str = ""
    samples: int = 0
    host_ops: dict[str, str] = dataclasses.field(default_factory=dict)   # on purpose (HOST table, random)
    fallback_ops: dict[str, str] = dataclasses.field(default_factory=dict)  # the compiler refused
    per_shape: dict[str, str] = dataclasses.field(default_factory=dict)  # compiled per shape: no generic kernel
    executions: int = 0
    compiles: int = 0
    seconds: float = 0.0
    checks: list[str] = dataclasses.field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["seconds"] = round(self.seconds, 3)
        return {k: v for k, v in d.items() if v not in ("", {}, [])}


class _HostLog:
    """Records every aten op the runtime runs on the host while active (wraps `Runtime.host_call`)."""

    def __init__(self) -> None:
        self.rt = runtime()
        self.host: dict[str, str] = {}
        self.fallback: dict[str, str] = {}
        self.active = False
        inner = self.rt.host_call

        def host_call(info: Any, values: Any, host_values: Any, fallback: bool = False, counter: Any = None) -> Any:
            # Recorded once it ran: a host kernel that lacks the dtype raises, and the op computes wider
            # through executables instead (`_widen`), which is not a host run.
            out = inner(info, values, host_values, fallback=fallback, counter=counter)
            if self.active:
                if fallback:
                    self.fallback.setdefault(info.qualname, self.rt.fallback_ops.get(info.qualname, "fallback"))
                else:
                    self.host.setdefault(info.qualname, info.reason or "host")
            return out

        self.rt.host_call = host_call  # type: ignore[method-assign]

    def __enter__(self) -> "_HostLog":
        self.active = True
        if NATIVE is not None:  # random host ops through the Python kernel, which records them here
            NATIVE.set_host_native(False)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        if NATIVE is not None:
            NATIVE.set_host_native(True)


def per_shape(refused: dict[str, str], before: set[str]) -> dict[str, str]:
    """The shape classes refused since `before` (the resolver's `refused_classes`), as {aten op: reason}:
    the ops this check compiled per shape because they have no generic executable."""
    out: dict[str, str] = {}
    for k in sorted(set(refused) - before):
        reason = refused[k]
        op, sep, why = reason.partition(": ")
        if not sep or "::" not in op:
            op, why = "?", reason
        out.setdefault(op, why)
    return dict(sorted(out.items()))


def pick_dtype(op: Any) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    for d in PREFERRED_DTYPES:
        if d in supported:
            return d
    return next(iter(sorted(supported, key=str)), None)


# -- moving samples -------------------------------------------------------------------------------------
def _to_device(t: Any, device: str) -> Any:
    if isinstance(t, torch.Tensor):
        c = _same_layout(t.detach(), device)
        if t.requires_grad:
            c.requires_grad_(True)
        return c
    if isinstance(t, torch.device) and t.type == "cpu":
        return torch.device(device)
    return t


def _same_layout(t: torch.Tensor, device: str) -> torch.Tensor:
    """`t` on `device` with the same strides and storage offset over a copy of its whole storage, so ops
    that read through the storage (as_strided on a partial view) or care about strides see what CPU saw."""
    if t.layout != torch.strided or t.is_conj() or t.is_neg():
        return t.to(device)
    item = t.element_size()
    nbytes = t.untyped_storage().nbytes()
    if nbytes % item or (t.is_contiguous() and t.storage_offset() == 0 and nbytes == t.numel() * item):
        return t.to(device)
    whole = t.new_empty(0).set_(t.untyped_storage(), 0, (nbytes // item,), (1,))
    return whole.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def _move(tree: Any, device: str) -> Any:
    if isinstance(tree, torch.Tensor) or isinstance(tree, torch.device):
        return _to_device(tree, device)
    if isinstance(tree, list):
        return [_move(x, device) for x in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_move(x, device) for x in tree)
    if isinstance(tree, dict):
        return {k: (device if k == "device" and v == "cpu" else _move(v, device)) for k, v in tree.items()}
    return tree


def _move_sample(op: Any, sample: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """The sample on neuron; arguments the op wants on CPU (`CPU_ARGS`) stay there, as on CUDA."""
    inp, args, kwargs = sample
    if op_key(op) in CPU_ARGS:
        return _move(inp, DEVICE), args, kwargs
    return _move(inp, DEVICE), _move(args, DEVICE), _move(kwargs, DEVICE)


def _leaves(tree: Any) -> list[Any]:
    try:
        return pytree.tree_leaves(tree)
    except Exception:  # noqa: BLE001 - an unregistered container is one leaf
        return [tree]


def _grad_inputs(sample: tuple[Any, Any, Any]) -> list[torch.Tensor]:
    return [t for t in _leaves(sample) if isinstance(t, torch.Tensor) and t.requires_grad]


# -- comparing --------------------------------------------------------------------------------------------
def compare(actual: Any, expected: Any, what: str, values: bool = True, any_device: bool = False) -> None:
    """Raise `Mismatch` unless the neuron result `actual` equals CPU's `expected` (values moved to CPU).
    `any_device`: the result may be on CPU (the op was asked for it)."""
    a_leaves, e_leaves = _leaves(actual), _leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise Mismatch(f"{what}: {len(a_leaves)} outputs, CPU gave {len(e_leaves)}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"{what}[{i}]" if len(e_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{where}: got {type(a).__name__}, CPU gave a tensor")
            want_device = DEVICE if e.device.type == "cpu" else e.device.type
            if a.device.type != want_device and not (any_device and a.device.type == "cpu"):
                raise Mismatch(f"{where}: on {a.device.type}, expected {want_device}")
            if a.dtype != e.dtype or a.shape != e.shape:
                raise Mismatch(f"{where}: {a.dtype}{list(a.shape)}, CPU gave {e.dtype}{list(e.shape)}")
            if not values or e.layout != torch.strided:
                continue
            ac = a.detach().cpu()
            try:
                torch.testing.assert_close(ac, e.detach(), equal_nan=True, check_device=False, check_stride=False)
            except AssertionError as err:
                first = str(err).strip().splitlines()
                raise Mismatch(f"{where}: {' '.join(first[:3])}") from None
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e)) or math.isclose(a, e, rel_tol=1e-5, abs_tol=1e-6)):
                raise Mismatch(f"{where}: {a!r}, CPU gave {e!r}")
        elif isinstance(e, (torch.dtype, torch.Size, int, bool, str, type(None))):
            if a != e:
                raise Mismatch(f"{where}: {a!r}, CPU gave {e!r}")


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


# -- one op ---------------------------------------------------------------------------------------------
class _Deadline(Exception):
    pass


def samples_for(op: Any, dtype: torch.dtype, k: int, requires_grad: bool) -> Iterator[Any]:
    torch.manual_seed(0)
    return itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad), k)


def _run(fn: Callable[..., Any], sample: tuple[Any, Any, Any], seed: int) -> Any:
    inp, args, kwargs = sample
    torch.manual_seed(seed)
    return fn(inp, *args, **kwargs)


def _differentiable(out: Any) -> list[torch.Tensor]:
    return [t for t in _leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
            and (t.is_floating_point() or t.is_complex())]


def check_forward_backward(op: Any, s: Any, idx: int, want_backward: bool, values: bool,
                           log: _HostLog) -> list[str]:
    """One sample: forward (and backward) on CPU and neuron. Returns the names of the checks that ran."""
    cpu = (s.input, s.args, s.kwargs)
    try:
        expected = _run(op, cpu, seed=idx)
    except Exception as e:  # noqa: BLE001 - the sample itself is invalid here: nothing to compare
        raise _CpuFailed(_short(e)) from e
    dev = _move_sample(op, cpu)
    with log:
        actual = _run(op, dev, seed=idx)
    ran = ["forward"]
    try:
        compare(actual, expected, f"sample {idx} forward", values, any_device=op_key(op) in ANY_DEVICE)
    except Mismatch:
        if not values or not _half_within_fp64_reference(op, cpu, idx, actual, expected):
            raise
        ran = ["forward≈fp64"]
    if not want_backward:
        return ran
    post = s.output_process_fn_grad
    e_outs, a_outs = _differentiable(post(expected)), _differentiable(post(actual))
    e_in, a_in = _grad_inputs(cpu), _grad_inputs(dev)
    if not e_outs or not e_in:
        return ran
    if len(a_outs) != len(e_outs):
        raise Mismatch(f"sample {idx} backward: {len(a_outs)} differentiable outputs, CPU gave {len(e_outs)}")
    torch.manual_seed(1000 + idx)
    grads = [torch.randn_like(o) for o in e_outs]
    try:
        e_g = torch.autograd.grad(e_outs, e_in, grads, allow_unused=True)
    except Exception:  # noqa: BLE001 - CPU's backward refuses these gradients (e.g. linalg.eig's gauge check)
        return ran
    with log:
        a_g = torch.autograd.grad(a_outs, a_in, [g.to(o.device) for g, o in zip(grads, a_outs)], allow_unused=True)
    compare(list(a_g), list(e_g), f"sample {idx} backward", values)
    ran.append("backward")
    return ran


class _CpuFailed(Exception):
    """CPU itself rejects the sample: not a neuron problem."""


_HALF = (torch.float16, torch.bfloat16)


def _half_within_fp64_reference(op: Any, cpu: tuple[Any, Any, Any], idx: int, actual: Any, expected: Any) -> bool:
    """For float16/bfloat16 results that differ from CPU's: whether neuron's are as accurate as CPU's,
    judged against the op computed in float64 the way PyTorch judges Inductor's (`torch._dynamo.utils.same`
    with its float64 reference): neuron's root-mean-square error from the float64 result at most twice
    CPU's, plus 1e-5. A compiled kernel computes in float32 and rounds once where an eager half kernel may
    round between steps, so the two differ by an ulp (batch norm: 1 ulp on 2-5 % of the elements, with
    neuron's error from float64 no larger than CPU's); a wrong kernel fails this as it fails the direct
    comparison. Every other output of the sample must match CPU exactly as before."""
    a_l, e_l = _leaves(actual), _leaves(expected)
    if len(a_l) != len(e_l) or not any(isinstance(e, torch.Tensor) and e.dtype in _HALF for e in e_l):
        return False

    def up(t: Any) -> Any:
        return t.detach().to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype in _HALF else t

    try:
        ref = _leaves(_run(op, pytree.tree_map(up, cpu), seed=idx))
    except Exception:  # noqa: BLE001 - no float64 kernel: nothing to judge by
        return False
    if len(ref) != len(e_l):
        return False
    for a, e, r in zip(a_l, e_l, ref):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.dtype != e.dtype or a.shape != e.shape:
            return False
        ac = a.detach().cpu()
        if e.dtype not in _HALF or not isinstance(r, torch.Tensor) or r.shape != e.shape:
            if not torch.equal(ac, e.detach()) and not torch.allclose(ac, e.detach(), equal_nan=True):
                return False
            continue
        finite = torch.isfinite(r) & torch.isfinite(e.double())
        if not torch.equal(torch.isfinite(ac.double()), torch.isfinite(e.double())):
            return False

        def rmse(x: torch.Tensor) -> float:
            d = (x.double() - r.double())[finite]
            return float(d.pow(2).mean().sqrt()) if d.numel() else 0.0

        if rmse(ac) > 2.0 * rmse(e.detach()) + 1e-5:
            return False
    return True


def _fresh(sample: Any) -> tuple[Any, Any, Any]:
    """A detached copy of a CPU sample (in-place and out= variants mutate)."""
    def f(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone()
        return t
    return (pytree.tree_map(f, sample.input), pytree.tree_map(f, sample.args), pytree.tree_map(f, sample.kwargs))


def check_inplace(op: Any, s: Any, log: _HostLog, values: bool = True) -> str | None:
    fn = op.inplace_variant
    cpu = _fresh(s)
    try:
        e_ret = _run(fn, cpu, seed=7)
    except Exception:  # noqa: BLE001 - e.g. the result type cannot be cast into the input: CPU refuses
        return None
    dev = _move_sample(op, _fresh(s))
    with log:
        a_ret = _run(fn, dev, seed=7)
    compare(dev[0], cpu[0], "in-place variant: mutated input", values)
    if (e_ret is cpu[0]) and (a_ret is not dev[0]):
        raise Mismatch("in-place variant: did not return its input")
    return "inplace"


def check_out(op: Any, s: Any, log: _HostLog, values: bool = True) -> str | None:
    cpu = _fresh(s)
    try:
        expected = _run(op, cpu, seed=11)
    except Exception:  # noqa: BLE001
        return None
    e_leaves = _leaves(expected)
    if not e_leaves or not all(isinstance(t, torch.Tensor) for t in e_leaves):
        return None
    # Zero-size out= tensors: the kernel must resize them (PyTorch does, silently, when numel is 0).
    outs = [torch.empty(0, dtype=t.dtype, device=DEVICE) for t in e_leaves]
    out_arg: Any = outs[0] if isinstance(expected, torch.Tensor) else tuple(outs)
    dev = _move_sample(op, _fresh(s))
    inp, args, kwargs = dev
    try:
        e_out = [torch.empty(0, dtype=t.dtype) for t in e_leaves]
        e_ret = _run(op, (cpu[0], cpu[1], {**cpu[2], "out": e_out[0] if isinstance(expected, torch.Tensor) else tuple(e_out)}),
             seed=11)
    except Exception:  # noqa: BLE001 - this sample has no out= form on CPU either
        return None
    with log:
        ret = _run(op, (inp, args, {**kwargs, "out": out_arg}), seed=11)
    compare(outs if len(outs) > 1 else outs[0], e_out if len(e_out) > 1 else e_out[0], "out= variant", values)
    if e_ret is None:  # ops with a Tensor[] out= return nothing (`-> ()`)
        if ret is not None:
            raise Mismatch("out= variant: returned a value, CPU returned None")
    elif any(r is not o for r, o in zip(_leaves(ret), outs)):
        raise Mismatch("out= variant: did not return its out= tensors")
    return "out"


def check_op(op: Any, k: int = 3, dtype: torch.dtype | None = None, deadline_s: float = 120.0,
             log: _HostLog | None = None, forward_only: bool = False) -> Result:
    """Run one OpInfo's checks; never raises (errors become the result). `forward_only`: no backward,
    in-place or out= checks (the aoti sweep, where every new signature is a compile of seconds)."""
    name = op_key(op)
    t0 = time.monotonic()
    if name in SKIP:
        return Result("skipped", SKIP[name])
    dtype = dtype or pick_dtype(op)
    if dtype is None:
        return Result("skipped", "the OpInfo lists no CPU dtype")
    log = log or _HostLog()
    log.host.clear()
    log.fallback.clear()
    rt = runtime()
    before = rt.stats()
    refused_before = set(rt.resolver.refused_classes)
    values = name not in METADATA_ONLY and not op.has_nondeterministic_output
    grad = (not forward_only and op.supports_autograd and name not in NO_BACKWARD and (dtype.is_floating_point or dtype.is_complex)
            and dtype in op.supported_backward_dtypes("cpu"))
    res = Result("compiled", dtype=str(dtype).removeprefix("torch."))
    checks: set[str] = set()
    cpu_failures: list[str] = []
    try:
        for idx, s in enumerate(samples_for(op, dtype, k, grad)):
            if time.monotonic() - t0 > deadline_s:
                break
            try:
                checks.update(check_forward_backward(op, s, idx, grad, values, log))
            except _CpuFailed as e:
                cpu_failures.append(str(e))
                continue
            res.samples += 1
            if idx == 0 and not forward_only and op.inplace_variant is not None and name not in NO_INPLACE:
                c = check_inplace(op, s, log, values)
                if c:
                    checks.add(c)
            if idx == 0 and not forward_only and op.supports_out and name not in NO_OUT:
                c = check_out(op, s, log, values)
                if c:
                    checks.add(c)
    except Mismatch as e:
        res.status, res.reason = "mismatch", str(e)
    except Exception as e:  # noqa: BLE001 - an op error on neuron is a result, not a crash of the sweep
        res.status, res.reason = "error", _short(e)
    after = rt.stats()
    res.executions = after["executions"] - before["executions"]
    res.compiles = after["compiles"] - before["compiles"]
    res.host_ops = dict(sorted(log.host.items()))
    # The runtime notes why an op fell back after running it on the host: take the reason from there.
    res.fallback_ops = {q: rt.fallback_ops.get(q, w) for q, w in sorted(log.fallback.items())}
    res.per_shape = per_shape(rt.resolver.refused_classes, refused_before)
    res.checks = sorted(checks)
    res.seconds = time.monotonic() - t0
    if res.status == "compiled":
        if res.samples == 0:
            res.status = "skipped"
            res.reason = ("CPU rejects every sample: " + cpu_failures[0]) if cpu_failures else "no sample inputs"
        elif res.fallback_ops:
            res.status = "fallback"
            res.reason = "compiler refused: " + "; ".join(f"{o} ({w})" for o, w in res.fallback_ops.items())
        elif res.host_ops:
            res.status = "fallback"
            res.reason = "host by design: " + "; ".join(f"{o} ({w})" for o, w in res.host_ops.items())
        elif res.executions == 0:
            res.reason = "views and metadata only: nothing to compile"
    return res


# Tolerances for dtypes CUDA computes and the host may not: half types are compared at half precision
# (a result computed in float32 and rounded once may differ from the reference by an ulp or two).
HALF_TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (2e-2, 2e-2), torch.complex32: (2e-2, 2e-2)}

# The reference of CUDA-only pairs that no wider CPU dtype computes: the op's definition on CUDA.
def _nansum(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.sum(torch.where(torch.isnan(x), torch.zeros_like(x), x), *args, **kwargs)


def _nanmean(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    kept = (~torch.isnan(x)).to(x.dtype)
    return _nansum(x, *args, **kwargs) / torch.sum(kept, *args, **{k: v for k, v in kwargs.items() if k != "dtype"})


DEFINITIONS: dict[str, Callable[..., Any]] = {"nansum": _nansum, "nanmean": _nanmean}


def cuda_only_reference(op: Any, dtype: torch.dtype, sample: tuple[Any, Any, Any], seed: int) -> Any:
    """What CUDA computes for a dtype the CPU kernel lacks: CPU in the nearest wider dtype it accepts
    (float16/bfloat16 -> float32, complex32 -> complex64, ints -> int64 -> float64, bool -> int64), the
    results in the dtypes the op's meta kernel gives for the original inputs (as CUDA returns them)."""
    from ..aten import named_dtypes, result_dtypes, run_widened

    inp, args, kwargs = sample
    fn = op
    if op.name in DEFINITIONS:
        up = {torch.complex32: torch.complex64}
        fn = DEFINITIONS[op.name]
        widened = pytree.tree_map(lambda t: t.to(up[t.dtype]) if isinstance(t, torch.Tensor) and t.dtype in up
                                  else t, (inp, args, kwargs))
        torch.manual_seed(seed)
        out = fn(widened[0], *widened[1], **widened[2])
        want = result_dtypes(op, [inp, *args], kwargs)
        leaves = [o for o in _leaves(out) if isinstance(o, torch.Tensor)]
        return [o.to(w) for o, w in zip(leaves, want or [o.dtype for o in leaves])]
    torch.manual_seed(seed)
    try:
        return fn(inp, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the CPU kernel lacks the dtype: compute it wider
        if not named_dtypes(e):
            raise
        torch.manual_seed(seed)
        return run_widened(op_key(op), _Call(fn), [inp, *args], kwargs, e)[0]


class _Call:
    """An OpInfo callable with the `_schema` `run_widened` reads (no arguments mutated)."""

    class _schema:  # noqa: N801
        arguments: list[Any] = []

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def check_cuda_dtype(op: Any, dtype: torch.dtype, k: int = 1, log: _HostLog | None = None) -> Result:
    """A dtype CUDA's kernel accepts and the op's CPU entry does not list: neuron must give what CUDA gives
    (`cuda_only_reference`), compared at the dtype's precision (`HALF_TOL`; exact for integers and bool)."""
    log = log or _HostLog()
    log.host.clear()
    log.fallback.clear()
    res = Result("compiled", dtype=str(dtype).removeprefix("torch."))
    t0 = time.monotonic()
    try:
        for idx, s in enumerate(samples_for(op, dtype, k, False)):
            low = (s.input, s.args, s.kwargs)
            try:
                expected = cuda_only_reference(op, dtype, low, seed=idx)
            except Exception as e:  # noqa: BLE001 - no wider CPU dtype computes this sample either
                raise _CpuFailed(_short(e)) from e
            with log:
                actual = _run(op, _move_sample(op, low), seed=idx)
            _compare_low(actual, expected, f"{dtype} sample {idx}", HALF_TOL.get(dtype, (0.0, 0.0)))
            res.samples += 1
    except _CpuFailed as e:
        res.status, res.reason = "skipped", "no CPU reference: " + str(e)
    except Mismatch as e:
        res.status, res.reason = "mismatch", str(e)
    except Exception as e:  # noqa: BLE001
        res.status, res.reason = "error", _short(e)
    res.seconds = time.monotonic() - t0
    if res.status == "compiled" and (log.host or log.fallback):
        res.status = "fallback"
        res.reason = "ran on the host: " + ", ".join(sorted({*log.host, *log.fallback}))
    return res


def _compare_low(actual: Any, expected: Any, what: str, tol: tuple[float, float]) -> None:
    a_l, e_l = _leaves(actual), _leaves(expected)
    if len(a_l) != len(e_l):
        raise Mismatch(f"{what}: {len(a_l)} outputs, expected {len(e_l)}")
    for a, e in zip(a_l, e_l):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.device.type != DEVICE:
                raise Mismatch(f"{what}: not a neuron tensor")
            if a.dtype != e.dtype or a.shape != e.shape:
                raise Mismatch(f"{what}: {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
            ac, ec = a.detach().cpu(), e.detach()
            if ac.dtype == torch.complex32:
                ac, ec = ac.to(torch.complex64), ec.to(torch.complex64)
            try:
                torch.testing.assert_close(ac, ec, equal_nan=True, rtol=tol[0], atol=tol[1], check_stride=False)
            except AssertionError as err:
                raise Mismatch(f"{what}: {' '.join(str(err).splitlines()[:3])}") from None


__all__ = ["Result", "check_op", "check_cuda_dtype", "cuda_only_reference", "op_key", "STATUS_ORDER"]
