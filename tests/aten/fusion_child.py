"""Run by test_fusion.py in a fresh process (fusion is decided when kernels are built): one scenario,
its results as JSON on stdout."""

from __future__ import annotations

import json
import sys

import torch

import neuron_runtime
from neuron_runtime._native import _hostmem
from neuron_runtime.aten import _fusion, _kernels

# These scenarios count fused executions: the measured demotion of a group that ran slower fused than op
# by op (a timing, so the machine's load) would make the counts depend on the load. Its own test is
# test_fusion.py's in-process one.
_fusion._SLOWER = float("inf")

D = "neuron"


def train(steps: int = 6, foreach: bool | None = None) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)  # None: PyTorch picks foreach
    x, y = torch.randn(16, 8).to(D), torch.randn(16, 4).to(D)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = ((torch.sigmoid(out) * 2 - y).abs() + 0.1).pow(2).mean()  # a pointwise chain
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}


def chain(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2 + 1).relu() - 0.5


def triggers() -> dict[str, object]:
    x = torch.randn(32, device=D)
    reasons = {}

    def last_reason(action) -> str:  # type: ignore[no-untyped-def]
        action()  # its ops' first runs (an op not run before flushes: its outputs are unknown)
        torch.neuron.synchronize()
        before = dict(neuron_runtime.stats()["fusion"]["flushes"])
        action()
        after = neuron_runtime.stats()["fusion"]["flushes"]
        new = [k for k in after if after[k] != before.get(k, 0)]
        return new[0] if new else "none"

    chain(x).cpu()  # first run: learn output metadata
    reasons["item"] = last_reason(lambda: chain(x).sum().item())
    reasons["cpu"] = last_reason(lambda: chain(x).cpu())
    reasons["print"] = last_reason(lambda: repr(chain(x)))
    reasons["bool"] = last_reason(lambda: bool(chain(x)[0] > 0))
    x.t().exp().cpu()  # exp's first run: learn it
    x.view(4, 8).t().exp().cpu()  # (and on a transposed view)
    views = {}

    def view_read() -> None:  # a view of a queued result is metadata, read inside the region
        views["view"] = chain(x).view(4, 8).t().exp()
    reasons["view"] = last_reason(view_read)
    views["view_want"] = chain(x.cpu()).view(4, 8).t().exp()
    chain(x).cumsum_(0).cpu()  # cumsum_'s first run
    reasons["inplace"] = last_reason(lambda: chain(x).cumsum_(0))  # a scan, in place: queued too
    w = torch.ones(8, 2, device=D)
    reasons["matmul"] = last_reason(lambda: torch.mm(chain(x).view(4, 8), w))
    reasons["non_fusible"] = last_reason(lambda: torch.nonzero(chain(x)))  # data-dependent shape

    def grad_change() -> None:
        with torch.no_grad():
            y = chain(x)
        y * 3
    reasons["grad_mode"] = last_reason(grad_change)

    x.clone().t().exp_()  # exp_'s

    def write_through_view() -> None:
        y = chain(x)
        y.t().exp_()  # writing a queued result through a view: the queued ops run first
    reasons["reads_pending"] = last_reason(write_through_view)
    reasons["synchronize"] = last_reason(lambda: (chain(x), torch.neuron.synchronize()))
    reasons["clone"] = last_reason(lambda: chain(x).clone())  # a host copy of a queued result: they run first
    # correctness after all that
    ok = torch.equal(chain(x).cpu(), chain(x.cpu())) and torch.allclose(views["view"].cpu(), views["view_want"])
    ok = ok and torch.equal(chain(x).clone().cpu(), chain(x.cpu()))
    return {"reasons": reasons, "ok": ok}


def inplace(steps: int = 6) -> dict[str, object]:
    """In-place ops queued with the ops around them: on a queued output, on a tensor queued ops read
    before and after the update, twice on the same tensor, through a foreach list; results as in stream
    order, every time (first op by op, then fused)."""

    def program(a: torch.Tensor, b: torch.Tensor, w: list[torch.Tensor]) -> list[torch.Tensor]:
        before = a * 2          # reads a before the update
        a.mul_(b).add_(1)       # two updates of a caller's tensor
        after = a + before      # reads the updated a
        y = torch.sigmoid(b)
        y.sub_(0.5)             # in place on a queued output
        torch._foreach_mul_(w, 0.9)
        torch._foreach_addcmul_(w, [y, y], [after, after], 0.1)
        s = torch._foreach_sqrt(w)
        torch._foreach_add_(s, 1e-3)  # in place on a queued foreach output
        return [a, after, y, *w, *s]

    torch.manual_seed(0)
    a0, b0 = torch.rand(16), torch.rand(16)
    w0 = [torch.rand(16), torch.rand(16)]
    a, b, w = a0.to(D), b0.to(D), [t.to(D) for t in w0]
    oks = []
    for _ in range(steps):  # op by op, then three timed fused trials (Python), then the native queue
        got = program(a, b, w)
        want = program(a0, b0, w0)
        oks.append(all(torch.allclose(g.cpu(), x, rtol=1e-6) for g, x in zip(got, want)))
    return {"ok": all(oks), "steps_ok": oks}


