"""The overlap matrix: every op of PyTorch's OpInfo database with an in-place or out= variant, called with
the tensor it writes overlapping a tensor it reads, on CPU and on `neuron` (issue 41).

For each op's first K samples (its first dtype of `_check.PREFERRED_DTYPES`), the written tensor (the
input of the in-place variant, the `out=` of the out= variant) and each tensor the call reads of the same
dtype are laid out over one buffer in each way of `LAYOUTS`: partially overlapping, with a storage offset,
the very same elements (the same tensor, or another view of it), a transposed view of the same memory, a
read expanded over the written memory, an expanded (self-overlapping) written tensor, and disjoint views
of one storage. Each case runs on CPU, then on neuron three times: once on tensors of the same layout over
buffers of their own (so the case's key has its executable: the hit paths decide too), then twice as laid
out. Neuron must raise exactly when CPU raises, and otherwise leave the same values in the buffer and
return the same values.

`python -m neuron_runtime.conformance._overlap [--samples K] [--ops GLOB,...] [--out FILE.json]` prints the
matrix's size and its disagreements (docs/coverage/overlap.md); `tests/aten/test_overlap.py` runs a part.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._check import DEVICE, _move, op_key, pick_dtype
from ._skips import CPU_ARGS, NO_INPLACE, NO_OUT, SKIP

#: How the written tensor W and a read tensor R share one buffer.
LAYOUTS = ("partial", "offset", "same", "alias", "transposed", "expanded_read", "expanded_write", "disjoint")

# A layout: (shape, strides, storage offset) of a view of the buffer.
Spec = tuple[tuple[int, ...], tuple[int, ...], int]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _layout(kind: str, sw: tuple[int, ...], sr: tuple[int, ...]) -> tuple[Spec, Spec | None, int] | None:
    """(W's spec, R's spec or None for R = W itself, buffer numel) of a layout, or None where it does not
    apply to these shapes."""
    nw, nr = _numel(sw), _numel(sr)
    w0: Spec = (sw, _contiguous(sw), 0)
    if kind == "partial":
        k = nw // 2 if nw > 1 else 0
        return w0, (sr, _contiguous(sr), k), max(nw, k + nr)
    if kind == "offset":  # W at a storage offset, R from the start
        return (sw, _contiguous(sw), 2), (sr, _contiguous(sr), 0), max(2 + nw, nr)
    if kind == "same":
        return (w0, None, nw) if sr == sw else None
    if kind == "alias":  # the very same elements through another view
        return (w0, w0, nw) if sr == sw else None
    if kind == "transposed":
        if len(sr) < 2:
            return None
        rev = tuple(reversed(_contiguous(sr[::-1])))  # the strides of a transpose of a contiguous tensor
        return w0, (sr, rev, 0), max(nw, nr)
    if kind == "expanded_read":  # every element of R reads W's first one
        return (w0, (sr, (0,) * len(sr), 0), nw) if nr > 1 and nw else None
    if kind == "expanded_write":  # W's rows all are one row (its first dim expanded)
        if not sw or sw[0] < 2:
            return None
        strides = (0, *_contiguous(sw[1:]))
        return (sw, strides, 0), (sr, _contiguous(sr), _numel(sw[1:])), _numel(sw[1:]) + nr
    if kind == "disjoint":
        return w0, (sr, _contiguous(sr), nw), nw + nr
    raise ValueError(kind)


@dataclasses.dataclass
class Case:
    op: str
    variant: str          # "inplace" | "out"
    sample: int
    reader: str           # the path of R in the call ("input", "args[1]", "kwargs['other']")
    layout: str
    outcome: str = ""     # "agree" | "disagree" | "skip"
    cpu: str = ""         # "raises" | "ok"
    neuron: str = ""
    detail: str = ""


def _tensor_paths(tree: Any) -> list[tuple[Any, torch.Tensor]]:
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(p, v) for p, v in leaves if isinstance(v, torch.Tensor) and v.layout == torch.strided]


def _replace(tree: Any, path: Any, value: Any) -> Any:
    leaves, spec = pytree.tree_flatten_with_path(tree)
    return pytree.tree_unflatten([value if p == path else v for p, v in leaves], spec)


class _Call:
    """One call of the matrix: the op's variant with W and R laid out over one buffer (or over two)."""

    def __init__(self, fn: Callable[..., Any], call: tuple[Any, ...], w_path: Any, r_path: Any,
                 w: torch.Tensor, r: torch.Tensor, w_spec: Spec, r_spec: Spec | None, n: int, out: bool,
                 cpu_args: bool) -> None:
        self.fn, self.call, self.w_path, self.r_path = fn, call, w_path, r_path
        self.w, self.r, self.w_spec, self.r_spec, self.n, self.out, self.cpu_args = w, r, w_spec, r_spec, n, out, \
            cpu_args

    def buffer(self) -> torch.Tensor:
        """The buffer's first values: W's, then R's where R lies (an expanded W takes its first row)."""
        buf = torch.zeros(self.n, dtype=self.w.dtype)
        shape, strides, off = self.w_spec
        wv = buf.as_strided(shape, strides, off)
        if 0 in strides and self.w.numel():
            wv[0].copy_(self.w.detach()[0])
        else:
            wv.copy_(self.w.detach())
        if self.r_spec is not None and 0 not in self.r_spec[1]:  # (an expanded R reads W's values)
            buf.as_strided(*self.r_spec).copy_(self.r.detach())
        return buf

    def run(self, device: str, apart: bool) -> tuple[str, Any]:
        """("raises", message) or ("ok", (buffer values, returned values)) on `device`; `apart`: W and R
        over two copies of the buffer."""
        base = self.buffer()
        bw = base.to(device) if device != "cpu" else base
        br = base.clone().to(device) if apart else bw
        w = bw.as_strided(*self.w_spec)
        r = w if self.r_spec is None else br.as_strided(*self.r_spec)
        inp, args, kwargs = self.call
        if device != "cpu":
            inp = _move(inp, device)
            args, kwargs = (args, kwargs) if self.cpu_args else (_move(args, device), _move(kwargs, device))
        tree = (inp, args, kwargs)
        tree = _replace(tree, self.w_path, w)
        if self.r_path is not None and (not apart or self.r_spec is not None):
            tree = _replace(tree, self.r_path, r if not (apart and self.r_spec is None) else w)
        inp, args, kwargs = tree
        if self.out:
            kwargs = {**kwargs, "out": w}
        torch.manual_seed(5)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ret = self.fn(inp, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the outcome compared with CPU's
            return "raises", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rets = [t.detach().cpu().clone() for t in pytree.tree_leaves(ret) if isinstance(t, torch.Tensor)]
        if w.untyped_storage().nbytes() > bw.untyped_storage().nbytes() or w.untyped_storage().data_ptr() != \
                bw.untyped_storage().data_ptr():
            # An out= resized past the buffer's end: CPU grows the shared storage in place, neuron memory
            # cannot grow (docs/dispatch.md): W's own values are compared, not the buffer's.
            return "ok", (w.detach().cpu().clone(), w.detach().cpu().clone(), rets)
        return "ok", (bw.cpu().clone(), br.cpu().clone(), rets)


def _same(a: Any, b: Any) -> str:
    """"" when the neuron outcome `a` equals CPU's `b`, else what differs."""
    ab, ar_, arets = a
    bb, br_, brets = b
    for what, x, y in [("buffer", ab, bb), ("read buffer", ar_, br_), *[(f"return {i}", x, y) for i, (x, y) in
                                                                        enumerate(zip(arets, brets))]]:
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{what}: {x.dtype}{list(x.shape)} vs CPU {y.dtype}{list(y.shape)}"
        if x.is_floating_point() and x.element_size() == 1:  # float8: assert_close compares only bits
            x, y = x.double(), y.double()
        try:
            torch.testing.assert_close(x, y, equal_nan=True, rtol=1.3e-6, atol=1e-5)
        except AssertionError as e:
            return f"{what}: " + " ".join(str(e).strip().splitlines()[:2])
    if len(arets) != len(brets):
        return f"{len(arets)} returned tensors vs CPU {len(brets)}"
    return ""


def _calls(op: Any, dtype: torch.dtype, k: int) -> Iterator[tuple[str, int, str, str, _Call | None]]:
    """(variant, sample index, reader path, layout, call or None where the layout does not apply)."""
    name = op_key(op)
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:k]
    for i, s in enumerate(samples):
        call = (s.input, tuple(s.args), dict(s.kwargs))
        if not isinstance(s.input, torch.Tensor):
            continue
        variants: list[tuple[str, Callable[..., Any], Any, torch.Tensor]] = []
        if op.inplace_variant is not None and name not in NO_INPLACE:
            variants.append(("inplace", op.inplace_variant, pytree.tree_flatten_with_path(call)[0][0][0], s.input))
        if op.supports_out and name not in NO_OUT:
            try:
                torch.manual_seed(5)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = op(s.input, *s.args, **s.kwargs)
            except Exception:  # noqa: BLE001 - no out= form for this sample
                res = None
            if isinstance(res, torch.Tensor) and res.layout == torch.strided:
                variants.append(("out", op, None, res))
        for variant, fn, w_path, w in variants:
            readers = [(p, t) for p, t in _tensor_paths(call) if p != w_path and t.dtype == w.dtype]
            if not readers:  # (a unary in-place op: only its written tensor can overlap itself)
                readers = [(None, w)]
            for r_path, r in readers:
                rname = "-" if r_path is None else pytree.keystr(r_path)
                for layout in LAYOUTS:
                    if r_path is None and layout != "expanded_write":
                        continue
                    lay = _layout(layout, tuple(w.shape), tuple(r.shape))
                    if lay is None:
                        yield variant, i, rname, layout, None
                        continue
                    w_spec, r_spec, n = lay
                    yield variant, i, rname, layout, _Call(fn, call, w_path, r_path, w, r, w_spec, r_spec, n,
                                                          variant == "out", name in CPU_ARGS)


