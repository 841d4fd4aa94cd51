"""Regressions found by the op_db sweep (`python -m neuron_runtime.conformance`): one focused test per fix.

Each test runs the op twice where it matters: the first call takes the slow path, the second the hit path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rt_helpers import assert_same

import neuron_runtime
from neuron_runtime.aten import _runtime
from neuron_runtime.signatures import _ops

DEV = "neuron"


def test_efficientzerotensor_is_real_zeros() -> None:
    # sgn's backward on a real input is `_efficientzerotensor`: CPU's ZeroTensor has a null data pointer,
    # which crashed the first read once relabelled to neuron.
    x = torch.randn(4, 5, device=DEV, requires_grad=True)
    for _ in range(2):
        (g,) = torch.autograd.grad(torch.sgn(x), x, torch.ones(4, 5, device=DEV))
        assert g.device.type == DEV and g.data_ptr() != 0
        assert torch.equal(g.cpu(), torch.zeros(4, 5))
    z = torch.ops.aten._efficientzerotensor([2, 3], dtype=torch.float32, device=DEV)
    assert z.device.type == DEV and torch.equal(z.cpu(), torch.zeros(2, 3))


def test_undefined_outputs_stay_none() -> None:
    # native_layer_norm_backward with output_mask [True, False, False] returns undefined tensors (None).
    x = torch.randn(3, 4)
    w, b = torch.randn(4), torch.randn(4)
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [4], w, b, 1e-5)
    g = torch.randn(3, 4)
    want = torch.ops.aten.native_layer_norm_backward(g, x, [4], mean, rstd, w, b, [True, False, False])
    d = [t.to(DEV) for t in (g, x, mean, rstd, w, b)]
    for _ in range(2):
        got = torch.ops.aten.native_layer_norm_backward(d[0], d[1], [4], d[2], d[3], d[4], d[5],
                                                        [True, False, False])
        assert got[1] is None and got[2] is None
        assert_same(want[0], got[0])


def test_argument_named_like_a_kernel_global() -> None:
    # native_group_norm has an argument `N`, which shadowed the generated kernel's counter on the hit path.
    x, w, b = torch.randn(2, 6, 3), torch.randn(6), torch.randn(6)
    want = F.group_norm(x, 3, w, b)
    for _ in range(3):
        assert_same(want, F.group_norm(x.to(DEV), 3, w.to(DEV), b.to(DEV)))


def test_wrapped_number_in_a_tensor_slot() -> None:
    # take_along_dim calls remainder(Tensor, wrapped number) from C++; the host call must take the Scalar
    # overload (calling remainder.Tensor with a Python int is refused).
    x = torch.arange(12.0).reshape(3, 4)
    i = torch.tensor([[0, -1], [1, 2], [3, -2]])
    want = torch.take_along_dim(x, i, dim=1)
    for _ in range(2):
        assert_same(want, torch.take_along_dim(x.to(DEV), i.to(DEV), dim=1))


def test_mode_out() -> None:
    # mode.values has no CPU kernel, and its composite kernel refuses every device but CPU/CUDA/XPU.
    x = torch.randint(0, 3, (4, 5)).float()
    want = torch.mode(x, 1)
    for _ in range(2):
        v, i = torch.empty(0, device=DEV), torch.empty(0, dtype=torch.long, device=DEV)
        got = torch.mode(x.to(DEV), 1, out=(v, i))
        assert got[0] is v and got[1] is i
        assert_same(want.values, v)
        assert_same(want.indices, i)


def test_inplace_ops_with_renamed_functional_variant() -> None:
    for q in _ops.FUNCTIONAL:
        assert _ops.classify(q).kind == "mutating", q
    x = torch.rand(5) + 0.5
    d = x.to(DEV)
    before = neuron_runtime.stats()["host_ops"]
    for _ in range(2):
        d.pow_(2.0)
        d.floor_divide_(torch.full((5,), 0.5, device=DEV))
    x.pow_(2.0).floor_divide_(torch.full((5,), 0.5))
    x.pow_(2.0).floor_divide_(torch.full((5,), 0.5))
    assert_same(x, d)
    assert neuron_runtime.stats()["host_ops"] == before


def _half_vs_float(fn, *inputs: torch.Tensor, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """`fn` on neuron with `dtype` inputs equals CPU float32 cast to `dtype` (CPU itself refuses `dtype`)."""
    torch.manual_seed(0)
    want = fn(*[t.float() if t.is_floating_point() else t for t in inputs])
    for _ in range(2):
        torch.manual_seed(0)
        got = fn(*[t.to(dtype).to(DEV) if t.is_floating_point() else t.to(DEV) for t in inputs])
        assert got.dtype == dtype and got.device.type == DEV
        torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), rtol=2e-2, atol=2e-2)


def test_accelerator_only_half_dtypes() -> None:
    x5 = torch.randn(1, 2, 4, 4, 4)
    x4 = torch.randn(1, 2, 6, 6)
    scores, target = torch.randn(4, 5), torch.tensor([0, 3, 1, 4])
    ml_target = torch.tensor([[3, 0, -1, 1, 2], [1, -1, 0, 0, 0], [0, 2, -1, 0, 0], [4, -1, 0, 0, 0]])
    for dtype in (torch.float16, torch.bfloat16):
        _half_vs_float(lambda x: F.avg_pool3d(x, 2), x5, dtype=dtype)
        _half_vs_float(lambda x: F.interpolate(x, size=(3, 3), mode="bilinear", antialias=True), x4, dtype=dtype)
        _half_vs_float(lambda s, t: F.multi_margin_loss(s, t), scores, target, dtype=dtype)
        _half_vs_float(lambda s, t: F.multilabel_margin_loss(s, t), scores, ml_target, dtype=dtype)
    _half_vs_float(lambda x: F.rrelu(x, training=True), torch.randn(20), dtype=torch.float16)


def test_accelerator_only_half_backward() -> None:
    x = torch.randn(1, 2, 4, 4, 4)
    want = torch.autograd.grad(F.avg_pool3d(x.requires_grad_(), 2).sum(), x)[0]
    d = x.detach().half().to(DEV).requires_grad_()
    got = torch.autograd.grad(F.avg_pool3d(d, 2).sum(), d)[0]
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu().float(), want, rtol=1e-2, atol=1e-2)


def test_training_batch_norm_compiles_and_updates_running_stats() -> None:
    # _native_batch_norm_legit / _batch_norm_with_update mutate the running stats and return fresh tensors:
    # they ran on the host; now their *_functional twins compile and the stats are copied back.
    torch.manual_seed(0)
    cpu = torch.nn.BatchNorm2d(3)
    dev = torch.nn.BatchNorm2d(3).to(DEV)
    x = torch.randn(4, 3, 5, 5)
    before = neuron_runtime.stats()["host_ops"]
    for _ in range(2):
        want = cpu(x)
        got = dev(x.to(DEV))
        assert_same(want, got, rtol=1e-5, atol=1e-5)
    assert_same(cpu.running_mean, dev.running_mean)
    assert_same(cpu.running_var, dev.running_var)
    assert int(dev.num_batches_tracked.cpu()) == 2
    assert neuron_runtime.stats()["host_ops"] == before
    for q in ("aten::_native_batch_norm_legit", "aten::_batch_norm_with_update"):
        m, v = torch.zeros(3), torch.ones(3)
        want = getattr(torch.ops.aten, q.removeprefix("aten::"))(x, None, None, m, v, *((True,) if "legit" in q else ()), 0.1, 1e-5)
        dm, dv = torch.zeros(3, device=DEV), torch.ones(3, device=DEV)
        got = getattr(torch.ops.aten, q.removeprefix("aten::"))(x.to(DEV), None, None, dm, dv, *((True,) if "legit" in q else ()), 0.1, 1e-5)
        assert_same(list(want), list(got), rtol=1e-5, atol=1e-5)
        assert_same(m, dm)
        assert_same(v, dv)


def test_conjugate_and_negative_bits() -> None:
    # x.conj() and x.conj().imag are lazy views (conj/neg bit). Copying one between neuron tensors goes
    # through `_copy_from`, which PyTorch's conjugate fallback used to materialise by recursing into
    # clone -> copy_ -> _copy_from until the C stack overflowed (SIGSEGV: polar, fft.ifft, linalg.eigvals).
    torch.manual_seed(0)
    x = torch.randn(5, dtype=torch.cfloat)
    c = x.to(DEV).conj()
    assert c.is_conj()
    assert_same(x.conj().clone(), c.clone())
    assert_same(x.conj().resolve_conj(), c.resolve_conj())
    assert_same(x.conj() * 2, c * 2)
    assert_same(x.conj().imag.clone(), c.imag.clone())  # negative bit
    d = torch.zeros(5, dtype=torch.cfloat, device=DEV)
    d.copy_(c)
    assert_same(x.conj(), d)
    assert_same(x.conj(), x.conj().to(DEV))
    r, t = torch.rand(4), torch.rand(4)
    assert_same(torch.polar(r, t), torch.polar(r.to(DEV), t.to(DEV)))
    assert_same(torch.fft.ifft(r), torch.fft.ifft(r.to(DEV)))
    a = torch.randn(3, 3)
    torch.testing.assert_close(torch.linalg.eigvals(a.to(DEV)).cpu(), torch.linalg.eigvals(a))


def test_factories_with_out_compile() -> None:
    # arange/linspace/logspace/eye reach their `*.out` overload on every device (the functional factory is
    # `empty` + `*.out`): they used to fill `out` on the host; now the functional factory compiles.
    rt = _runtime.runtime()
    rt.host_ops.clear()
    for _ in range(2):  # slow path, then hit path
        assert_same(torch.arange(5), torch.arange(5, device=DEV))
        assert_same(torch.arange(0.5, 3.2, 0.3), torch.arange(0.5, 3.2, 0.3, device=DEV))
        assert_same(torch.linspace(0, 1, 7), torch.linspace(0, 1, 7, device=DEV))
        assert_same(torch.logspace(0, 1, 5, base=2), torch.logspace(0, 1, 5, base=2, device=DEV))
        assert_same(torch.eye(3, 4, dtype=torch.int32), torch.eye(3, 4, device=DEV, dtype=torch.int32))
        out = torch.empty(2, device=DEV)
        torch.arange(6, out=out)  # resized, as CPU's out= does
        assert_same(torch.arange(6.0), out)
    assert torch.equal(torch.arange(3, device=DEV), torch.arange(3, device=DEV))
    assert not torch.equal(torch.arange(3, device=DEV), torch.arange(1, 4, device=DEV))
    assert not torch.equal(torch.tensor([float("nan")], device=DEV), torch.tensor([float("nan")], device=DEV))
    assert torch.arange(3, device=DEV)[1].item() == 1
    assert not rt.host_ops, rt.host_ops


def test_scalars_that_decide_code_paths_are_keyed_by_value() -> None:
    # The aoti sweep found kernels that branch on a Scalar's value (export cannot guard on a run-time
    # value): those Scalars are keyed by value, so each value has its own executable.
    for qualname, arg in (("aten::lerp_.Scalar", "weight"), ("aten::_foreach_lerp_.Scalar", "weight"),
                          ("aten::norm.ScalarOpt_dim", "p"), ("aten::softshrink", "lambd"),
                          ("aten::multi_margin_loss", "margin"), ("aten::var_mean.correction", "correction"),
                          ("aten::arange.start_step", "end")):
        kinds = {a.name: a.kind for a in _ops.classify(qualname).args}
        assert kinds[arg] == _ops.VALUE, (qualname, kinds)
    assert {a.name: a.kind for a in _ops.classify("aten::add.Tensor").args}["alpha"] == _ops.SCALAR
    x = torch.randn(6)
    for lambd in (0.5, 0.25):  # two values, two executables, both right
        assert_same(F.softshrink(x, lambd), F.softshrink(x.to(DEV), lambd))


def test_conjugated_results_keep_their_bit_on_the_hit_path() -> None:
    # linalg_lu_solve(adjoint=True, left=False) returns a lazily conjugated view on CPU; relabelling it
    # to neuron dropped the conjugate bit, so every hit (native layer) returned conjugated values.
    torch.manual_seed(0)
    lu = torch.randn(3, 3, dtype=torch.complex64).mT + 3 * torch.eye(3)
    piv = torch.tensor([1, 2, 3], dtype=torch.int32)
    b = torch.randn(3, 4, dtype=torch.complex64).mT
    want = torch.linalg.lu_solve(lu, piv, b, adjoint=True, left=False)
    assert want.is_conj()
    for _ in range(3):
        got = torch.linalg.lu_solve(lu.to(DEV), piv.to(DEV), b.to(DEV), adjoint=True, left=False)
        assert got.is_conj()
        assert torch.equal(got.cpu().resolve_conj(), want.resolve_conj())