def region(steps: int = 6) -> dict[str, object]:
    """A matmul, views of its queued result, softmax and reductions in one region."""
    torch.manual_seed(0)
    x_c, w_c = torch.randn(4, 8), torch.randn(8, 8)
    x, w = x_c.to(D), w_c.to(D)

    def prog(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.mm(x * 2, w)
        z = y.view(2, 16).t().softmax(-1)  # views of a queued result, read inside the region
        return z.sum(0, keepdim=True) + y.reshape(32)[::3].mean(), y

    oks = []
    for _ in range(steps):
        got, want = prog(x, w), prog(x_c, w_c)
        oks.append(all(torch.allclose(g.cpu(), v, rtol=1e-5, atol=1e-6) for g, v in zip(got, want)))
    return {"ok": all(oks), "steps_ok": oks}


def main() -> int:
    scenario = sys.argv[1]
    if scenario == "train":
        out: dict[str, object] = train()
    elif scenario == "train_single_tensor":  # the for-loop optimizer: in-place ops on single tensors
        out = train(foreach=False)
    elif scenario == "triggers":
        out = triggers()
    elif scenario == "limit":
        x = torch.randn(8, device=D)
        chain(x).cpu()
        y = chain(chain(x))
        out = {"ok": torch.equal(y.cpu(), chain(chain(x.cpu())))}
    elif scenario == "solo":  # relu always flushes alone (the host reads it): nothing to fuse it with
        x_c = torch.randn(8, 8)
        x = x_c.to(D)
        for _ in range(8):
            x, x_c = (torch.relu(x).cpu() * 0.9 - 0.1).to(D), torch.relu(x_c) * 0.9 - 0.1
        out = {"ok": torch.allclose(x.cpu(), x_c), "stats": neuron_runtime.stats()}
    elif scenario == "refuse_graphs":
        from neuron_runtime.compiler import CompileRefused
        from neuron_runtime.compiler._reference import ReferenceCompiler

        attempts = []
        orig = ReferenceCompiler.compile

        def refusing(self, sig):  # type: ignore[no-untyped-def]
            if "graph" in sig:
                attempts.append(sig["op"])
                raise CompileRefused("this compiler does not fuse")
            return orig(self, sig)

        ReferenceCompiler.compile = refusing  # type: ignore[method-assign]
        x = torch.randn(16, device=D)
        results = [torch.equal(chain(x).cpu(), chain(x.cpu())) for _ in range(6)]
        out = {"ok": all(results), "attempts": len(attempts)}
    elif scenario == "dead_intermediates":
        x = torch.randn(16, device=D)
        for _ in range(4):
            y = chain(x)
            keep = y * 1.0
            del y
            keep.cpu()
        out = {}
    elif scenario == "inplace":
        out = inplace()
    elif scenario == "data_swap":  # `a.data = ...` after an op reading `a` was queued: it reads the old a
        oks = []
        for _ in range(4):
            a0 = torch.rand(16)
            a, z = a0.to(D), torch.zeros(16, device=D)
            y = torch.sigmoid(a) * 3
            a.data = z  # no op reaches the runtime: nothing flushes
            oks.append(torch.allclose(y.cpu(), torch.sigmoid(a0) * 3) and bool((a.cpu() == 0).all()))
        out = {"ok": all(oks), "steps_ok": oks}
    elif scenario == "compiled_group":  # sigmoid, add (a run-time alpha), an in-place mul: one group
        a0, b0, w0 = torch.rand(64), torch.rand(64), torch.rand(64) + 0.5
        a, b, w = a0.to(D), b0.to(D), w0.to(D)
        oks = []
        for i in range(7):  # op by op until hot, three timed fused trials, then the native queue
            alpha = 0.25 * (i + 1)
            w.mul_(torch.add(torch.sigmoid(a), b, alpha=alpha))
            w0.mul_(torch.add(torch.sigmoid(a0), b0, alpha=alpha))
            oks.append(torch.allclose(w.cpu(), w0))  # reading w runs the queue
        out = {"ok": all(oks), "steps_ok": oks}
    elif scenario == "compiled_group_ranks":  # compiled_group at rank 1, then on 8x8 and 4x4x4 views
        a0, b0, w0 = torch.rand(64), torch.rand(64), torch.rand(64) + 0.5
        a, b, w = a0.to(D), b0.to(D), w0.to(D)
        oks = []
        compiles = []
        for shape in ([64], [8, 8], [4, 4, 4]):
            before = neuron_runtime.stats()["compiles"]
            av, bv, wv, wv0 = a.view(shape), b.view(shape), w.view(shape), w0.view(shape)
            for i in range(7):
                alpha = 0.25 * (i + 1)
                wv.mul_(torch.add(torch.sigmoid(av), bv, alpha=alpha))
                wv0.mul_(torch.add(torch.sigmoid(a0.view(shape)), b0.view(shape), alpha=alpha))
                oks.append(torch.allclose(wv.cpu(), wv0))  # reading w runs the queue
            compiles.append(neuron_runtime.stats()["compiles"] - before)
        out = {"ok": all(oks), "steps_ok": oks, "compiles": compiles}
    elif scenario == "region":  # a matmul, views of its queued result, softmax, reductions: one region
        out = region()
    elif scenario == "compiling":  # a hot group whose executable compiles in the background (aoti)
        x_c = torch.randn(64)
        x = x_c.to(D)
        runs: list[dict[str, int]] = []

        def step() -> bool:
            ok = torch.allclose(chain(x).cpu(), chain(x_c), rtol=1e-6, atol=1e-6)
            runs.append(dict(_hostmem.NATIVE.fusion_counters()) if _hostmem.NATIVE is not None else {})
            return ok

        oks = [step(), step()]
        neuron_runtime.wait_for_compiles(300)  # the ops' own executables (requested twice: compiled)
        # hot at the second flush: its executable is requested; it runs op by op natively meanwhile
        for _ in range(8):
            oks.append(step())
            if neuron_runtime.stats()["background"]["pending"]:
                break
        oks += [step() for _ in range(3)]  # (a compile takes far longer than these)
        compiling = runs[-1]
        neuron_runtime.wait_for_compiles(300)  # the group asks Python again at its next flush
        oks += [step() for _ in range(6)]  # fused, timed, then run fused natively
        out = {"ok": all(oks), "steps_ok": oks, "while_compiling": compiling, "end": runs[-1]}
    elif scenario == "demoted":  # every group measured slower fused: each runs op by op from then on
        _fusion._SLOWER = 0.0
        _fusion.Fusion._unqueue = lambda self, group: None  # its ops stay queued (as when another group fuses them)
        a, r = inplace(steps=8), region(steps=8)
        out = {"ok": a["ok"] and r["ok"], "steps_ok": [a["steps_ok"], r["steps_ok"]]}
    elif scenario == "unqueued":  # every group measured slower fused: its ops are no longer queued
        _fusion._SLOWER = 0.0
        a = inplace(steps=8)
        before = neuron_runtime.stats()["fusion"]["ops_buffered"]
        b = inplace(steps=3)
        out = {"ok": a["ok"] and b["ok"], "steps_ok": [a["steps_ok"], b["steps_ok"]],
               "buffered_after": neuron_runtime.stats()["fusion"]["ops_buffered"] - before}
    elif scenario == "views_elsewhere":  # views of memory no queued op writes do not flush
        x, w = torch.randn(64, device=D), torch.randn(8, 8, device=D)
        for _ in range(4):
            y = chain(x)
            wt = w.t().reshape(64)  # a view of a tensor nobody queued writes
            z = chain(y + wt)
            ok = torch.allclose(z.cpu(), chain(chain(x.cpu()) + w.cpu().t().reshape(64)))
        out = {"ok": ok}
    elif scenario == "into":  # which in-place results the fused executable writes into its inputs
        from neuron_runtime.compiler._reference import ReferenceCompiler

        sigs: list[dict[str, object]] = []
        orig_compile = ReferenceCompiler.compile

        def recording(self, sig):  # type: ignore[no-untyped-def]
            if "graph" in sig:
                sigs.append(sig)
            return orig_compile(self, sig)

        ReferenceCompiler.compile = recording  # type: ignore[method-assign]
        a0, b0, base0 = torch.rand(16), torch.rand(16), torch.rand(32)
        a, b, base = a0.to(D), b0.to(D), base0.to(D)
        u, u0 = base[:16], base0[:16]  # u shares its memory with base, which the group also reads
        def program(x: torch.Tensor, y: torch.Tensor, bs: torch.Tensor, uu: torch.Tensor) -> torch.Tensor:
            x.mul_(y).add_(torch.sigmoid(x))  # x: read, then updated in place
            z = torch.sigmoid(bs) * 2  # reads all of base ...
            uu.mul_(3)  # ... before u, a part of it, is updated
            return z

        oks = []
        for _ in range(7):  # (min_seen 2, three timed fused trials, then the native queue runs it)
            z, z0 = program(a, b, base, u), program(a0, b0, base0, u0)
            oks.append(torch.allclose(a.cpu(), a0) and torch.allclose(z.cpu(), z0) and
                       torch.allclose(base.cpu(), base0))
        out = {"ok": all(oks), "steps_ok": oks, "groups": [{k: sig[k] for k in ("op", "outputs", "into")
                                                            if k in sig} for sig in sigs]}
    elif scenario == "off":
        x = torch.randn(16, device=D)
        chain(x).cpu()
        src = _kernels.kernel_for("aten::add.Tensor").__neuron_source__  # type: ignore[attr-defined]
        out = {"hooks_in_kernel": "_zPENDING" in src or "_zSUBMIT" in src}
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    out["stats"] = neuron_runtime.stats()

    out["native"] = None if _hostmem.NATIVE is None else _hostmem.NATIVE.fusion_counters()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
