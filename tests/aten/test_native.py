"""The native hit path (`neuron_runtime/_native`): it serves hits the Python kernels would serve, the same
way, and hands everything else to them."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

import neuron_runtime
from neuron_runtime import _native
from neuron_runtime._native import _hostmem
from neuron_runtime.aten import _runtime
from rt_helpers import DEV, assert_same, fresh_runtime, run_python, run_script

JOB = Path(__file__).resolve().parent.parent / "jobs" / "train_small.py"
_ = fresh_runtime

native = pytest.mark.skipif(_hostmem.NATIVE is None, reason=f"native layer not loaded: {_native.status()}")


def test_the_suite_runs_on_the_native_layer() -> None:
    # `make test` builds it: a suite that silently ran the Python path would test the wrong thing.
    assert _hostmem.NATIVE is not None, _native.status()
    assert _native.status().startswith("loaded")


@native
def test_the_native_build_is_keyed_by_its_compiler_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another set of flags is another build (a flag change alone once reused the old .so)."""
    from neuron_runtime._native import _build

    cxx = _build._compiler()
    before = _build._target(cxx)
    assert before == _build._target(cxx)
    monkeypatch.setattr(_build, "FLAGS", (*_build.FLAGS, "-mtls-dialect=gnu2"))
    assert _build._target(cxx) != before
    assert "-mtls-dialect=gnu2" in _build._command(cxx, "out.so")


def test_a_size_one_dims_stride_keys_no_new_native_entry(fresh_runtime: _runtime.Runtime) -> None:
    """Issue 43: a decode loop reads `ids[:, -1:]` of a buffer one column wider each token; the [1, 1]
    slice's size-1 dim has a new stride every time, which no kernel reads: the native entry serves them
    all (its key words are the signature's canonical strides), as it serves a channels_last guess apart."""
    def last(t: int) -> torch.Tensor:
        return torch.arange(t, dtype=torch.int64, device=DEV).reshape(1, t)[:, -1:]

    for t in (3, 4):  # the Python kernel compiles, then the native kernel learns the entry
        assert (last(t) + last(t)).cpu().item() == 2 * (t - 1)
    slices = [last(t) for t in range(5, 25)]
    before = _hostmem.NATIVE.executions()
    outs = [s + s for s in slices]
    assert _hostmem.NATIVE.executions() - before == len(slices)
    assert [o.cpu().item() for o in outs] == [2 * (t - 1) for t in range(5, 25)]


@native
def test_hits_run_natively_and_are_counted(fresh_runtime: _runtime.Runtime) -> None:
    a, b = torch.randn(64), torch.randn(64)
    na, nb = a.to(DEV), b.to(DEV)
    assert_same(a + b, na + nb)  # the op's first call: the Python kernel compiles
    assert_same(a + b, na + nb)  # the native kernel's first call: a miss, it learns the executable
    before = _hostmem.NATIVE.executions()
    for _ in range(10):
        out = na + nb
    assert _hostmem.NATIVE.executions() - before == 10
    assert_same(a + b, out)
    s = neuron_runtime.stats()
    assert s["loads"] == 1 and s["executions"] == 12 and s["hits"]["memory"] == 11


@native
def test_index_with_tensor_indices_runs_natively(fresh_runtime: _runtime.Runtime) -> None:
    """`index.Tensor` (a `Tensor?[]`: Hugging Face's attention masks index every decoded token) is served
    natively, Nones included, equal to CPU; an index out of range still raises CPU's error."""
    x, i, j = torch.randn(4, 6, 5), torch.tensor([0, 2, 3]), torch.tensor([1, 5, 0])
    xn, i_n, j_n = x.to(DEV), i.to(DEV), j.to(DEV)
    cases = [lambda a, p, q: a[p, q], lambda a, p, q: a[:, p], lambda a, p, q: a[p, :, q % 5]]
    for f in cases:
        for _ in range(2):  # the Python kernel's call, then the native kernel's miss, which learns it
            assert_same(f(x, i, j), f(xn, i_n, j_n))
        before = _hostmem.NATIVE.executions()
        out = f(xn, i_n, j_n)
        assert _hostmem.NATIVE.executions() - before >= 1
        assert_same(f(x, i, j), out)
    bad = torch.tensor([0, 7])
    for _ in range(3):
        with pytest.raises(IndexError, match="out of bounds"):
            xn[bad.to(DEV)]


