"""`neuron_runtime.kernels`: RMSNorm, rotary embedding and SwiGLU against their eager composition on
neuron, one launch per call, and `use_in_llama` on a Hugging Face Llama (reference tier)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime import kernels
from neuron_runtime.aten import _runtime
from rt_helpers import run_python

DEV = "neuron"


def _rms_eager(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _rotary_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _swiglu_eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(g) * u


def _cases() -> list[tuple[str, Callable[..., Any], Callable[..., Any], list[Any]]]:
    torch.manual_seed(0)
    x, w = torch.randn(2, 32, 64), torch.randn(64)
    q, k = torch.randn(2, 4, 32, 16), torch.randn(2, 4, 32, 16)
    cos, sin = torch.randn(2, 32, 16), torch.randn(2, 32, 16)
    g, u = torch.randn(2, 32, 172), torch.randn(2, 32, 172)
    return [("rms_norm", kernels.rms_norm, _rms_eager, [x, w, 1e-6]),
            ("rotary", kernels.rotary, _rotary_eager, [q, k, cos, sin]),
            ("swiglu", kernels.swiglu, _swiglu_eager, [g, u])]


@pytest.mark.parametrize("case", range(3), ids=["rms_norm", "rotary", "swiglu"])
def test_library_kernel_equals_eager_composition_with_one_launch(fresh_runtime: _runtime.Runtime, case: int) -> None:
    _, kern, eager, args = _cases()[case]
    dev = [a.to(DEV).requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    ref = [a.to(DEV).requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    want = eager(*ref)
    wants = list(want) if isinstance(want, tuple) else [want]
    torch.manual_seed(1)
    outs = [torch.randn(o.shape).to(DEV) for o in wants]
    want_grads = torch.autograd.grad(wants, [a for a in ref if isinstance(a, torch.Tensor)], outs)
    inputs = [a for a in dev if isinstance(a, torch.Tensor)]
    for i in range(3):  # the first call compiles and is checked; the next take the launch's hot path, and
        # autograd records them as one native node (learned from the first call's backward)
        before = neuron_runtime.stats()["executions"]
        got = kern(*dev)
        assert neuron_runtime.stats()["executions"] - before == 1
        gots = list(got) if isinstance(got, tuple) else [got]
        assert (gots[0].grad_fn.name() == f"{kern.name}Backward") == (i > 0), gots[0].grad_fn.name()
        for a, b in zip(gots, wants):
            torch.testing.assert_close(a.cpu(), b.detach().cpu())
        # Backward (RMSNorm's is the one the issue names; all three have one): one launch, same gradients.
        before = neuron_runtime.stats()["executions"]
        grads = torch.autograd.grad(gots, inputs, outs)
        assert neuron_runtime.stats()["executions"] - before == 1
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a.cpu(), b.cpu())


def test_use_in_llama_same_loss_and_gradients_fewer_launches(fresh_runtime: _runtime.Runtime) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4)
    base = transformers.LlamaForCausalLM(cfg)
    plain, fused = copy.deepcopy(base).to(DEV), copy.deepcopy(base).to(DEV)
    assert kernels.use_in_llama(fused) == {"rms_norm": 3, "swiglu": 1, "rotary": 1}
    ids = torch.randint(0, 128, (2, 32)).to(DEV)
    launches, losses = [], []
    for m in (plain, fused):  # sync mode: a compile's first run counts as one execution, as a hit does
        before = neuron_runtime.stats()["executions"]
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        launches.append(neuron_runtime.stats()["executions"] - before)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert launches[1] < launches[0] - 20, launches
    for p, f in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(f.grad.cpu(), p.grad.cpu(), atol=1e-5, rtol=1e-4)
    assert plain.state_dict().keys() == fused.state_dict().keys()


@pytest.mark.parametrize("tier", ["reference", pytest.param("aoti", marks=pytest.mark.aoti)])
def test_swiglu_records_autograd_as_one_native_node(fresh_runtime: _runtime.Runtime, tmp_path: Any,
                                                    tier: str) -> None:
    """Once its forward and backward launches have run natively, a swiglu call autograd records is one C++
    node (no Python autograd.Function): same results and gradients as CPU, one launch each way; gradients
    of other strides take Python's route (on `aoti` an executable is made for its strides); autograd's
    saved-tensor rules hold."""
    if tier == "aoti":
        from neuron_runtime.compiler._aoti import AotiCompiler

        fresh_runtime.set_compiler(AotiCompiler(local_cache_dir=str(tmp_path / "aoti")))
    torch.manual_seed(0)
    g, u = torch.randn(4, 6, 10), torch.randn(4, 6, 10)
    dg, du = g.to(DEV).requires_grad_(), u.to(DEV).requires_grad_()
    cg, cu = g.clone().requires_grad_(), u.clone().requires_grad_()
    want = _swiglu_eager(cg, cu)
    grad = torch.randn(4, 6, 10)
    want_grads = torch.autograd.grad(want, [cg, cu], grad, retain_graph=True)
    names = []
    for _ in range(3):
        out = kernels.swiglu(dg, du)
        names.append(out.grad_fn.name())
        torch.testing.assert_close(out.cpu(), want.detach())
        before = neuron_runtime.stats()["executions"]
        got = torch.autograd.grad(out, [dg, du], grad.to(DEV))
        assert neuron_runtime.stats()["executions"] - before == 1
        for a, b in zip(got, want_grads):
            torch.testing.assert_close(a.cpu(), b)
    assert names == ["_SavingBackward"] + ["neuron_kernels::swigluBackward"] * 2, names
    # A gradient of other strides (a transposed one, an expanded one): Python's route, same values.
    t = torch.randn(10, 6, 4)
    out = kernels.swiglu(dg, du)
    got = torch.autograd.grad(out, [dg, du], t.to(DEV).permute(2, 1, 0))
    for a, b in zip(got, torch.autograd.grad(want, [cg, cu], t.permute(2, 1, 0), retain_graph=True)):
        torch.testing.assert_close(a.cpu(), b)
    out = kernels.swiglu(dg, du)
    assert out.grad_fn.name() == "neuron_kernels::swigluBackward"
    got = torch.autograd.grad(out.sum(), [dg, du])
    for a, b in zip(got, torch.autograd.grad(want.sum(), [cg, cu], retain_graph=True)):
        torch.testing.assert_close(a.cpu(), b)
    # Only one input needing gradients: the other gets none.
    out = kernels.swiglu(dg, du.detach())
    (only,) = torch.autograd.grad(out, [dg], grad.to(DEV))
    torch.testing.assert_close(only.cpu(), want_grads[0])
    # retain_graph, a second backward without it, and an input changed in place after the call.
    out = kernels.swiglu(dg, du)
    torch.autograd.grad(out, [dg, du], grad.to(DEV), retain_graph=True)
    torch.autograd.grad(out, [dg, du], grad.to(DEV))
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.grad(out, [dg, du], grad.to(DEV))
    x = du.detach().clone().requires_grad_()
    y = x * 1.0
    out = kernels.swiglu(dg, y)
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, [dg, x], grad.to(DEV))


def test_a_hot_call_declines_what_its_key_does_not_cover(fresh_runtime: _runtime.Runtime) -> None:
    """After two calls, rms_norm's call with the same arguments' key is one C++ call (`Kernel.hot`); any
    other call (another constant, shape or device, no gradient, the profiler, a new runtime) takes the
    route it took before and computes what the body does."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 8, 64), torch.randn(64)
    dx, dw = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    for _ in range(2):
        kernels.rms_norm(dx, dw, 1e-6).sum().backward()
    assert kernels.rms_norm.hot is not None

    def check(out: torch.Tensor, *args: Any) -> None:
        torch.testing.assert_close(out.detach().cpu(), _rms_eager(*args).detach())

    out = kernels.rms_norm(dx, dw, 1e-6)
    assert out.grad_fn.name() == "neuron_kernels::rms_normBackward"
    check(out, x, w, 1e-6)
    check(kernels.rms_norm(dx, dw, 0.5), x, w, 0.5)               # another constant
    check(kernels.rms_norm(dx, dw, 1), x, w, 1)                   # another type (int, not float)
    x2 = torch.randn(3, 8, 64)
    check(kernels.rms_norm(x2.to(DEV).requires_grad_(), dw, 1e-6), x2, w, 1e-6)  # another shape
    check(kernels.rms_norm(x.to(DEV).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(), dw, 1e-6),
          x, w, 1e-6)                                             # other strides
    assert kernels.rms_norm(x.requires_grad_(), w, 1e-6).device.type == "cpu"
    with torch.no_grad():
        assert kernels.rms_norm(dx, dw, 1e-6).grad_fn is None
    with torch.profiler.profile() as prof:
        out = kernels.rms_norm(dx, dw, 1e-6)
    assert out.grad_fn.name() != "neuron_kernels::rms_normBackward"
    assert any(e.name == "neuron_kernels::rms_norm" for e in prof.events())
    check(out, x, w, 1e-6)
    rt = _runtime.reset_runtime()  # a new runtime: the hot call was made with the old one's executables
    assert kernels.rms_norm.hot.try_call(dx, dw, 1e-6) is None
    out = kernels.rms_norm(dx, dw, 1e-6)
    check(out, x, w, 1e-6)
    assert rt.stats()["executions"] >= 1


