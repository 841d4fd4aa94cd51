"""The `aoti` tier's compile seconds per signature, side by side with another checkout's, plus load and call.

    python benchmarks/aoti_ops.py [--old DIR] [--root DIR] [--batch 8] [--cold]

Method (JSON on stdout, progress on stderr; the machine's load printed with every case):
  1. Signatures from real work, recorded on the reference tier (TORCH_NEURONX_RECORD_FILE): an MLP's
     training step with AdamW, a written-out decoder block trained at two lengths (shape classes), a
     `torch.compile` graph, and a fused elementwise chain (TORCH_NEURONX_ENABLE_CONCATENATION=1). At least
     20 distinct signatures of these kinds: elementwise, reduction, matmul, layer norm, softmax backward,
     foreach, fused, graph, class (see `kind`).
  2. Each case is a fresh process on a *warm host*: Inductor's scratch under --root (precompiled headers,
     the shared AOTI runtime) is built before the case and not timed (`--cold`: an empty --root, so the
     first case pays it); the local tier is empty, so every signature compiles.
       single   one signature per compile call, one after another (a sync-mode op, one worker);
       batch    the same signatures queued, compiled --batch at a time (`compile_many`: one C++
                translation unit per batch, what a service worker does with a queue);
       old      `single` on the checkout in --old (e.g. a `git worktree` of main before this change).
     Per signature: wall seconds and CPU seconds (the process and its compilers: on a host whose load
     stretches wall time, the CPU seconds are what an idle core would take); median, p95, per kind; the
     new code's seconds per phase (p50/p95).
       service  the host's compile service (a real `_server.py` process) with 1 and with 2 workers,
                alternating for --rounds: once every worker said it is ready, all signatures are asked
                for at once; compiles/s from the first request to the last answer, and the ratio.
  3. Load (ms, from bytes) and the call cost of a 64-float `add` through `loader.run(list)` vs native
     `torch.add`, interleaved rounds, medians (OMP_NUM_THREADS=1); with --old, each checkout's add `.so`
     called through AOTInductor's runner in one process, interleaved (`call_add64_so`: new_over_old).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

RECORD = r"""
import os, torch
import neuron_runtime
torch.manual_seed(0)
# 1. an MLP with AdamW (addmm, gelu, cross-entropy, foreach optimizer ops)
mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
x, y = torch.randn(16, 32, device="neuron"), torch.randint(0, 10, (16,), device="neuron")
for _ in range(2):
    opt.zero_grad(); torch.nn.functional.cross_entropy(mlp(x), y).backward(); opt.step()
# 2. a decoder block at two lengths (bmm, softmax, layer norm, embedding, masked_fill)
from _models import Decoder, train_decoder
train_decoder(Decoder(vocab=64, d=32, heads=4).to("neuron"), (6, 10), vocab=64)
# 3. a torch.compile graph
def f(a, w):
    return torch.nn.functional.gelu(a @ w).sum(1) * 0.5
with torch.no_grad():
    torch.compile(f, backend="neuron")(torch.randn(6, 8, device="neuron"), torch.randn(8, 5, device="neuron"))
"""

FUSE = r"""
import torch
import neuron_runtime
a, b = torch.randn(64, 512, device="neuron"), torch.randn(64, 512, device="neuron")
for _ in range(8):
    c = torch.relu(a * 2) + b * 0.5
    c = torch.tanh(c) - a
    c.cpu()
"""

CHILD = r"""
import json, os, statistics, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
from neuron_runtime.compiler._aoti import AotiCompiler
mode, sigs_file, local = sys.argv[1], sys.argv[2], sys.argv[3]
batch = int(sys.argv[4]) if len(sys.argv) > 4 else 8
sigs = [json.loads(line) for line in open(sigs_file)]
c = AotiCompiler(local_cache_dir=local)
t0 = time.perf_counter()
if hasattr(c, "prepare"):
    c.prepare()  # a warm host: shared runtime verified, Inductor's first lowering done
