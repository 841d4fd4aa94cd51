"""In-place executables (`compiler._base`, `writes_inputs`): ops that mutate tensor lists (`_foreach_*_`,
`_fused_adamw_`) run an executable that writes the neuron tensors' memory itself, on the reference tier.
Results are checked against the same ops on CPU; views and aliases of a mutated tensor see the update."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rt_helpers import DEV, assert_same

import neuron_runtime
from neuron_runtime._native import _hostmem
from neuron_runtime.aten import _codegen, _runtime
from neuron_runtime.compiler._reference import ReferenceCompiler
from neuron_runtime.signatures import _ops

SHAPES = [(16, 8), (8,), (8, 24), (24,), (4, 4, 2), ()]


def _params(device: str) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]
    return ps


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_params_and_moments_equal_cpu(fresh_runtime: _runtime.Runtime, kind: str, amsgrad: bool) -> None:
    """A few AdamW steps: parameters, both moments (and amsgrad's max) and step counts as on CPU."""
    runs: dict[str, tuple[list[torch.nn.Parameter], torch.optim.Optimizer, Any]] = {}
    for device in ("cpu", DEV):
        ps = _params(device)
        opt = torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, amsgrad=amsgrad, **{kind: True})
        # A new learning rate every step, as the Trainer's linear schedule gives.
        runs[device] = (ps, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.1 * i))
    compiles = []
    for step in range(4):
        for device, (ps, opt, sched) in runs.items():
            for p, g in zip(ps, _grads(step)):
                p.grad = g.to(device)
            opt.step()
            sched.step()
        compiles.append(neuron_runtime.stats()["compiles"])
    assert compiles[1] == compiles[-1], f"the learning rate's changes made new keys: compiles {compiles}"
    (pc, oc, _), (pd, od, _) = runs["cpu"], runs[DEV]
    for c, d in zip(pc, pd):
        assert_same(c.detach(), d.detach(), atol=0, rtol=0)
        sc, sd = oc.state[c], od.state[d]
        names = ["exp_avg", "exp_avg_sq", "step"] + (["max_exp_avg_sq"] if amsgrad else [])
        for name in names:  # foreach keeps `step` on the CPU, as it does for CPU parameters
            torch.testing.assert_close(sd[name].cpu(), sc[name], atol=0, rtol=0)
            assert sd[name].device.type == (DEV if name != "step" or kind == "fused" else "cpu")
    s = neuron_runtime.stats()
    assert s["fallbacks"] == 0 and s["host_ops"] == 0, s
    op = "aten::_fused_adamw_" if kind == "fused" else "aten::_foreach_addcdiv_.ScalarList"
    assert _in_place_keys(op), f"{op} ran no in-place executable"
    native = _hostmem.NATIVE
    if native is not None and kind == "fused":  # the step's two ops (`_foreach_add_` of the step
        before = native.executions()             # counts, `_fused_adamw_`) both run natively
        od.step()
        assert native.executions() - before >= 2


def _in_place_keys(qualname: str) -> list[Any]:
    """The kernel's keys whose executable writes in place."""
    _, exes = _runtime._EXES[qualname]
    return [k for k, e in exes.items() if getattr(e, "__neuron_inplace__", False)]


def test_views_and_aliases_see_the_update(fresh_runtime: _runtime.Runtime) -> None:
    """The executable writes the tensors' own memory: a view taken before the op, a tensor sharing the
    storage, and a slice of a bigger buffer passed in the list all read the new values."""
    base_c = torch.arange(24.0).reshape(4, 6)
    base_d = base_c.to(DEV)
    for base in (base_c, base_d):
        rows = [base[1], base[2:4]]  # views into one buffer, passed in the list
        whole = base.view(-1)
        before = base[1, :3]
        for _ in range(2):
            torch._foreach_mul_(rows, 2.0)
            torch._foreach_add_(rows, [torch.ones(6, device=base.device), torch.ones(2, 6, device=base.device)],
                                alpha=0.5)
        if base is base_d:
            assert_same(base_c, base_d)
            assert_same(base_c.view(-1), whole)
            assert_same(base_c[1, :3], before)
            assert before._base is base_d and whole._version == base_d._version
    assert _in_place_keys("aten::_foreach_mul_.Scalar") and _in_place_keys("aten::_foreach_add_.List")