_IN_REGIONS = r"""
import json, torch, neuron_runtime
from neuron_runtime import kernels
torch.manual_seed(0)
g, u, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
def forward(g, u, w):
    uw = u * w
    h = torch.sigmoid(g) * 2 + 1                # queued
    y = kernels.swiglu(h, uw)                   # ends the region, then the kernel's launch (or C++ node)
    return ((y * w).tanh() + y).sum(), y        # queued again
oks, nodes = [], []
for _ in range(8):  # op by op, then fused regions; the kernel's C++ node from its second call
    dg, du, dw = (t.to("neuron").requires_grad_() for t in (g, u, w))
    cg, cu, cw = (t.clone().requires_grad_() for t in (g, u, w))
    (dl, y), (cl, _) = forward(dg, du, dw), forward(cg, cu, cw)
    nodes.append(y.grad_fn.name())
    dgr, cgr = torch.autograd.grad(dl, [dg, du, dw]), torch.autograd.grad(cl, [cg, cu, cw])
    with torch.no_grad():
        dn, cn = forward(dg, du, dw)[0], forward(cg, cu, cw)[0]
    oks.append(torch.allclose(dl.cpu(), cl, rtol=1e-5, atol=1e-5) and torch.allclose(dn.cpu(), cn, rtol=1e-5) and
               all(torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-5) for a, b in zip(dgr, cgr)))
before = dict(neuron_runtime.stats()["fusion"]["flushes"])
for _ in range(4):  # forward only: the region before the kernel is still queued when it is called
    dg, du, dw = (t.to("neuron").requires_grad_() for t in (g, u, w))
    oks.append(torch.allclose(forward(dg, du, dw)[0].cpu(), forward(g, u, w)[0], rtol=1e-5))
f = neuron_runtime.stats()["fusion"]
at_kernel = sum(v - before.get(k, 0) for k, v in f["flushes"].items() if k.startswith("kernel:"))
print(json.dumps({"oks": oks, "nodes": nodes, "fused": f["fused_executions"], "at_kernel": at_kernel}))
"""