else:  # the old code: one throwaway compile pays the process's imports and header checks
    try:
        from neuron_runtime.signatures import _ops, _signature
    except ImportError:  # a checkout before the four layers
        from neuron_runtime import _ops, _signature
    c.compile(_signature.build(_ops.classify("aten::add.Tensor"), (torch.zeros(3), torch.zeros(3), 1)))
warm_s = time.perf_counter() - t0
rows, payloads = [], []
import resource
def cpu():  # CPU seconds of this process and of the compilers it waited for (g++, ld)
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
def record(sig, dt, res, cpu_s):
    err = None if res is None or getattr(res, "error", None) is None else str(res.error)[:200]
    rows.append({"op": sig["op"], "s": round(dt, 3), "cpu_s": round(cpu_s, 3), "error": err,
                 "phases": {k: round(v, 4) for k, v in getattr(res, "phases", {}).items()}})
if mode == "batch":
    for i in range(0, len(sigs), batch):
        chunk = sigs[i:i + batch]
        t, t_cpu = time.perf_counter(), cpu()
        res = c.compile_many(chunk)
        dt, dt_cpu = (time.perf_counter() - t) / len(chunk), (cpu() - t_cpu) / len(chunk)
        for s, r in zip(chunk, res):
            record(s, dt, r, dt_cpu)
            payloads.append(r.payload)
else:
    for s in sigs:
        t, t_cpu = time.perf_counter(), cpu()
        if hasattr(c, "compile_many"):
            r = c.compile_many([s])[0]
            payloads.append(r.payload)
        else:
            class R: pass
            r = R()
            try:
                payloads.append(c.compile(s)); r.error = None
            except Exception as e:
                payloads.append(None); r.error = e
        record(s, time.perf_counter() - t, r, cpu() - t_cpu)
out = {"warm_s": round(warm_s, 2), "rows": rows}
if mode == "single":  # a 64-float add's .so, for the call A/B of the two checkouts in one process (main)
    import io, zipfile
    try:
        from neuron_runtime.signatures import _ops, _signature
    except ImportError:  # a checkout before the four layers
        from neuron_runtime import _ops, _signature
    with zipfile.ZipFile(io.BytesIO(c.compile(_signature.build(_ops.classify("aten::add.Tensor"),
                                                               (torch.randn(64), torch.randn(64), 1))))) as z:
        so = [n for n in z.namelist() if n.endswith(".so")]
        os.makedirs(local, exist_ok=True)
        out["add64_so"] = os.path.join(local, "add64.so")
        with open(out["add64_so"], "wb") as f:
            f.write(z.read(so[0]))
if mode == "single" and hasattr(c, "compile_many"):
    loads = []
    for p in payloads:
        if p is None:
            continue
        ts = []
        for _ in range(20):
            t = time.perf_counter(); c.load(p); ts.append(time.perf_counter() - t)
        loads.append(statistics.median(ts) * 1e3)
    out["load_p50_ms"] = round(statistics.median(loads), 3)
    try:
        from neuron_runtime.signatures import _ops, _signature
    except ImportError:  # a checkout before the four layers
        from neuron_runtime import _ops, _signature
    a, b = torch.randn(64), torch.randn(64)
    exe = c.load(c.compile(_signature.build(_ops.classify("aten::add.Tensor"), (a, b, 1))))
    def us(fn, n=20000):
        t = time.perf_counter()
        for _ in range(n): fn()
        return (time.perf_counter() - t) / n * 1e6
    na, ex = [], []
    for _ in range(7):
        na.append(us(lambda: torch.add(a, b, alpha=1))); ex.append(us(lambda: exe([a, b], [1])))
    out["call_add64"] = {"native_us": round(statistics.median(na), 2), "aoti_us": round(statistics.median(ex), 2),
                         "ratio": round(statistics.median([e / n for e, n in zip(ex, na)]), 3)}