def test_aliased_list_elements_update_as_on_cpu(fresh_runtime: _runtime.Runtime) -> None:
    """The same tensor twice in a mutated list (the key holds no aliasing): written twice, as on CPU."""
    xc = torch.ones(5)
    xd = xc.to(DEV)
    torch._foreach_mul_([xc, xc], 3.0)
    torch._foreach_mul_([xd, xd], 3.0)
    assert_same(xc, xd)
    assert xd.cpu().eq(9).all()


def test_failed_in_place_run_is_restored_then_raises_like_cpu(fresh_runtime: _runtime.Runtime) -> None:
    """A list whose second tensor cannot take the update: the first tensor is not left half-updated by
    the executable's first run (restored, then the host raises the user's error as CPU does)."""
    def run(device: str) -> tuple[list[torch.Tensor], str]:
        xs = [torch.ones(3, device=device), torch.ones(3, dtype=torch.long, device=device)]
        with pytest.raises(RuntimeError) as e:
            torch._foreach_mul_(xs, 0.5)
        return xs, str(e.value)

    (xc, ec), (xd, ed) = run("cpu"), run(DEV)
    assert_same(xc, xd)
    assert "Float" in ec and "Long" in ec and "Float" in ed and "Long" in ed, (ec, ed)


def test_a_tier_without_writes_inputs_copies_back(fresh_runtime: _runtime.Runtime) -> None:
    """A compiler that does not write inputs gets the functional variant's signature, as before."""
    class Functional(ReferenceCompiler):
        writes_inputs = False

    fresh_runtime.set_compiler(Functional())
    xs = [torch.ones(4, device=DEV), torch.ones(2, device=DEV)]
    for _ in range(2):
        torch._foreach_mul_(xs, 2.0)
    assert_same([torch.full((4,), 4.0), torch.full((2,), 4.0)], xs)
    _, exes = _runtime._EXES["aten::_foreach_mul_.Scalar"]
    assert exes and not _in_place_keys("aten::_foreach_mul_.Scalar")


@pytest.mark.parametrize("fused", [True, False])
def test_fused_adamw_on_a_tier_without_writes_inputs_equals_cpu(fresh_runtime: _runtime.Runtime,
                                                                 fused: bool) -> None:
    """`_fused_adamw_` writes four lists: on a tier without in-place executables the native path hands
    its calls to the Python kernel, which copies the functional results back (hit path included)."""
    class Functional(ReferenceCompiler):
        writes_inputs = False

    fresh_runtime.set_compiler(Functional())
    kind = {"fused": True} if fused else {"foreach": True}
    pc, pd = _params("cpu"), _params(DEV)
    oc, od = torch.optim.AdamW(pc, lr=0.05, **kind), torch.optim.AdamW(pd, lr=0.05, **kind)
    for step in range(3):
        for ps, opt in ((pc, oc), (pd, od)):
            for p, g in zip(ps, _grads(step)):
                p.grad = g.to(p.device)
            opt.step()
    for c, d in zip(pc, pd):
        assert_same(c.detach(), d.detach(), atol=0, rtol=0)
        assert_same(oc.state[c]["exp_avg_sq"], od.state[d]["exp_avg_sq"], atol=0, rtol=0)
    assert not _in_place_keys("aten::_fused_adamw_" if fused else "aten::_foreach_addcdiv_.ScalarList")


def test_in_place_signatures_are_their_own_keys(fresh_runtime: _runtime.Runtime) -> None:
    """The in-place signature names the mutating op and what it writes: never the functional one's key."""
    from neuron_runtime.signatures import _signature

    info = _ops.classify("aten::_foreach_mul_.Scalar")
    assert info.writes_lists and not _ops.classify("aten::add_.Tensor").writes_lists
    xs = [torch.ones(4)]
    inplace = dict(_signature.build(info, (xs, 2.0)), writes=["self"])
    functional = _signature.build(info.functional, (xs, 2.0))
    fp = fresh_runtime.fingerprint
    assert _signature.cache_key(inplace, fp) != _signature.cache_key(functional, fp)
    run = ReferenceCompiler().load(ReferenceCompiler().compile(inplace))
    t = torch.ones(4)
    assert run([t], [3.0]) == [] and t.eq(3).all()