@native
def test_reset_forgets_native_entries(fresh_runtime: _runtime.Runtime) -> None:
    x = torch.randn(8, device=DEV)
    torch.sin(x), torch.sin(x)
    rt = _runtime.reset_runtime()
    torch.sin(x)
    assert rt.stats()["loads"] == 1  # not served from the old runtime's table


@native
def test_native_hits_keep_device_semantics(fresh_runtime: _runtime.Runtime) -> None:
    for _ in range(3):  # first call: Python kernel; then native hits
        base_c = torch.arange(12.0).reshape(3, 4)
        base_n = base_c.to(DEV)
        v_c, v_n = base_c[1], base_n[1]  # a view (native view kernel) mutated in place (native hit)
        v_c.mul_(2).add_(1, alpha=3)
        r = v_n.mul_(2).add_(1, alpha=3)
        assert r is v_n and v_n._base is base_n
        assert_same(base_c, base_n)
        x_c = torch.randn(5, dtype=torch.float64)
        x_n = x_c.to(DEV)
        assert_same(x_c * 2, x_n * 2)                # wrapped numbers: int, float, bool, complex
        assert_same(x_c + 0.5, x_n + 0.5)
        assert_same(x_c * True, x_n * True)
        assert_same(x_c * 1j, x_n * 1j)
        assert_same(x_c.sum(dtype=torch.float32), x_n.sum(dtype=torch.float32))  # dtype argument
        assert_same(x_c.t().contiguous(), x_n.t().contiguous())
        assert_same(torch.max(x_c.reshape(5, 1), 1), torch.max(x_n.reshape(5, 1), 1))  # two outputs
        assert_same(x_c.to(torch.float16), x_n.to(torch.float16))


@native
def test_native_hits_on_tensor_lists(fresh_runtime: _runtime.Runtime) -> None:
    cs = [torch.randn(4, 3), torch.randn(5)]
    ns = [c.to(DEV) for c in cs]
    for _ in range(3):  # the third round is all hits: mul_, 2 (mul, add), addcdiv_, 2 mul, sqrt, cat
        before = _hostmem.NATIVE.executions()
        torch._foreach_mul_(cs, 0.5)                    # one list mutated, returns nothing
        torch._foreach_mul_(ns, 0.5)
        torch._foreach_addcdiv_(cs, cs, [c * c + 1 for c in cs], [0.1, 0.2])  # Scalar[] at run time
        torch._foreach_addcdiv_(ns, ns, [n * n + 1 for n in ns], [0.1, 0.2])
        assert_same(cs, ns)
        assert_same(torch._foreach_sqrt([c * c for c in cs]), torch._foreach_sqrt([n * n for n in ns]))
        assert_same(torch.cat([cs[0].flatten(), cs[1]]), torch.cat([ns[0].flatten(), ns[1]]))
    assert _hostmem.NATIVE.executions() - before == 10