print(json.dumps(out))
"""


def kind(sig: dict[str, Any]) -> str:
    """The kind of work a signature is (what the issue's target names)."""
    from neuron_runtime.signatures import kind_of

    if kind_of(sig) != "op":  # graph, fused, class
        return kind_of(sig)
    op = str(sig.get("op", ""))
    if op.startswith("aten::_foreach_"):
        return "foreach"
    if any(w in op for w in ("mm", "addmm", "bmm", "linear")):
        return "matmul"
    if "layer_norm" in op:
        return "layer_norm"
    if "softmax_backward" in op:
        return "softmax_backward"
    if "softmax" in op:
        return "softmax"
    if any(w in op for w in ("sum", "mean", "amax", "nll_loss", "norm")):
        return "reduction"
    return "elementwise"


def record_signatures(root: Path, n: int = 28, n_classes: int = 4) -> list[dict[str, Any]]:
    """Distinct exact signatures of the recorded work (reference tier, TORCH_NEURONX_SHAPES=static), round
    robin over the kinds, then the shape classes of a few of them (the ranked class: symbolic sizes)."""
    out: dict[str, dict[str, Any]] = {}
    for name, script, extra in (("train", RECORD, {}), ("fuse", FUSE, {"TORCH_NEURONX_ENABLE_CONCATENATION": "1",
                                                                      "TORCH_NEURONX_FUSION_MIN_NUMEL": "1024"})):
        path = root / f"record-{name}.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
        env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_SHAPES="static",
                   TORCH_NEURONX_RECORD_FILE=str(path), TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(root / f"ref-{name}"),
                   **extra)
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent)  # _models
        subprocess.run([sys.executable, "-c", script], env=env, check=True, stderr=subprocess.DEVNULL)
        for line in path.read_text().splitlines():
            sig = json.loads(line)["signature"]
            out.setdefault(json.dumps(sig, sort_keys=True), sig)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for sig in out.values():
        by_kind.setdefault(kind(sig), []).append(sig)
    chosen: list[dict[str, Any]] = []
    while len(chosen) < n and any(by_kind.values()):  # round robin over the kinds
        for k in sorted(by_kind):
            if by_kind[k] and len(chosen) < n:
                chosen.append(by_kind[k].pop(0))
    from neuron_runtime.signatures import _shapes

    classes = [c for c in (_shapes.ranked_class(s) for s in chosen if "graph" not in s) if c is not None]
    return chosen + classes[:n_classes]


def run_child(code: Path, mode: str, sigs_file: Path, local: Path, batch: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(PYTHONPATH=str(code), OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER="aoti")
    load_before = os.getloadavg()
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(sigs_file), str(local), str(batch)], env=env,
                       stdout=subprocess.PIPE, text=True, check=True, cwd=str(code))
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    out["load_before"], out["load_after"] = load_before, os.getloadavg()
    return out


def run_service(workers: int, sigs: list[dict[str, Any]], local: Path, batch: int) -> dict[str, Any]:
    """One service process with `workers` workers on an empty local tier: seconds from asking for every
    signature at once (the workers ready) to the last answer."""
    import socket

    from neuron_runtime.compiler._aoti import AotiCompiler
    from neuron_runtime.executables._service import _client
    from neuron_runtime.signatures import _signature

    fp = AotiCompiler(local_cache_dir=str(local)).fingerprint()
    keys = [_signature.cache_key(s, fp) for s in sigs]
    path = os.path.join(_client.service_dir().path, f"bench-{os.getpid()}-{workers}-{time.time_ns()}.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER="aoti", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(local), OMP_NUM_THREADS="1",
               TORCH_NEURONX_COMPILE_MODE="sync")
    proc = subprocess.Popen([sys.executable, _client.SERVER, "--socket", path, "--workers", str(workers),
                             "--batch", str(batch), "--idle-timeout", "5", "--timeout", "900"], env=env)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(path):
            assert proc.poll() is None and time.monotonic() < deadline, "the service did not start"
            time.sleep(0.05)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        f = sock.makefile("rwb")

        def ask(msg: dict[str, Any]) -> None:
            f.write(json.dumps(msg).encode() + b"\n")
            f.flush()

        while True:  # every worker ready (imports, shared runtime, warm-up lowering done)
            ask({"op": "status"})
            st = json.loads(f.readline())
            if st.get("ready", 0) >= workers:
                break
            assert time.monotonic() < deadline, "the workers did not get ready"
            time.sleep(0.2)
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        for k, sig in zip(keys, sigs):
            ask({"op": "compile", "key": k, "payload": {"signatures": [sig], "key": k}, "priority": 0})
        waiting, statuses = set(keys), []
        while waiting:
            line = f.readline()
            if not line:
                raise SystemExit(f"the service hung up with {len(waiting)} answers missing (exit {proc.poll()})")
            m = json.loads(line)
            if m.get("op") == "done" and m.get("key") in waiting:
                waiting.discard(m["key"])
                statuses.append(m.get("status"))
        dt = time.perf_counter() - t0
        with open(f"/proc/{proc.pid}/stat") as st:  # the service process's own CPU (workers are children)
            fields = st.read().rsplit(")", 1)[1].split()
        service_cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        sock.close()
    finally:
        proc.terminate()
        proc.wait(60)
    return {"workers": workers, "seconds": round(dt, 2), "compiles_per_s": round(len(sigs) / dt, 3),
            "service_process_cpu_s": round(service_cpu_s, 2),
            "statuses": {st: statuses.count(st) for st in set(statuses)}, "load_before": load_before,
            "load_after": os.getloadavg()}


