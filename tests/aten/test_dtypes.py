"""Dtypes CUDA computes and the host CPU kernel lacks (`_widen`), and writes that cross devices or dtypes.

Each widened result is compared with CPU computed in the wider dtype and cast to the dtype CUDA returns;
each runs twice (the second call takes the widening remembered for its key)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import neuron_runtime

DEV = "neuron"


def _twice(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return [fn(*[t.to(DEV) for t in inputs]) for _ in range(2)]


def test_histc_on_int32_as_a_router_computes_it() -> None:
    # A mixture-of-experts router counts tokens per expert: CUDA's histc takes int32, CPU's does not.
    experts = torch.randint(0, 8, (64,), dtype=torch.int32)
    want = torch.histc(experts.double(), bins=8, min=0, max=7).to(torch.int32)
    for got in _twice(lambda e: torch.histc(e, bins=8, min=0, max=7), experts):
        assert got.device.type == DEV and got.dtype == torch.int32
        assert torch.equal(got.cpu(), want)
    widened = neuron_runtime.stats()["widened_ops"]
    assert "int32 -> int64" in widened["aten::histc"] and "int64 -> float64" in widened["aten::histc"]
    assert "aten::histc" not in neuron_runtime.fallback_ops()


def test_bool_abs_and_trace_follow_cuda() -> None:
    mask = torch.tensor([True, False, True])
    for got in _twice(torch.abs, mask):
        assert got.dtype == torch.bool and torch.equal(got.cpu(), mask)
    eye = torch.eye(4, dtype=torch.bool)
    for got in _twice(torch.trace, eye):
        assert got.dtype == torch.int64 and int(got.cpu()) == 4  # CUDA sums bool as int64
    # A composite built on abs (softsign = x / (1 + |x|)) gets float32 as on CUDA.
    got = F.softsign(mask.to(DEV))
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), torch.tensor([0.5, 0.0, 0.5]))


def test_complex32_computes_in_complex64() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        x = torch.randn(16, dtype=torch.complex64).to(torch.complex32)
        for fn, want_dtype in ((torch.exp, torch.complex32), (torch.angle, torch.float16),
                               (lambda t: torch.sum(t, 0), torch.complex32)):
            want = fn(x.to(torch.complex64)).to(want_dtype)
            for got in _twice(fn, x):
                assert got.dtype == want_dtype
                torch.testing.assert_close(got.cpu().to(torch.complex64 if got.is_complex() else torch.float32),
                                           want.to(torch.complex64 if want.is_complex() else torch.float32),
                                           rtol=2e-2, atol=2e-2)


def test_half_pooling_and_its_backward() -> None:
    x = torch.randn(1, 2, 4, 4, 4)
    want = F.avg_pool3d(x, 2)
    for dtype in (torch.float16, torch.bfloat16):
        d = x.to(dtype).to(DEV).requires_grad_()
        got = F.avg_pool3d(d, 2)
        assert got.dtype == dtype
        torch.testing.assert_close(got.detach().cpu().float(), want, rtol=2e-2, atol=2e-2)
        (g,) = torch.autograd.grad(got.sum(), d)
        assert g.dtype == dtype and torch.allclose(g.cpu().float(), torch.full_like(x, 1 / 8), atol=1e-3)


def test_half_fft_forward_and_backward() -> None:
    # ATen's fft composites refuse float16 off CUDA before any kernel runs; CUDA returns complex32.
    x = torch.randn(16)
    want = torch.fft.rfft(x)
    d = x.half().to(DEV).requires_grad_()
    got = torch.fft.rfft(d)
    assert got.dtype == torch.complex32
    torch.testing.assert_close(got.detach().cpu().to(torch.complex64), want, rtol=2e-2, atol=2e-2)
    (g,) = torch.autograd.grad(got.abs().sum(), d)
    assert g.dtype == torch.float16
    # float32 still runs the composite, with autograd.
    f = x.to(DEV).requires_grad_()
    torch.testing.assert_close(torch.fft.fft(f).detach().cpu(), torch.fft.fft(x))
    assert "aten::fft_rfft" in neuron_runtime.stats()["widened_ops"]


def test_complex_nansum_is_cuda_s_definition() -> None:
    c = torch.tensor([1 + 1j, complex(float("nan"), 0), 2 - 1j, complex(0, float("nan"))], dtype=torch.complex64)
    for dtype in (torch.complex64, torch.complex128):
        got = torch.nansum(c.to(dtype).to(DEV))
        assert got.dtype == dtype and complex(got.cpu()) == 3 + 0j
        assert complex(torch.nanmean(c.to(dtype).to(DEV)).cpu()) == 1.5 + 0j


def test_int64_beyond_float64_exactness_is_warned() -> None:
    big = torch.tensor([2 ** 60, 1, 2], dtype=torch.int64)
    with pytest.warns(UserWarning, match="exceed 2\\*\\*53"):
        torch.histc(big.to(DEV), bins=2, min=0, max=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.histc(torch.tensor([1, 2, 3]).to(DEV), bins=2, min=0, max=4)  # small values: no warning


def test_dtype_neither_cuda_nor_cpu_has_keeps_the_error() -> None:
    # float8 arithmetic has no kernel on CUDA or CPU: never widened, the same "not implemented" error.
    x = torch.zeros(4).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float8_e4m3fn'") as cpu:
        torch.exp(x)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float8_e4m3fn'") as dev:
        torch.exp(x.to(DEV))
    assert str(dev.value) == str(cpu.value)
    # bool subtraction: refused before any kernel on every device.
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with two bool tensors"):
        torch.sub(torch.ones(2, dtype=torch.bool).to(DEV), torch.ones(2, dtype=torch.bool).to(DEV))


@pytest.mark.parametrize("cpu_out", [torch.zeros(3), torch.zeros(())], ids=["cpu", "cpu-0d"])
def test_out_on_the_cpu_raises_and_writes_nothing(cpu_out: torch.Tensor) -> None:
    a, b = torch.randn(3).to(DEV), torch.randn(3).to(DEV)
    before = cpu_out.clone()
    for _ in range(2):  # the first call (slow path) and a hit
        with pytest.raises(RuntimeError, match="Expected out tensor to have device neuron:0, but got cpu instead"):
            if cpu_out.dim():
                torch.add(a, b, out=cpu_out)
            else:
                torch.sum(a, 0, out=cpu_out)
        assert torch.equal(cpu_out, before)


def test_inplace_into_a_cpu_tensor_raises() -> None:
    a = torch.randn(3).to(DEV)
    torch.zeros(3).to(DEV).add_(a)  # warm the key: the next calls are hits for a neuron self
    for cpu in (torch.zeros(3), torch.zeros(())):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            cpu.add_(a.sum() if cpu.dim() == 0 else a)
        assert not cpu.any()


def test_out_of_another_dtype_follows_pytorch() -> None:
    a = torch.randn(2, 2)
    d = a.to(DEV)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
            torch.add(d, d, out=torch.empty(2, 2, dtype=torch.int64).to(DEV))
        with pytest.raises(RuntimeError, match="dtype"):
            torch.mm(d, d, out=torch.empty(2, 2, dtype=torch.float64).to(DEV))  # mm wants the exact dtype
        # Widening casts are allowed; reductions compute in the out dtype, as CPU does.
        o = torch.empty(2, 2, dtype=torch.float64).to(DEV)
        torch.add(d, d, out=o)
        assert torch.equal(o.cpu(), torch.add(a, a).double())
        s = torch.empty(2, dtype=torch.int64).to(DEV)
        torch.sum(d * 3, 0, out=s)
        assert torch.equal(s.cpu(), torch.sum(a * 3, 0, out=torch.empty(2, dtype=torch.int64)))
