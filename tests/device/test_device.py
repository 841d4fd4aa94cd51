"""What users expect of a device, each checked against the same computation on CPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from rt_helpers import DEV, assert_same, run_python, to_dev


# -- registration ---------------------------------------------------------------------------------
def test_import_torch_alone_registers_neuron() -> None:
    r = run_python(
        "import sys, torch\n"
        "x = torch.ones(3, device='neuron') * 2\n"
        "assert 'neuron_runtime' in sys.modules\n"
        "print(x.device, x.cpu().tolist(), torch.accelerator.current_accelerator())\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["neuron:0", "[2.0,", "2.0,", "2.0]", "neuron"]


def test_autoload_off_is_respected() -> None:
    r = run_python("import sys, torch\nprint('neuron_runtime' in sys.modules, hasattr(torch, 'neuron'))",
                   env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_another_privateuse1_backend_is_named_in_the_error() -> None:
    r = run_python(
        "import torch\n"
        "torch.utils.rename_privateuse1_backend('otherdev')\n"
        "import neuron_runtime\n",
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0
    assert "otherdev" in r.stderr and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in r.stderr


def test_device_module_and_accelerator() -> None:
    assert torch.neuron.is_available() and torch.neuron.device_count() == 1
    assert torch.neuron.current_device() == 0
    torch.neuron.synchronize()
    torch.accelerator.synchronize()
    assert torch.accelerator.current_accelerator() == torch.device(DEV)
    x = torch.ones(2, device=DEV)
    assert type(x) is torch.Tensor and x.is_neuron and x.device == torch.device("neuron:0")


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2, device="neuron:1"),
    lambda: torch.ones(2).to("neuron:1"),
    lambda: torch.neuron.set_device(1),
])
def test_only_neuron_0_exists(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="neuron:1 does not exist"):
        make()


# -- tensors ----------------------------------------------------------------------------------------
def test_factories_match_cpu() -> None:
    for f in (lambda d: torch.zeros(2, 3, device=d), lambda d: torch.ones(4, dtype=torch.int64, device=d),
              lambda d: torch.arange(1, 10, 2, device=d), lambda d: torch.full((2, 2), 7.5, device=d),
              lambda d: torch.eye(3, device=d), lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
              lambda d: torch.linspace(0, 1, 5, device=d), lambda d: torch.empty(3, device=d).fill_(2)):
        assert_same(f("cpu"), f(DEV))
    torch.manual_seed(3)
    a = torch.randn(5)
    torch.manual_seed(3)
    b = torch.randn(5, device=DEV)
    assert_same(a, b)  # neuron draws from the CPU generator: same seed, same numbers


def test_to_cpu_print_item_bool() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    n = x.to(DEV)
    assert n.device.type == DEV and n.cpu().device.type == "cpu"
    assert torch.equal(n.cpu(), x)
    assert "device='neuron:0'" in repr(n) and "5." in repr(n)
    assert n[1, 2].item() == 5.0
    assert bool(n.sum() > 3) is True
    assert n.tolist() == x.tolist()
    assert n.to(torch.float64).dtype == torch.float64


def test_views_alias_their_base_and_inplace_through_view() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    n = x.clone().to(DEV)
    v = n.view(4, 3)
    assert v._base is n and v.untyped_storage().data_ptr() == n.untyped_storage().data_ptr()
    col = n[:, 1]
    col.mul_(10)
    x[:, 1].mul_(10)
    assert_same(x, n)
    assert_same(x.view(4, 3), v)
    n.t().add_(1)
    x.t().add_(1)
    assert_same(x, n)
    assert n._version > 0 and v._version == n._version


def test_out_and_inplace_ops() -> None:
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out_c, out_n = torch.empty(0), torch.empty(0, device=DEV)
    torch.add(a, b, alpha=2, out=out_c)
    torch.add(a.to(DEV), b.to(DEV), alpha=2, out=out_n)
    assert_same(out_c, out_n)
    ic, in_ = a.clone(), a.to(DEV)
    ic.mul_(b).sub_(0.5).clamp_(min=-1)
    in_.mul_(b.to(DEV)).sub_(0.5).clamp_(min=-1)
    assert_same(ic, in_)
    vals_c, idx_c = torch.max(a, 1)
    vals_n, idx_n = torch.max(a.to(DEV), 1)
    assert_same((vals_c, idx_c), (vals_n, idx_n))
    with pytest.raises(RuntimeError):
        torch.ones(3, dtype=torch.int64, device=DEV).add_(0.5)  # float result into an int tensor
    with pytest.raises(RuntimeError):
        torch.ones(3, device=DEV).add_(torch.ones(2, 3, device=DEV))  # cannot broadcast in place


def test_data_dependent_shapes() -> None:
    x = torch.tensor([0, 3, 0, 1, 3, 2])
    for f in (torch.nonzero, torch.unique, lambda t: torch.masked_select(t, t > 1),
              lambda t: torch.unique(t, return_counts=True)):
        assert_same(f(x), f(x.to(DEV)))


def test_mixing_devices_raises_like_cuda() -> None:
    n = torch.ones(2, 3, device=DEV)
    with pytest.raises(RuntimeError, match="same device"):
        n + torch.ones(2, 3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(n, torch.ones(3, 2))
    assert_same(torch.ones(2, 3) * torch.tensor(2.0), n * torch.tensor(2.0))  # CPU scalars are fine


def test_autograd_matches_cpu() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    wn = w.detach().to(DEV).requires_grad_()
    for weight, inp in ((w, x), (wn, x.to(DEV))):
        y = torch.tanh(inp @ weight).pow(2).sum()
        y.backward()
    assert_same(w.grad, wn.grad)


def test_module_to_keeps_parameter_identity_and_tied_weights() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    before = model["emb"].weight
    model.to(DEV)
    assert model["emb"].weight is before  # same Parameter object, as with .to('cuda')
    assert model["head"].weight is model["emb"].weight
    assert before.device.type == DEV
    model.cpu()
    assert model["head"].weight is model["emb"].weight and before.device.type == "cpu"


@pytest.mark.parametrize("kind", ["foreach", "fused", "loop"])
def test_adamw_and_clip_grad_norm_match_cpu(kind: str) -> None:
    torch.manual_seed(0)
    m_cpu = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    m_dev = copy.deepcopy(m_cpu).to(DEV)
    opts = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[kind]
    o_cpu = torch.optim.AdamW(m_cpu.parameters(), lr=0.05, **opts)
    o_dev = torch.optim.AdamW(m_dev.parameters(), lr=0.05, **opts)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for _ in range(4):
        for m, o, xi, yi in ((m_cpu, o_cpu, x, y), (m_dev, o_dev, x.to(DEV), y.to(DEV))):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xi), yi).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    for pc, pd in zip(m_cpu.parameters(), m_dev.parameters()):
        assert_same(pc, pd, atol=1e-5, rtol=1e-5)


def test_autocast() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with torch.autocast(device_type=DEV, dtype=torch.bfloat16):
        y = torch.mm(a.to(DEV), b.to(DEV))
        s = torch.softmax(y, dim=-1, dtype=None)
        z = a.to(DEV) + 1  # not in any list: unchanged dtype
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y_cpu = torch.mm(a, b)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.float32 and s.dtype == torch.float32
    assert_same(y_cpu, y)


def test_save_load_map_location_both_ways(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3, 4)
    n = x.to(DEV)
    torch.save({"n": n, "view": n[1]}, tmp_path / "dev.pt")
    torch.save({"x": x}, tmp_path / "cpu.pt")
    on_cpu = torch.load(tmp_path / "dev.pt", map_location="cpu")
    on_dev = torch.load(tmp_path / "dev.pt")
    cpu_to_dev = torch.load(tmp_path / "cpu.pt", map_location=DEV)
    assert on_cpu["n"].device.type == "cpu" and torch.equal(on_cpu["n"], x)
    assert_same(x, on_dev["n"])
    assert_same(x, cpu_to_dev["x"])
    on_dev["view"].fill_(0)  # storage sharing survives the round trip
    assert float(on_dev["n"][1].abs().sum()) == 0.0


def test_deepcopy_and_storage() -> None:
    n = torch.randn(3, device=DEV, requires_grad=True)
    c = copy.deepcopy(n)
    assert c.device.type == DEV and c.requires_grad and torch.equal(c.cpu(), n.detach().cpu())
    assert c.untyped_storage().data_ptr() != n.untyped_storage().data_ptr()
    s = torch.UntypedStorage(16, device=DEV)
    assert s.device.type == DEV and s.nbytes() == 16
    buf = io.BytesIO()
    torch.save(n.detach().untyped_storage(), buf)


def test_resize_and_set() -> None:
    n = torch.empty(0, device=DEV)
    n.resize_(2, 3).fill_(1.5)
    assert n.shape == (2, 3) and n.sum().item() == 9.0
    n.resize_(10)  # grows through a new buffer, keeps the old contents
    assert n[:6].sum().item() == 9.0
    m = torch.empty(0, device=DEV).set_(n)
    m.zero_()
    assert n.sum().item() == 0.0


def test_nn_layers_match_cpu() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.LayerNorm(16),
                              torch.nn.Linear(16, 3))
    net_dev = copy.deepcopy(net).to(DEV)
    x = torch.randn(2, 2, 4, 4, requires_grad=True)
    xd = x.detach().to(DEV).requires_grad_()
    net(x).sum().backward()
    net_dev(xd).sum().backward()
    assert_same(x.grad, xd.grad, atol=1e-5, rtol=1e-4)
    for pc, pd in zip(net.parameters(), net_dev.parameters()):
        assert_same(pc.grad, pd.grad, atol=1e-5, rtol=1e-4)
    assert_same(net[1].running_mean, net_dev[1].running_mean)


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_rnn_cells_match_cpu(cell: type) -> None:
    torch.manual_seed(0)
    rnn = cell(4, 5)
    rnn_dev = copy.deepcopy(rnn).to(DEV)
    x = torch.randn(3, 2, 4)
    out, _ = rnn(x)
    out_d, _ = rnn_dev(x.to(DEV))
    out.sum().backward()
    out_d.sum().backward()
    assert_same(out, out_d, atol=1e-5, rtol=1e-5)
    for pc, pd in zip(rnn.parameters(), rnn_dev.parameters()):
        assert_same(pc.grad, pd.grad, atol=1e-5, rtol=1e-4)


def test_attention_and_losses_match_cpu() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    assert_same(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                torch.nn.functional.scaled_dot_product_attention(*to_dev((q, k, v)), is_causal=True),
                atol=1e-5, rtol=1e-5)
    logits, target = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 1, 0])
    assert_same(torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1),
                torch.nn.functional.cross_entropy(logits.to(DEV), target.to(DEV), label_smoothing=0.1))
    idx = torch.tensor([2, 0])
    assert_same(logits[idx], logits.to(DEV)[idx.to(DEV)])
    assert_same(logits[idx], logits.to(DEV)[idx])  # CPU indices are accepted, as on CUDA


def test_pin_memory_is_a_no_op() -> None:
    t = torch.randn(3)
    assert t.pin_memory() is t
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2,
                                         pin_memory=True)
    assert [b[0].shape for b in loader] == [torch.Size([2, 2])] * 2


def test_non_blocking_copies_both_ways() -> None:
    x = torch.arange(4.0, requires_grad=True)
    n = x.detach().to(DEV, non_blocking=True).requires_grad_()
    back = n.to("cpu", non_blocking=True)  # PyTorch would want a pinned allocator for this
    assert back.device.type == "cpu" and torch.equal(back.detach(), x.detach())
    (back * 3).sum().backward()
    assert_same(torch.full((4,), 3.0), n.grad)
    assert n.to(torch.float16).dtype == torch.float16 and n.to(torch.float16).device.type == DEV


def test_backward_runs_on_the_calling_thread() -> None:
    # PyTorch runs a non-CPU device's backward on an engine worker thread; neuron's runs on the caller's,
    # as CPU's does (a thread hand-off per backward costs more than a small model's whole step).
    import threading

    seen: list[int] = []
    x = torch.randn(4, device=DEV, requires_grad=True)
    y = (x * 2).sin()
    y.register_hook(lambda g: seen.append(threading.get_ident()))
    y.sum().backward()
    assert seen == [threading.get_ident()]
    torch.testing.assert_close(x.grad.cpu(), (2 * (x.detach() * 2).cos()).cpu())


def test_attention_and_chunked_losses_compute_as_on_cpu() -> None:
    """Composites that pick their algorithm by device take CPU's pick on neuron: SDPA runs CPU's flash
    kernel (not the math composite), and `linear_cross_entropy`'s chunked path accumulates as on CPU; both
    then equal CPU bit for bit, gradients included."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.sum().backward()
    qn, kn, vn = (t.detach().to(DEV).requires_grad_() for t in (q, k, v))
    with torch.profiler.profile() as prof:
        got = torch.nn.functional.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
    got.sum().backward()
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in {e.name for e in prof.events()}
    assert torch.equal(got.detach().cpu(), want.detach())
    for a, b in ((qn, q), (kn, k), (vn, v)):
        assert torch.equal(a.grad.cpu(), b.grad)

    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    x = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 6, (16,))
    opts = LinearCrossEntropyOptions()  # "auto": per-device picks
    want = torch.nn.functional.linear_cross_entropy(x, w, y, reduction="none", options=opts)
    want.sum().backward()
    xn, wn = (t.detach().to(DEV).requires_grad_() for t in (x, w))
    got = torch.nn.functional.linear_cross_entropy(xn, wn, y.to(DEV), reduction="none", options=opts)
    got.sum().backward()
    assert torch.equal(got.detach().cpu(), want.detach())
    assert torch.equal(xn.grad.cpu(), x.grad) and torch.equal(wn.grad.cpu(), w.grad)