def ops_with_writes(patterns: list[str] | None = None) -> list[Any]:
    """The op_db entries with an in-place or out= variant (matching a glob of `patterns` if given)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if (op.inplace_variant is not None or op.supports_out) and op_key(op) not in SKIP]
    if patterns:
        ops = [op for op in ops if any(fnmatch.fnmatchcase(op_key(op), p) for p in patterns)]
    return ops


def check(op: Any, k: int = 1) -> list[Case]:
    """The matrix of one op: every case, with CPU's and neuron's outcome."""
    name = op_key(op)
    dtype = pick_dtype(op)
    if dtype is None:
        return []
    cases: list[Case] = []
    try:
        calls = list(_calls(op, dtype, k))
    except Exception as e:  # noqa: BLE001 - the OpInfo's own samples fail: nothing to compare
        return [Case(name, "-", 0, "-", "-", "skip", detail=f"samples: {type(e).__name__}: {e}"[:200])]
    for variant, i, rname, layout, c in calls:
        case = Case(name, variant, i, rname, layout)
        cases.append(case)
        if c is None:
            case.outcome = "skip"
            continue
        first, cpu = c.run("cpu", apart=False), c.run("cpu", apart=False)
        case.cpu = cpu[0]
        if first[0] != cpu[0] or cpu[0] == "ok" and _same(first[1], cpu[1]):
            # CPU's own result is not one (its kernel's order through memory it writes varies): the
            # outcome is compared, values are not.
            case.outcome, case.detail = "agree", "CPU varies"
            got = [c.run(DEVICE, apart=False)]
            if got[0][0] != cpu[0] and got[0][0] != first[0]:
                case.outcome, case.detail = "disagree", f"neuron {got[0][0]}, CPU {cpu[0]} and {first[0]}"
            case.neuron = got[0][0]
            continue
        try:
            apart = c.run(DEVICE, apart=True)  # the key's executable exists before the overlapping calls
            got = [c.run(DEVICE, apart=False) for _ in range(2)]
        except Exception as e:  # noqa: BLE001 - a crash of the harness is a disagreement too
            apart, got = ("error", ""), [("error", f"{type(e).__name__}: {e}"[:300])]
        case.neuron = got[-1][0]
        why = ""
        for g in got:
            if g[0] != cpu[0]:
                why = f"neuron {g[0]} ({g[1] if g[0] != 'ok' else ''}), CPU {cpu[0]} " \
                      f"({cpu[1] if cpu[0] != 'ok' else ''})"
                break
            if g[0] == "ok":
                why = _same(g[1], cpu[1])
                if why:
                    break
        case.outcome = "disagree" if why else "agree"
        case.detail = why
        if why:
            alone = c.run("cpu", apart=True)
            if apart[0] != alone[0] or apart[0] == "ok" and _same(apart[1], alone[1]):
                # The call disagrees with CPU on tensors of their own too: not a matter of overlap (an op's
                # in-place variant on this sample), reported apart.
                case.outcome = "apart"
        if not why and cpu[0] == "raises" and got[-1][1] != cpu[1]:
            case.detail = f"other message: {got[-1][1]} (CPU: {cpu[1]})"
    return cases


def summary(cases: list[Case]) -> dict[str, Any]:
    run = [c for c in cases if c.outcome in ("agree", "disagree", "apart")]
    return {
        "cases": len(run),
        "ops": len({c.op for c in run}),
        "cpu_raises": sum(c.cpu == "raises" for c in run),
        "agree": sum(c.outcome == "agree" for c in run),
        "disagree": sum(c.outcome == "disagree" for c in run),
        "disagree_without_overlap": sum(c.outcome == "apart" for c in cases),
        "other_message": sum(c.outcome == "agree" and c.detail.startswith("other message") for c in run),
        "cpu_varies": sum(c.detail == "CPU varies" for c in run),
        "by_layout": {lay: {"cases": sum(c.layout == lay for c in run),
                            "cpu_raises": sum(c.layout == lay and c.cpu == "raises" for c in run),
                            "disagree": sum(c.layout == lay and c.outcome == "disagree" for c in run)}
                      for lay in LAYOUTS},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neuron_runtime.conformance._overlap", description=__doc__)
    p.add_argument("--samples", type=int, default=2, help="samples per op (default 2)")
    p.add_argument("--ops", action="append", help="glob(s) of op names (comma-separated)")
    p.add_argument("--out", help="write every case as JSON here")
    a = p.parse_args(argv)
    pats = [x for pat in a.ops or [] for x in pat.split(",") if x] or None
    t0 = time.monotonic()
    ops = ops_with_writes(pats)
    cases: list[Case] = []
    for n, op in enumerate(ops):
        cs = check(op, a.samples)
        cases += cs
        bad = [c for c in cs if c.outcome in ("disagree", "apart")]
        print(f"[{n + 1}/{len(ops)}] {op_key(op)}: {sum(c.outcome != 'skip' for c in cs)} cases, "
              f"{len(bad)} disagree", file=sys.stderr, flush=True)
        for c in bad:
            print(f"    {c.variant} sample {c.sample} {c.reader} {c.layout}: {c.detail}"
                  f"{' (also without overlap)' if c.outcome == 'apart' else ''}", file=sys.stderr)
    s = summary(cases)
    s["seconds"] = round(time.monotonic() - t0, 1)
    s["torch"] = torch.__version__
    print(json.dumps(s, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": s, "cases": [dataclasses.asdict(c) for c in cases]}, f, indent=0)
    return 1 if s["disagree"] else 0


if __name__ == "__main__":
    sys.exit(main())
