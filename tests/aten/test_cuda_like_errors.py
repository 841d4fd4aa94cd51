"""What the upstream device-generic suites found (issue 33), one test per class: errors in CUDA's words,
the CPU index tensors CUDA accepts, and quantized tensors refused with one error at the boundary."""

from __future__ import annotations

import re

import pytest
import torch

from rt_helpers import DEV


@pytest.mark.parametrize("call", [
    lambda x, o: torch.nonzero(x, out=o.long()),   # CUDA: "expected self and out to be on the same device"
    lambda x, o: torch.add(x, x, out=o),           # CUDA (TensorIterator): "Expected all tensors to be on the same device"
    lambda x, o: torch.mm(x.view(3, 1), x.view(1, 3), out=o.view(1, 3).expand(3, 3).contiguous()),  # structured
], ids=["nonzero", "add", "mm"])
def test_out_on_another_device_reads_as_cuda(call) -> None:  # type: ignore[no-untyped-def]
    """Both of CUDA's phrasings are in the message, so code matching either one works; nothing written."""
    x = torch.tensor([1.0, 0.0, 2.0]).to(DEV)
    out = torch.zeros(3)
    for _ in range(2):  # the slow path, then a hit
        with pytest.raises(RuntimeError) as e:
            call(x, out)
        msg = str(e.value)
        assert re.search("on the same device", msg) and \
            re.search("Expected out tensor to have device neuron:0, but got cpu instead", msg), msg
    assert not out.any()


def test_out_dtype_refusal_uses_cpus_message() -> None:
    """Where torch's meta kernel words a refusal differently from the CPU/CUDA kernel, the user gets CPU's
    (the structured meta function CUDA shares), not the meta kernel's."""
    x = torch.tensor([1.0, float("inf")]).to(DEV)
    with pytest.raises(RuntimeError, match=r"^isposinf does not support non-boolean outputs\.$"):
        torch.isposinf(x, out=torch.empty(2).to(DEV))
    with pytest.raises(RuntimeError, match="Expected the dtype for input and out to match"):
        torch.amax(x, 0, out=torch.empty((), dtype=torch.int32).to(DEV))
    ok = torch.empty(2, dtype=torch.bool).to(DEV)
    torch.isposinf(x, out=ok)
    assert ok.cpu().tolist() == [False, True]


def test_narrow_copy_checks_its_arguments_as_cuda_does() -> None:
    x = torch.arange(10.0).view(2, 5).to(DEV)
    assert torch.equal(torch.narrow_copy(x, 1, 1, 2).cpu(), torch.narrow_copy(x.cpu(), 1, 1, 2))
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 3\)"):
        torch.narrow_copy(x, 3, 0, 1)
    with pytest.raises(RuntimeError, match=r"narrow\(\): length must be non-negative\."):
        torch.narrow_copy(x, 0, 0, -1)


def test_cpu_index_tensor_into_index_fill() -> None:
    """CUDA's index_fill_ takes a CPU index; other CPU tensors stay an error, as on CUDA."""
    idx = torch.tensor([1, 3])
    ref = torch.zeros(5).index_fill_(0, idx, 2.0)
    for _ in range(2):
        y = torch.zeros(5).to(DEV)
        assert y.index_fill_(0, idx, 2.0) is y
        assert torch.equal(y.cpu(), ref)
        assert torch.equal(torch.index_fill(torch.zeros(5).to(DEV), 0, index=idx, value=2.0).cpu(), ref)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.zeros(5).to(DEV).index_select(0, idx)  # CUDA refuses this one too


def test_quantized_tensors_are_refused_with_one_error() -> None:
    from neuron_runtime.aten._quantized import QuantizedTensorError

    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 10, torch.quint8)
    x = torch.randn(4).to(DEV)
    calls = [lambda: q.to(DEV), lambda: q.flatten().to(DEV),
             lambda: torch.quantize_per_tensor(x, 0.1, 10, torch.quint8),
             lambda: torch.quantize_per_channel(x.view(2, 2), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0,
                                                torch.qint8),
             lambda: torch.empty(3, dtype=torch.qint8, device=DEV)]
    for call in calls:
        with pytest.raises(QuantizedTensorError, match=r"neuron does not support quantized tensors .*dequantize"):
            call()
    # The supported way: dequantize on the host.
    assert torch.equal(q.dequantize().to(DEV).cpu(), q.dequantize())


def test_lazy_modules_materialise_on_neuron() -> None:
    """`.to()` under the parameter swap the runtime turns on keeps a lazy module's parameters and buffers
    uninitialized (on the new device and dtype) until its first forward, on neuron and on CPU alike."""
    for make, x in [(lambda: torch.nn.LazyLinear(3), torch.randn(2, 5)),
                    (lambda: torch.nn.LazyConv1d(4, 2), torch.randn(2, 3, 8)),
                    (lambda: torch.nn.LazyBatchNorm1d(), torch.randn(4, 5))]:
        torch.manual_seed(0)
        ref = make()
        expected = ref(x)
        torch.manual_seed(0)
        m = make().to(DEV)
        assert m.has_uninitialized_params()
        out = m(x.to(DEV))
        assert not any(torch.nn.parameter.is_lazy(p) for p in [*m.parameters(), *m.buffers()])
        assert all(p.device.type == "neuron" for p in [*m.parameters(), *m.buffers()])
        assert torch.allclose(out.cpu(), expected, atol=1e-6)
        assert make().to(torch.float64)(x.double()).dtype == torch.float64  # CPU conversions too
