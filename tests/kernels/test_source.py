"""Kernel source (`neuron_runtime.kernel(name, source=CPP)`): C++ over the tensors' data, sizes and
strides, compiled by the tier's host compiler (one small g++ run), cached, checked against the reference
body, with named errors."""

from __future__ import annotations

import json
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