CALL = r"""
import json, os, statistics, sys, time
import torch
torch.set_num_threads(1)
runners = {name: torch._C._aoti.AOTIModelContainerRunnerCpu(path, 1) for name, path in json.loads(sys.argv[1]).items()}
a, b = torch.randn(64), torch.randn(64)
ins = [a, b, torch.tensor(1)]
for r in runners.values():
    assert torch.equal(r.run(ins)[0], a + b)
def us(fn, n=20000):
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e6
times = {name: [] for name in [*runners, "native"]}
for _ in range(9):  # interleaved rounds
    for name, r in runners.items():
        times[name].append(us(lambda: r.run(ins)))
    times["native"].append(us(lambda: torch.add(a, b, alpha=1)))
out = {f"{name}_us": round(statistics.median(v), 3) for name, v in times.items()}
if "old" in runners:
    out["new_over_old"] = round(statistics.median([n / o for n, o in zip(times["new"], times["old"])]), 3)
print(json.dumps(out))
"""


def run_call(sos: dict[str, str]) -> dict[str, Any]:
    """The runner's call of a 64-float add's .so from each checkout, in one process, interleaved rounds
    (the .so is what the native hit path calls; medians of 9 rounds of 20,000 calls)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load_before = os.getloadavg()
    r = subprocess.run([sys.executable, "-c", CALL, json.dumps(sos)], env=env, stdout=subprocess.PIPE, text=True,
                       check=True)
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "load_before": load_before, "load_after": os.getloadavg()}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None]
    secs = sorted(r["s"] for r in ok)
    by_kind: dict[str, list[float]] = {}
    for r in ok:
        by_kind.setdefault(r["kind"], []).append(r["s"])
    phases: dict[str, list[float]] = {}
    for r in ok:
        for k, v in r.get("phases", {}).items():
            phases.setdefault(k, []).append(v)
    return {
        "n": len(rows), "compiled": len(ok), "refused": [(r["op"], r["error"]) for r in rows if r["error"]],
        "median_s": round(statistics.median(secs), 3) if secs else None,
        # CPU seconds (Python + the compilers): what the wall time is on an idle core, on a loaded host
        "median_cpu_s": round(statistics.median(r["cpu_s"] for r in ok), 3) if ok else None,
        "p95_cpu_s": round(sorted(r["cpu_s"] for r in ok)[min(len(ok) - 1, int(0.95 * len(ok)))], 3) if ok else None,
        "p95_s": round(secs[min(len(secs) - 1, int(0.95 * len(secs)))], 3) if secs else None,
        "by_kind_median_s": {k: round(statistics.median(v), 3) for k, v in sorted(by_kind.items())},
        "phases": {k: {"p50": round(statistics.median(v), 3), "p95": round(sorted(v)[int(0.95 * (len(v) - 1))], 3)}
                   for k, v in phases.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="another checkout to compile the same signatures with (e.g. a worktree of main)")
    p.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "neuron-aoti-bench"),
                   help="Inductor's scratch (the warm host) is kept here between runs")
    p.add_argument("--cold", action="store_true", help="start from an empty --root")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--modes", default="single,batch,old,service")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the service case (1 and 2 workers each)")
    args = p.parse_args(argv)
    root = Path(args.root)
    if args.cold:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="aoti-ops-", dir=root))
    print("recording signatures (reference tier)", file=sys.stderr, flush=True)
    sigs = record_signatures(work)
    sigs_file = work / "signatures.jsonl"
    sigs_file.write_text("".join(json.dumps(s) + "\n" for s in sigs))
    kinds = [kind(s) for s in sigs]
    out: dict[str, Any] = {"cpus": os.cpu_count(), "signatures": len(sigs),
                           "kinds": {k: kinds.count(k) for k in sorted(set(kinds))}}
    modes = [m for m in args.modes.split(",") if m and (m != "old" or args.old)]
    if "service" in modes:
        modes.remove("service")
        runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
        for r in range(args.rounds):
            for n in (1, 2):
                print(f"== service, {n} worker(s), round {r}", file=sys.stderr, flush=True)
                runs[n].append(run_service(n, sigs, root / "new" / f"neff-service-{n}-{r}-{time.time_ns()}", args.batch))
        med = {n: statistics.median(x["compiles_per_s"] for x in v) for n, v in runs.items()}
        out["service"] = {"runs": runs, "compiles_per_s_median": med, "two_vs_one": round(med[2] / med[1], 3)}
        print(f"   service: {json.dumps(out['service'])}", file=sys.stderr, flush=True)  # kept if a later case fails
    if "ceiling" in modes:
        # What two cores give two compile processes that share nothing (no service, no client): one
        # `batch` child on every signature vs two at once on half each, compile seconds only (imports and
        # warm-up left out); the service's two_vs_one is measured against this machine's own ceiling.
        modes.remove("ceiling")
        ratios = []
        for r in range(args.rounds):
            print(f"== ceiling, round {r}", file=sys.stderr, flush=True)
            one = run_child(REPO, "batch", sigs_file, root / "new" / f"neff-ceil1-{time.time_ns()}", args.batch)
            halves = [work / f"half-{i}.jsonl" for i in (0, 1)]
            for i, h in enumerate(halves):
                h.write_text("".join(json.dumps(x) + "\n" for x in sigs[i::2]))
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                two = list(ex.map(lambda h: run_child(REPO, "batch", h, root / "new" / f"neff-ceil2-{time.time_ns()}",
                                                      args.batch), halves))
            t1 = sum(x["s"] for x in one["rows"])
            t2 = max(sum(x["s"] for x in t["rows"]) for t in two)
            ratios.append(round(t1 / t2, 3))
        out["ceiling"] = {"two_processes_vs_one": ratios, "median": statistics.median(ratios),
                          "load": os.getloadavg()}
        print(f"   ceiling: {json.dumps(out['ceiling'])}", file=sys.stderr, flush=True)
    for mode in modes:
        code = Path(args.old) if mode == "old" else REPO
        print(f"== {mode} ({code})", file=sys.stderr, flush=True)
        r = run_child(code, "single" if mode == "old" else mode, sigs_file,
                      root / ("old" if mode == "old" else "new") / f"neff-{mode}-{time.time_ns()}", args.batch)
        for row, k in zip(r["rows"], kinds):
            row["kind"] = k
        out[mode] = {**summarize(r["rows"]), **{k: v for k, v in r.items() if k != "rows"}, "rows": r["rows"]}
        print(f"   {mode}: median {out[mode]['median_s']} s (CPU {out[mode]['median_cpu_s']} s), p95 {out[mode]['p95_s']} s, load {r['load_after'][0]:.2f}",
              file=sys.stderr, flush=True)
    sos = {name: out[mode]["add64_so"] for name, mode in (("new", "single"), ("old", "old")) if mode in out}
    if sos:
        print("== call of a 64-float add's .so", file=sys.stderr, flush=True)
        out["call_add64_so"] = run_call(sos)
    if "old" in out and "single" in out and out["old"]["median_s"]:
        out["single_vs_old_median"] = round(out["single"]["median_s"] / out["old"]["median_s"], 3)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
