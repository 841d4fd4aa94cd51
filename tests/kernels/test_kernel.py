"""`neuron_runtime.kernel`: a typed function of torch ops as an operator, one executable per call on
neuron (reference tier), inside torch.compile graphs, under autocast and in the profiler."""

from __future__ import annotations

import json
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime.aten import _runtime
from neuron_runtime.compiler._reference import ReferenceCompiler
from neuron_runtime.kernels import KernelError, kernel
from rt_helpers import run_python

DEV = "neuron"


@neuron_runtime.kernel("mylib::swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _executions() -> int:
    return int(neuron_runtime.stats()["executions"])


def _inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    return g, u, g.to(DEV).requires_grad_(), u.to(DEV).requires_grad_()


def test_swiglu_equals_cpu_with_one_launch_forward_and_one_backward(fresh_runtime: _runtime.Runtime) -> None:
    g, u, gn, un = _inputs()
    g.requires_grad_(), u.requires_grad_()
    want = swiglu(g, u)
    go = torch.randn(4, 8)
    want_grads = torch.autograd.grad(want, [g, u], go)
    # The composition on CPU gives the same (the CPU implementation is the body itself).
    torch.testing.assert_close(want, torch.nn.functional.silu(g) * u)
    for _ in range(2):  # the first call compiles, the second hits: one launch each time
        before = _executions()
        out = swiglu(gn, un)
        assert _executions() - before == 1
        god = go.to(DEV)
        before = _executions()
        grads = torch.autograd.grad(out, [gn, un], god)
        assert _executions() - before == 1  # the backward is one kernel too (the body's VJP)
    assert out.device.type == DEV
    before = _executions()  # through the dispatcher (torch.ops), as a plain call skips it
    via_op = torch.ops.mylib.swiglu(gn, un)
    torch.autograd.grad(via_op, [gn, un], god)
    assert _executions() - before == 2
    torch.testing.assert_close(via_op.cpu(), want.detach())
    torch.testing.assert_close(out.cpu(), want.detach())
    for got, w in zip(grads, want_grads):
        torch.testing.assert_close(got.cpu(), w)
    assert neuron_runtime.stats()["graphs"]["graphs_refused"] == 0


def test_inside_torch_compile_no_graph_break_and_one_graph(fresh_runtime: _runtime.Runtime) -> None:
    g, u, gn, un = _inputs()

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (swiglu(a * 2, b) * 2).sum()  # on a tensor the graph computes, too

    assert torch._dynamo.explain(f)(gn, un).graph_break_count == 0
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused graph (the kernel left as a foreign node) would warn
        loss = torch.compile(f, backend="neuron")(gn, un)
        loss.backward()
    ref_g, ref_u = g.clone().requires_grad_(), u.clone().requires_grad_()
    want = f(ref_g, ref_u)
    want.backward()
    torch.testing.assert_close(loss.cpu(), want.detach())
    torch.testing.assert_close(gn.grad.cpu(), ref_g.grad)
    graphs = neuron_runtime.stats()["graphs"]
    assert graphs["graphs_refused"] == 0 and graphs["graph_eager_runs"] == 0 and graphs["graph_executions"] >= 2


def test_autocast_and_profiler(fresh_runtime: _runtime.Runtime) -> None:
    g, u, gn, un = _inputs()
    with torch.autocast(DEV, dtype=torch.bfloat16):
        out = swiglu(gn @ gn.T, un @ un.T)  # bf16 matmuls feed the kernel
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = swiglu(g @ g.T, u @ u.T)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), want)
    with torch.profiler.profile() as prof:
        for _ in range(3):
            swiglu(gn, un)
    names = [e.name for e in prof.events()]
    assert names.count("mylib::swiglu") == 3, sorted(set(names))


def test_a_kernel_is_recorded_for_warm_and_keyed_by_shape(fresh_runtime: _runtime.Runtime, tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("TORCH_NEURONX_RECORD_FILE", str(record))
    neuron_runtime.reset()
    _, _, gn, un = _inputs()
    swiglu(gn.detach(), un.detach())
    swiglu(gn.detach()[:2], un.detach()[:2])  # another shape: another key of the same class
    sigs = [json.loads(line) for line in record.read_text().splitlines()]
    ops = [s["signature"]["op"] if "signature" in s else s["op"] for s in sigs]
    assert ops.count("graph:kernel:mylib::swiglu") >= 1, ops
    from neuron_runtime.executables import read_records

    assert any(s["op"] == "graph:kernel:mylib::swiglu" for s in read_records(str(record)))


def test_bad_kernels_get_named_errors(fresh_runtime: _runtime.Runtime) -> None:
    @kernel("mylib_bad::typo")
    def typo(x: torch.Tensor) -> torch.Tensor:
        return x.not_a_method()  # the line the error names

    with pytest.raises(KernelError, match=r"kernel mylib_bad::typo: AttributeError.*test_kernel.py:\d+: "
                                          r"return x.not_a_method\(\)"):
        typo(torch.ones(2, device=DEV))
    with pytest.raises(KernelError, match="name it 'namespace::name'"):
        kernel("nonamespace")(lambda x: x)

    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(KernelError, match="kernel mylib_bad::untyped"):
        kernel("mylib_bad::untyped")(untyped)


class _WrongCompiler(ReferenceCompiler):
    """The reference tier with a miscompiled kernel graph: what a compiler bug looks like to the runtime."""

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "test": "wrong kernels"}

    def load(self, payload: bytes) -> Any:
        exe = super().load(payload)

        def wrong(tensors: Any, scalars: Any) -> Any:
            return [o + 1 for o in exe(tensors, scalars)]
        return wrong


def test_a_kernel_whose_executable_differs_from_its_body_is_refused(fresh_runtime: _runtime.Runtime) -> None:
    fresh_runtime.set_compiler(_WrongCompiler())
    _, _, gn, un = _inputs()
    with pytest.raises(KernelError, match=r"kernel mylib::swiglu: output 0 .* differs from its own body on CPU"):
        swiglu(gn.detach(), un.detach())


CHILD = textwrap.dedent("""
    import json, torch, neuron_runtime

    @neuron_runtime.kernel("mylib::swiglu")
    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate) * up

    torch.manual_seed(0)
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    out = swiglu(g.to("neuron"), u.to("neuron"))
    assert torch.allclose(out.cpu(), torch.nn.functional.silu(g) * u)
    s = neuron_runtime.stats()
    print(json.dumps({"compiles": s["compiles"], "executions": s["executions"]}))
""")


def test_a_second_process_computes_it_with_zero_compiles(fresh_runtime: _runtime.Runtime, tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "fleet"))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local-parent"))
    neuron_runtime.reset()
    _, _, gn, un = _inputs()
    swiglu(gn.detach(), un.detach())
    assert neuron_runtime.stats()["compiles"] >= 1
    r = run_python(CHILD, env={"TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "local-child")}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"compiles": 0, "executions": 1}