@pytest.mark.parametrize("writes_inputs", [True, False])
def test_written_lists_bump_version_counters_so_autograd_sees_them(fresh_runtime: _runtime.Runtime,
                                                                   writes_inputs: bool) -> None:
    """A list op writes its tensors in place: their version counters go up on every call — the first
    (slow path), the next ones (native hit path) — as on CPU, so autograd refuses a backward through a
    tensor a foreach op changed (no ADInplaceOrView kernel does this for list ops; CUDA's kernels do it)."""
    class Tier(ReferenceCompiler):
        pass

    Tier.writes_inputs = writes_inputs
    fresh_runtime.set_compiler(Tier())
    for device in ("cpu", DEV):
        xs = [torch.ones(4, device=device), torch.ones(2, device=device)]
        for n in range(1, 4):
            torch._foreach_mul_(xs, 2.0)
            assert [x._version for x in xs] == [n, n], (device, n)
        x = torch.ones(3, device=device, requires_grad=True)
        y = x * 1
        z = y.sin()  # saves y
        torch._foreach_add_([y], 1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()
    # Several lists (`_fused_adamw_`): on the tier without in-place executables the Python kernel serves
    # every call; with them, the native path does after the first.
    ps = _params(DEV)
    opt = torch.optim.AdamW(ps, lr=0.05, fused=True)
    for n in range(1, 4):
        for p, g in zip(ps, _grads(n)):
            p.grad = g.to(DEV)
        opt.step()
        assert {p._version for p in ps} == {opt.state[p]["exp_avg"]._version for p in ps} == {n}


def test_every_list_mutating_kernel_bumps_before_each_return(fresh_runtime: _runtime.Runtime,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generated kernel of an op that writes a tensor list bumps the written tensors' versions on
    each of its return paths (miss, hit, a failed run retried on the slow path)."""
    names = [q for q in _ops.cpu_ops() if (i := _ops.classify(q)).kind == "mutating"
             and any(a.mutable and a.kind == _ops.TENSORS for a in i.args)]
    assert len(names) > 50, names
    monkeypatch.setattr(_runtime, "_EXES", dict(_runtime._EXES))  # each generated kernel registers its table
    for q in names:
        src = _codegen.generate(_ops.classify(q)).__neuron_source__
        kernel = src.split("\ndef lookup")[0]
        returns = kernel.count("return ")
        assert returns >= 2 and kernel.count("_zIV(") == returns, (q, kernel)


# -- writes that partially overlap what the op reads (issue 29) --------------------------------------------
OVERLAPS = {
    "add_": "x[0:4].add_(x[2:6])",
    "mul_": "x[1:5].mul_(x[0:4])",
    "foreach_add_": "torch._foreach_add_([x[0:4]], [x[2:6]])",
    "add_out": "torch.add(x[2:6], 1, out=x[0:4])",
    "add_ disjoint": "x[0:3].add_(x[3:6])",
    "add_ itself": "x.add_(x)",
    "add_ strided": "x[::2].add_(x[1::2])",
    "foreach disjoint": "torch._foreach_add_([x[0:3]], [x[3:6]])",
    "add_out itself": "torch.add(x, 1, out=x)",
    "index_select_out itself": "torch.index_select(x, 0, x.new_tensor([5, 4, 3, 2, 1, 0]).long(), out=x)",
    "gather_out view": "torch.gather(x[0:4], 0, x.new_tensor([3, 2, 1, 0]).long(), out=x[0:4])",
}


def _cpu_outcome(code: str) -> tuple[str, Any]:
    x = torch.arange(6.0)
    try:
        eval(code)  # noqa: S307 - the test's own expressions
    except RuntimeError as e:
        return "raises", str(e)
    return "ok", x.tolist()


OVERLAP_CODE = """
import json, re, sys, torch, neuron_runtime
out = {}
for name, code in json.loads(sys.argv[1]).items():
    got = []
    for i in range(3):  # a miss, then hits of the same key (whose executable exists by then)
        apart = re.sub(r"\\bx\\b", "b", re.sub(r"\\bx\\b", "a", code, count=1))  # the same keys, two tensors
        eval(apart, {"torch": torch, "a": torch.arange(6.0).to("neuron"), "b": torch.arange(6.0).to("neuron")})
        x = torch.arange(6.0).to("neuron")
        try:
            eval(code, {"torch": torch, "x": x})
            got.append(["ok", x.cpu().tolist()])
        except RuntimeError as e:
            got.append(["raises", str(e)])
    out[name] = got
print(json.dumps({"out": out, "executions": neuron_runtime.stats()["executions"]}))
"""


@pytest.mark.parametrize("native", ["1", "0"])
def test_partially_overlapping_writes_raise_as_on_cpu(native: str) -> None:
    """`x[0:4].add_(x[2:6])` raises CPU's error on neuron too (it used to give [2, 4, 6, 8, 4, 5]), on the
    native hit path and the Python one, for a key whose executable is loaded; other aliasing computes as
    on CPU."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", OVERLAP_CODE, json.dumps(OVERLAPS)], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "TORCH_NEURONX_NATIVE": native,
                                         "TORCH_NEURONX_COMPILE_MODE": "sync"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, code in OVERLAPS.items():
        want = _cpu_outcome(code)
        for outcome in got["out"][name]:
            assert tuple(outcome) == want, (name, outcome, want)
    assert got["executions"] > 10  # the calls without overlap ran executables


# An out= tensor CPU resizes before it checks (it grows into an input), one whose elements share memory,
# and an empty one that is also an input: each raises CPU's error; each call first runs once on tensors of
# their own (`apart`), so the checked call's key has its executable loaded (the hit paths decide too).
OUT_CASES = {
    "gather out grows into its index":
        "i = torch.tensor([2, 1, 0], device=dev); o = torch.tensor([2, 1, 0], device=dev) if apart else i\n"
        "torch.gather(i.clone(), 0, i[1:], out=o[:1])",
    "index_select out overlaps itself":
        "y = torch.arange(18.0, device=dev).reshape(3, 6)\n"
        "o = torch.zeros(2, 6, device=dev) if apart else torch.zeros(1, 6, device=dev).expand(2, 6)\n"
        "torch.index_select(y, 1, torch.tensor([0, 1], device=dev), out=o)",
    "add out grows onto its input":
        "b = torch.arange(6.0, device=dev); o = torch.arange(6.0, device=dev) if apart else b\n"
        "torch.add(b[1:3], 1, out=o[1:2])",
    "add out grows beside its input":
        "b = torch.arange(6.0, device=dev); o = torch.arange(6.0, device=dev) if apart else b\n"
        "torch.add(b[2:4], 1, out=o[:1])",
    "cat out is an empty input":
        "e = torch.zeros(0, device=dev); o = torch.zeros(0, device=dev) if apart else e\n"
        "torch.cat((e, torch.ones(4, 6, device=dev)), out=o)",
    "cat out grows past its storage onto an input":
        "z = torch.zeros(4, 6, device=dev); o = torch.zeros(4, 6, device=dev) if apart else z\n"
        "torch.cat((torch.ones(4, 6, device=dev), z), out=o[:2])",
}

OUT_CODE = """
import json, sys, torch, neuron_runtime

def outcome(code, dev, apart):
    scope = {"torch": torch, "dev": dev, "apart": apart}
    try:
        exec(code, scope)
    except RuntimeError as e:
        return ["raises", str(e)]
    return ["ok", scope["o"].cpu().tolist()]

out = {}
for name, code in json.loads(sys.argv[1]).items():
    out[name] = {"cpu": outcome(code, "cpu", False), "neuron": []}
    for i in range(3):  # a miss, then hits of the same key (whose executable exists by then)
        assert outcome(code, "neuron", True)[0] == "ok", name
        out[name]["neuron"].append(outcome(code, "neuron", False))
print(json.dumps(out))
"""


@pytest.mark.parametrize("native", ["1", "0"])
def test_out_tensors_that_meet_an_input_once_resized_raise_as_on_cpu(native: str) -> None:
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", OUT_CODE, json.dumps(OUT_CASES)], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "TORCH_NEURONX_NATIVE": native,
                                         "TORCH_NEURONX_COMPILE_MODE": "sync", "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    raised = 0
    for name, g in got.items():
        for outcome in g["neuron"]:
            assert outcome == g["cpu"], (name, outcome, g["cpu"])
        raised += g["cpu"][0] == "raises"
    assert raised >= 4  # (the cases are CPU's errors, save those CPU allows)
