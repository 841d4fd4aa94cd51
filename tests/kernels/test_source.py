"""Kernel source (`neuron_runtime.kernel(name, source=CPP)`): C++ over the tensors' data, sizes and
strides, compiled by the tier's host compiler (one small g++ run), cached, checked against the reference
body, with named errors."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime.aten import _runtime
from neuron_runtime.kernels import KernelError

DEV = "neuron"

AXPY = r"""
void kernel(const nr_tensor* in, nr_tensor* out, const double* scalars) {
  const float* x = in[0].ptr<float>();
  const float* y = in[1].ptr<float>();
  float* o = out[0].ptr<float>();
  const float a = static_cast<float>(scalars[0]);
  for (int64_t i = 0; i < in[0].numel; ++i)
    o[i] = a * x[i * in[0].strides[0]] + y[i * in[1].strides[0]];
}
"""


@neuron_runtime.kernel("mylib_src::axpy", source=AXPY)
def axpy(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    return a * x + y


@neuron_runtime.kernel("mylib_src::axpy_wrong", source=AXPY)
def axpy_wrong(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    return a * x - y  # a reference body the source does not compute


@neuron_runtime.kernel("mylib_src::broken", source="void kernel(const nr_tensor* in, nr_tensor* out,\n"
                                                   "            const double* s) {\n  int n = ;\n}\n")
def broken(x: torch.Tensor) -> torch.Tensor:
    return x


def _count(key: str) -> int:
    return int(neuron_runtime.stats()[key])


def test_source_kernel_equals_cpu_one_launch_cached_recorded_and_checked(
        fresh_runtime: _runtime.Runtime, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("TORCH_NEURONX_RECORD_FILE", str(record))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    neuron_runtime.reset()
    torch.manual_seed(0)
    x, y = torch.randn(64), torch.randn(128)[::2]  # a strided input: the ABI passes strides
    xn, yn = x.to(DEV), y.to(DEV)
    for a in (2.0, -0.5):  # a number argument is a run-time scalar: one compile serves both
        before = _count("executions")
        out = axpy(xn, yn, a)
        assert _count("executions") - before == 1
        torch.testing.assert_close(out.cpu(), a * x + y)
    assert _count("compiles") == 1
    # Another shape is the same artifact (the signature holds dtypes and ranks, not sizes).
    torch.testing.assert_close(axpy(xn[:10], yn[:10], 2.0).cpu(), 2.0 * x[:10] + y[:10])
    assert _count("compiles") == 1
    sigs = [json.loads(line) for line in record.read_text().splitlines()]
    assert any((s.get("signature") or s).get("op") == "source:mylib_src::axpy" for s in sigs), sigs
    from neuron_runtime.executables import read_records  # what `neuron-cache warm` compiles

    assert any(s["op"] == "source:mylib_src::axpy" for s in read_records(str(record)))
    # A fresh runtime over the same local cache (what a second process sees): 0 compiles.
    neuron_runtime.reset()
    torch.testing.assert_close(axpy(xn, yn, 2.0).cpu(), 2.0 * x + y)
    assert _count("compiles") == 0
    # Gradients from the reference body's VJP.
    xr = xn.clone().requires_grad_()
    axpy(xr, yn, 3.0).sum().backward()
    torch.testing.assert_close(xr.grad.cpu(), torch.full((64,), 3.0))
    # The same source against a reference body it does not compute: refused, naming the kernel.
    with pytest.raises(KernelError, match=r"kernel mylib_src::axpy_wrong: output 0 .* differs from its "
                                          r"reference body on CPU"):
        axpy_wrong(xn, yn, 2.0)
    # A compile error names the kernel and the line of its own text (g++'s message).
    with pytest.raises(KernelError, match=r"kernel mylib_src::broken: its source does not compile:"
                                          r"[\s\S]*mylib_src::broken:3:\d+: error"):
        broken(xn)


def _launches() -> int:
    """Executables run: ops and kernels (`executions`) and torch.compile graphs (`graph_executions`)."""
    s = neuron_runtime.stats()
    return int(s["executions"] + s["graphs"]["graph_executions"])


def _around_two_kernels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = axpy(a * 2, b, 3.0).relu()      # partition 0 (mul) | axpy | partition 1 (relu)
    return (axpy(h, b, 0.5) * 2).sum()  # axpy | partition 2 (mul, sum)


@pytest.mark.parametrize("tier", ["reference", pytest.param("aoti", marks=pytest.mark.aoti)])
def test_a_graph_calling_source_kernels_compiles_around_them(fresh_runtime: _runtime.Runtime, tmp_path: Any,
                                                              tier: str) -> None:
    if tier == "aoti":
        from neuron_runtime.compiler._aoti import AotiCompiler

        fresh_runtime.set_compiler(AotiCompiler(local_cache_dir=str(tmp_path / "aoti")))
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = torch.randn(64), torch.randn(64)
    xn, yn = x.to(DEV).requires_grad_(), y.to(DEV)
    assert torch._dynamo.explain(_around_two_kernels)(xn, yn).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(_around_two_kernels, backend="neuron")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron:")  # a graph refused and run op by op warns
        loss = compiled(xn, yn)
        loss.backward()
        with torch.no_grad():
            compiled(xn.detach(), yn)  # the inference graph: compiled on its first call
            before = _launches()
            got = compiled(xn.detach(), yn)
            launches = _launches() - before
    xr = x.clone().requires_grad_()
    want = _around_two_kernels(xr, y)
    want.backward()
    torch.testing.assert_close(loss.cpu(), want.detach())
    torch.testing.assert_close(got.cpu(), want.detach())
    torch.testing.assert_close(xn.grad.cpu(), xr.grad)
    # 3 compiled partitions + 2 kernel launches (op by op: 6, one per op).
    assert launches == 3 + 2
    g = neuron_runtime.stats()["graphs"]
    assert g["graphs_refused"] == 0 and g["graph_eager_runs"] == 0
    torch._dynamo.reset()