@native
def test_the_device_guard_never_calls_python(fresh_runtime: _runtime.Runtime) -> None:
    import sys

    calls: list[str] = []

    def watch(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code.co_filename.endswith("_device.py"):
            calls.append(frame.f_code.co_name)

    w = torch.randn(4, 4, device=DEV, requires_grad=True)
    sys.setprofile(watch)
    try:
        (torch.relu(w @ w) * 2).sum().backward()  # autograd guards the device for every node
    finally:
        sys.setprofile(None)
    assert "type_" not in calls
    assert torch.accelerator.current_device_index() == 0 and torch.neuron.current_device() == 0
    torch.neuron.synchronize()
    torch.accelerator.synchronize()


@native
def test_errors_on_a_hit_are_the_users_errors(fresh_runtime: _runtime.Runtime) -> None:
    idx_ok = torch.tensor([0, 1], device=DEV)
    x = torch.randn(3, 4, device=DEV)
    for _ in range(2):
        torch.index_select(x, 0, idx_ok)
    bad = torch.tensor([0, 7], device=DEV)  # same key, out of range: raised by the hit's executable
    with pytest.raises(IndexError, match="out of range"):
        torch.index_select(x, 0, bad)
    assert_same(torch.index_select(x.cpu(), 0, idx_ok.cpu()), torch.index_select(x, 0, idx_ok))
    assert neuron_runtime.fallback_ops() == []


@native
def test_concurrent_hits(fresh_runtime: _runtime.Runtime) -> None:
    xs = [torch.randn(32) for _ in range(4)]
    expected = [torch.relu(x * 3 + 1) for x in xs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            x = xs[i].to(DEV)
            for _ in range(300):
                y = torch.relu(x * 3 + 1)
            torch.testing.assert_close(y.cpu(), expected[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_python_path_gives_the_same_training(tmp_path: Path) -> None:
    # The whole job with and without the native layer: same losses, same executables.
    results = {}
    for flag in ("1", "0"):
        out = tmp_path / f"native{flag}.json"
        r = run_script(str(JOB), env={"TORCH_NEURONX_NATIVE": flag, "TORCH_NEURONX_COMPILER": "reference",
                                      "JOB_STEPS": "5", "JOB_OUT": str(out),
                                      "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "cache")})
        assert r.returncode == 0, r.stderr
        results[flag] = json.loads(out.read_text())
    assert results["1"]["loss"] == results["0"]["loss"]
    assert results["1"]["keys"] == results["0"]["keys"]


def test_disabled_native_layer_is_reported() -> None:
    r = run_python("import json, torch\nfrom neuron_runtime import collect_env\nfrom neuron_runtime._native import _hostmem\n"
                   "print(json.dumps([_hostmem.NATIVE is None, collect_env.collect()['device']['native_hit_path']]))",
                   env={"TORCH_NEURONX_NATIVE": "0"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, "disabled by TORCH_NEURONX_NATIVE=0"]


def test_without_a_compiler_every_op_takes_the_python_path(tmp_path: Path) -> None:
    r = run_python("import torch, warnings\n"
                   "from neuron_runtime._native import _hostmem\n"
                   "x = torch.arange(4.0, device='neuron')\n"
                   "print(_hostmem.NATIVE is None, (x * 2 + 1).cpu().tolist())",
                   env={"CXX": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                        "TORCH_NEURONX_COMPILER": "reference"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "True [1.0, 3.0, 5.0, 7.0]"
    assert "native dispatch layer unavailable" in r.stderr and "TORCH_NEURONX_NATIVE=0" in r.stderr


@native
def test_to_copies_run_natively_with_to_semantics(fresh_runtime: _runtime.Runtime) -> None:
    """`.to()` between the host and neuron (and to another dtype or memory format) is served by the native
    layer without calling Python, with the results PyTorch gives on CPU; anything it does not serve (a
    neuron index that does not exist) still gets the Python kernel's error."""
    import sys

    x = torch.randn(2, 3, 4, 5)
    n = x.to(DEV)  # first call: loads the kernel
    base = torch.neuron.memory_allocated()
    calls: list[str] = []

    def watch(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and "neuron_runtime" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(watch)
    try:
        to_dev = x.to(DEV)
        back = n.to("cpu")
        half = n.to(torch.float16)
        last = n.to(memory_format=torch.channels_last)
        nb = x.to(DEV, non_blocking=True)
        same = n.to(DEV, copy=True)
    finally:
        sys.setprofile(None)
    assert calls == [], calls
    for t, want, dev in ((to_dev, x, DEV), (back, x, "cpu"), (half, x.half(), DEV), (nb, x, DEV), (same, x, DEV),
                         (last, x.to(memory_format=torch.channels_last), DEV)):
        assert t.device.type == dev and t.dtype == want.dtype and t.stride() == want.stride()
        assert torch.equal(t.cpu(), want)
    assert last.is_contiguous(memory_format=torch.channels_last)
    same.add_(1)  # a copy, never the source's memory
    assert torch.equal(n.cpu(), x)
    assert torch.neuron.memory_allocated() - base == 4 * x.nbytes + half.nbytes
    del to_dev, half, last, nb, same, t
    assert torch.neuron.memory_allocated() == base
    g = x.clone().requires_grad_()
    (g.to(DEV) * 2).sum().backward()  # autograd through the copy
    assert torch.equal(g.grad, torch.full_like(x, 2.0))
    with pytest.raises(RuntimeError, match="neuron:1 does not exist"):
        x.to("neuron:1")


@native
def test_host_factories_run_natively_and_equal_cpu(fresh_runtime: _runtime.Runtime) -> None:
    """`arange`, `full` and `scalar_tensor` on neuron (a decode token makes three aranges, and `full`/`where(c,
    x, 0.0)` four fills) are CPU's factory relabelled by the native layer: no Python call, no launch, no
    `fill_` reading its value back through `item`; their dtypes and values are CPU's; what it does not serve
    (another device index, pinned memory) still gets the Python kernel's answer."""
    import sys

    cases = [lambda d: torch.arange(7, device=d), lambda d: torch.arange(2, 9, device=d),
             lambda d: torch.arange(1, 8, 3, dtype=torch.float32, device=d), lambda d: torch.arange(0.5, 3.0, device=d),
             lambda d: torch.full((2, 3), -1e9, device=d), lambda d: torch.full((4,), 7, device=d),
             lambda d: torch.full((2,), True, device=d), lambda d: torch.full((3,), 2.5, dtype=torch.float16, device=d),
             lambda d: torch.scalar_tensor(3, device=d), lambda d: torch.scalar_tensor(1.5, dtype=torch.float64, device=d)]
    for f in cases:
        f(DEV)  # first call: loads the kernel
    calls: list[str] = []

    def watch(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and "neuron_runtime" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    before = _hostmem.NATIVE.executions()
    base = torch.neuron.memory_allocated()
    sys.setprofile(watch)
    try:
        got = [f(DEV) for f in cases]
    finally:
        sys.setprofile(None)
    assert calls == [], calls
    assert _hostmem.NATIVE.executions() == before  # nothing launched
    assert torch.neuron.memory_allocated() - base == sum(t.nbytes for t in got)
    for t, f in zip(got, cases):
        want = f("cpu")
        assert t.device.type == DEV and t.dtype == want.dtype and torch.equal(t.cpu(), want), (t, want)
    x = torch.arange(3.0, device=DEV, requires_grad=True)
    assert x.requires_grad and x.is_leaf
    c = torch.tensor([True, False, True], device=DEV)
    assert torch.equal(torch.where(c, torch.ones(3, device=DEV), 0.0).cpu(), torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(RuntimeError, match="neuron:1 does not exist"):
        torch.full((2,), 1.0, device="neuron:1")


@native
def test_a_cpu_view_keeps_its_memory_when_the_tensor_gets_new_data() -> None:
    """A CPU view of a neuron tensor (what a queued op reads) holds the tensor's storage: `n.data = other`
    gives the tensor new memory, and the old memory lives on, with its values, as long as the view does."""
    x = torch.arange(4096, dtype=torch.float32)
    n = x.to(DEV)  # a fresh buffer: its neuron storage is the only owner
    base = torch.neuron.memory_allocated()
    view = _hostmem.to_cpu(n)
    n.data = torch.zeros(8, device=DEV)
    assert torch.neuron.memory_allocated() - base == 8 * 4  # the old buffer is still counted: not freed
    filler = [torch.full((4096,), -1.0) for _ in range(8)]  # would take the memory, had it been freed
    assert torch.equal(view, x)
    del view, filler
    assert torch.neuron.memory_allocated() - base == 8 * 4 - x.nbytes


def _hits(fn, want, calls: int = 4) -> None:
    """`fn()` equals `want()` on every call: the first compiles, the second teaches the native kernel, the
    rest are native hits."""
    for _ in range(calls):
        assert_same(want(), fn())


@native
def test_a_tensor_keeps_its_cpu_view_only_while_the_view_fits(fresh_runtime: _runtime.Runtime) -> None:
    """The native path keeps each input's CPU view in the tensor (one view per tensor, not per op); a
    tensor whose memory or layout changed in place gets a new view, never reads through the old one."""
    has = _hostmem.NATIVE.has_cpu_view
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    na, nb = a.to(DEV), b.to(DEV)
    _hits(lambda: na + nb, lambda: a + b)
    assert has(na) and has(nb)
    assert has(na.detach())  # a detached copy (what autograd hands AccumulateGrad) shares it
    v = nb[1:]  # a view is mostly made, read once and dropped: its CPU view is not kept (its base's is)
    _hits(lambda: v + 1, lambda: b[1:] + 1)
    _hits(lambda: nb.t() * 2, lambda: b.t() * 2)
    assert not has(v) and has(nb)

    a.t_(), na.t_()  # new strides: the old view would read the wrong elements
    assert not has(na)
    _hits(lambda: na * 2, lambda: a * 2)
    assert has(na)

    c = torch.randn(6, 4)
    a.set_(c), na.set_(c.to(DEV).t().contiguous().t())  # same sizes and strides, other memory
    assert not has(na)
    _hits(lambda: na * 2, lambda: a * 2)

    na.data = b.to(DEV)  # new data: the slot is cleared with the old memory ...
    assert has(na)  # ... and a fresh output's own CPU tensor is its view (`fresh_view`)
    _hits(lambda: na - 1, lambda: b - 1)
    na.data = b.to(DEV)[1:]  # a view of a fresh output: it needs a view of its own
    assert not has(na)
    _hits(lambda: na - 1, lambda: b[1:] - 1)

    n = torch.arange(4.0, device=DEV)
    _hits(lambda: n + 1, lambda: torch.arange(4.0) + 1)
    n.resize_(4096)  # the storage grows: new memory under the same storage
    assert not has(n)
    n.copy_(torch.arange(4096.0))
    _hits(lambda: n + 1, lambda: torch.arange(4096.0) + 1)


@native
def test_a_kept_cpu_view_lives_as_long_as_its_tensor(fresh_runtime: _runtime.Runtime) -> None:
    x = torch.arange(4096, dtype=torch.float32)
    base = torch.neuron.memory_allocated()
    n = x.to(DEV)
    _hits(lambda: n * 2, lambda: x * 2)
    assert _hostmem.NATIVE.has_cpu_view(n)
    del n
    assert torch.neuron.memory_allocated() == base  # the view it kept is gone with it


@native
def test_typed_kernels_serve_the_hits_of_every_argument_kind(fresh_runtime: _runtime.Runtime) -> None:
    """The hottest ops have typed kernels (no boxing): their hits, through each kind of argument they
    take, equal CPU's and run natively; a boxed call of the same op (torch.ops) shares their entries."""
    F = torch.nn.functional
    x, w, b = torch.randn(6, 5), torch.randn(4, 5), torch.randn(4)
    y = torch.randn(6, 4)
    nx, nw, nb, ny = (t.to(DEV) for t in (x, w, b, y))
    calls = {
        "tensors and Scalars": lambda x, w, b, y: torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0),
        "a wrapped number": lambda x, w, b, y: x * 3,
        "a string": lambda x, w, b, y: F.gelu(x, approximate="tanh"),
        "an int": lambda x, w, b, y: F.mse_loss(y, y * 2, reduction="sum"),
        "dims, a flag and a dtype": lambda x, w, b, y: torch.sum(x, dim=[1], keepdim=True, dtype=torch.float64),
        "no dims": lambda x, w, b, y: torch.sum(x, dim=None),
        "a bool": lambda x, w, b, y: torch.ops.aten._softmax(x, 1, False),
    }
    for what, fn in calls.items():
        want = fn(x, w, b, y)
        for _ in range(2):  # compile, learn
            assert_same(want, fn(nx, nw, nb, ny))
        before = _hostmem.NATIVE.typed_executions()
        assert_same(want, fn(nx, nw, nb, ny))
        assert _hostmem.NATIVE.typed_executions() > before, what
    before = _hostmem.NATIVE.typed_executions()
    assert_same(x + y[:, :1], torch.ops.aten.add.Tensor(nx, ny[:, :1]))  # boxed: the Python kernel learns
    assert_same(x + y[:, :1], nx + ny[:, :1])  # typed: a hit on the entry the boxed call learned
    assert _hostmem.NATIVE.typed_executions() - before == 1


@native
@pytest.mark.parametrize("qualname", ["aten::abs", "aten::logical_not", "aten::nan_to_num"])
def test_functional_ops_whose_composite_calls_out_are_served_natively(fresh_runtime: _runtime.Runtime,
                                                                       qualname: str) -> None:
    """Without a kernel of their own these ran CompositeExplicitAutograd's, whose out= call the hit path
    does not serve (17x CPU's time for `abs`)."""
    fn = getattr(torch, qualname.removeprefix("aten::"))
    x = torch.tensor([[-1.5, 0.0, float("nan")], [2.0, -0.0, float("inf")]])
    n = x.to(DEV)
    for _ in range(2):
        assert_same(fn(x), fn(n), equal_nan=True)
    before = _hostmem.NATIVE.executions()
    assert_same(fn(x), fn(n), equal_nan=True)
    assert _hostmem.NATIVE.executions() - before == 1


@native
def test_out_variants_are_served_natively_and_hand_casts_resizes_and_cpu_outs_to_python(
        fresh_runtime: _runtime.Runtime) -> None:
    """`mul.out` (DDP's reducer divides every gradient into its bucket with it, a wrapped-number scalar from
    C++): the functional executable's result copied into `out` natively when dtype and sizes fit; another
    dtype (PyTorch's casting rules), another size (resized) and a CPU `out` (the
    error CUDA gives) go to the Python kernel, and every result equals CPU's."""
    g = torch.randn(8, 4)
    buf = torch.zeros(40)
    nbuf, ng = buf.to(DEV), g.to(DEV)
    view, nview = buf[4:36].view(8, 4), nbuf[4:36].view(8, 4)
    for _ in range(2):  # the Python kernel compiles, then the native one learns the entry
        torch.mul(ng, 0.5, out=nview)
    before = _hostmem.NATIVE.executions()
    for k in range(5):
        torch.mul(ng, 0.25 * k, out=nview)
    assert _hostmem.NATIVE.executions() - before == 5
    torch.mul(g, 0.25 * 4, out=view)
    assert_same(buf, nbuf)  # only the view's elements written, through the neuron tensor's memory
    wide, nwide = torch.zeros(8, 4, dtype=torch.float64), torch.zeros(8, 4, dtype=torch.float64, device=DEV)
    torch.mul(g, 3.0, out=wide)  # a wider out: written, cast (it once raised on neuron: the host call
    torch.mul(ng, 3.0, out=nwide)  # used mul.Scalar_out, whose rules differ from mul.out's)
    assert_same(wide, nwide)
    with pytest.raises(RuntimeError) as cpu_err:  # a float result into an int out: refused on both
        torch.mul(g, 3.0, out=torch.zeros(8, 4, dtype=torch.int64))
    with pytest.raises(RuntimeError) as dev_err:
        torch.mul(ng, 3.0, out=torch.zeros(8, 4, dtype=torch.int64, device=DEV))
    assert str(dev_err.value) == str(cpu_err.value)
    ints, nints = torch.zeros(8, 4, dtype=torch.int64), torch.zeros(8, 4, dtype=torch.int64, device=DEV)
    ig = torch.arange(32).view(8, 4)
    torch.mul(ig, ig, out=ints)
    torch.mul(ig.to(DEV), ig.to(DEV), out=nints)
    assert_same(ints, nints)
    small, nsmall = torch.zeros(3), torch.zeros(3, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's "an output with one or more elements was resized"
        torch.mul(ng, 2.0, out=nsmall)
        torch.mul(g, 2.0, out=small)
    assert_same(small, nsmall)
    with pytest.raises(RuntimeError, match="device"):
        torch.mul(ng, 2.0, out=torch.zeros(8, 4))


@native
def test_clone_is_one_native_host_copy(fresh_runtime: _runtime.Runtime) -> None:
    """`clone` (PyTorch's composite: empty_like + copy_, three dispatches) is one native host clone: values,
    strides and gradients equal CPU's for every layout and memory format, in new memory; a queued op it
    reads runs first (fusion)."""
    x = torch.randn(2, 3, 4, 5)
    n = x.to(DEV)
    views = (lambda t: t, lambda t: t.transpose(0, 2), lambda t: t[:, :, ::2], lambda t: t.permute(3, 0, 1, 2))
    for f in views:
        for mf in (torch.preserve_format, torch.contiguous_format, torch.channels_last):
            got, want = f(n).clone(memory_format=mf), f(x).clone(memory_format=mf)
            assert_same(want, got)
            assert got.stride() == want.stride() and got.data_ptr() != f(n).data_ptr()
    with torch.profiler.profile() as prof:
        n.clone()
    names = [e.name for e in prof.events()]
    assert "aten::clone" in names and "aten::_copy_from" not in names, names  # (the composite's neuron copy)
    w = x.clone().requires_grad_()
    nw = x.to(DEV).requires_grad_()
    (w.clone() * 3).sum().backward()
    (nw.clone() * 3).sum().backward()
    assert_same(w.grad, nw.grad)


@native
def test_slice_and_select_gradients_compile_nothing_for_a_new_batch_size(fresh_runtime: _runtime.Runtime) -> None:
    """Autograd's gradient of a slice or a select (`slice_backward`, `select_backward`: zeros of the input's
    sizes, the gradient copied in) runs on the host: its input sizes, batch included, no longer key a
    compile at every new batch size (HF Llama's rotary slices compiled 4 executables a size). Gradients
    equal CPU's for steps, negative bounds and indices."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x[..., 1:7:2] * 2).sum() + (x.select(1, -1) * 3).sum() + x[:, :, -4:].sum() + x[:, 1].sum()

    compiles = []
    for b in (2, 3, 5, 4):
        x = torch.randn(b, 3, 8, requires_grad=True)
        nx = x.detach().to(DEV).requires_grad_()
        f(x).backward()
        c0 = neuron_runtime.stats()["compiles"]
        f(nx).backward()
        compiles.append(neuron_runtime.stats()["compiles"] - c0)
        assert_same(x.grad, nx.grad)
    assert compiles[2:] == [0, 0], compiles