def test_kernels_end_fusion_regions_and_compute_what_cpu_does(tmp_path: Any) -> None:
    """With adaptive fusion on (TORCH_NEURONX_ENABLE_CONCATENATION=1), a kernel call ends the region
    before it (its executable reads the queued results), runs its own launch, and the ops after it
    queue again: results and gradients equal CPU's at every step, op by op and fused, through Python's
    autograd.Function and the C++ node."""
    r = run_python(_IN_REGIONS, env={"TORCH_NEURONX_ENABLE_CONCATENATION": "1", "TORCH_NEURONX_FUSION_MIN_SEEN": "2",
                                     "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(out["oks"]), out
    assert out["nodes"][-1] == "neuron_kernels::swigluBackward", out["nodes"]
    assert out["fused"] > 0 and out["at_kernel"] > 0, out


def test_a_native_node_with_an_unused_result_and_a_gradient_of_other_strides(fresh_runtime: _runtime.Runtime) -> None:
    """rotary's node (two results) when only the first is used, through `.sum()` (an expanded gradient,
    Python's route): the unused one's gradient is zeros, as in Python's backward."""
    _, kern, eager, args = _cases()[1]
    dev = [a.to(DEV).requires_grad_() for a in args]
    ref = [a.clone().requires_grad_() for a in args]
    for _ in range(2):  # the node is learned from the first call's backward
        torch.autograd.grad(kern(*dev), dev, [torch.ones_like(o) for o in kern(*dev)])
    q_out, _ = kern(*dev)
    assert q_out.grad_fn.name() == "neuron_kernels::rotaryBackward"
    got = torch.autograd.grad(q_out.sum(), dev, allow_unused=True)
    want = torch.autograd.grad(eager(*ref)[0].sum(), ref, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu() if a is not None else torch.zeros_like(b), b if b is not None else a.cpu())
