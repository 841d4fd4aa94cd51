"""Cold start with background compiles vs blocking ones, in fresh processes, side by side (JSON on stdout).

    python benchmarks/cold_start.py [--tier aoti|reference] [--steps N] [--only NAME,...]

Each case is a new process (`--child`) training `make demo`'s model (or `--variant wide`: a bigger MLP,
a new batch every step) on a fresh local cache *and* fresh Inductor scratch (precompiled headers, TMPDIR),
so every compile is an honest cold one. The aoti tier's shared runtime (what every op links) is the
host's, as `make install` leaves it; `--cold-runtime` gives every case an empty one as well (a host that
never ran `make install`: the first compile builds it). The aoti fingerprint, kept once per torch install, is computed
before the first case. Cases:
  sync_cold        TORCH_NEURONX_COMPILE_MODE=sync: the first step compiles every signature
  bg_cold_w1/_w2   background mode with 1 / 2 compile workers: first step, time until no op runs on the
                   host ("all compiled"), compiles/s
  warm_local       the same job on the warm local tier (the reference for first-step ratios)
  fleet_path/grpc  a fresh host (empty local tier) against a warm fleet store (a shared path; a real gRPC
                   cache server): first step, entries prefetched before the first op, compiles
  four_procs       4 processes of one job on one cold host at once: compiles summed vs unique keys, and
                   each process's slowest step (a step that waited for a compile would take seconds)
  variant_wide     bg_cold_w1 on the wide variant (another model size, a new batch every step, .item())
  llama_new/_old   a Hugging Face LlamaForCausalLM training step (4 layers, hidden 256, vocab 4096,
                   sequence 128), background mode, default workers: time until no op runs on the host
                   and the ops refused, this checkout and `--old DIR` (e.g. a git worktree of main before
                   a change) side by side; llama_small_new/_old: another size (2 layers, hidden 128, GQA)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


# The module holding `runtime()`: today's, then `--old` code's (before issue 38; before the layout of issue 28).
_RUNTIME_MODULES = ("neuron_runtime.aten._runtime", "neuron_runtime.aten._dispatch", "neuron_runtime._dispatch")


def _runtime_module() -> Any:
    for name in _RUNTIME_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {_RUNTIME_MODULES} holds the runtime")


def child(args: argparse.Namespace) -> None:
    t_import = time.perf_counter()
    import torch

    import neuron_runtime
    _runtime = _runtime_module()

    torch.manual_seed(0)
    wide = args.variant == "wide"
    llama = LLAMA.get(args.variant)
    if llama is not None:
        # A Hugging Face LlamaForCausalLM from a config (no download), trained on random tokens.
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg, (batch, seq) = llama
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to("neuron")
        x = torch.randint(0, cfg["vocab_size"], (batch, seq), device="neuron")
        y = x
    else:
        dims = (256, 512, 10) if wide else (32, 64, 10)
        batch = 128 if wide else 64
        model = torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.GELU(),
                                    torch.nn.Linear(dims[1], dims[2])).to("neuron")
        x = torch.randn(batch, dims[0], device="neuron")
        y = torch.randint(0, dims[2], (batch,), device="neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bg = neuron_runtime.stats().get("background", {})
    prefetched_before = bg.get("prefetched", 0)
    times, host, losses = [], [], []
    t0 = time.perf_counter()
    compiled_at = None
    step = 0
    while True:
        if wide:
            x = torch.randn(batch, dims[0], device="neuron")
        before = neuron_runtime.stats()["host_runs"]
        ts = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=y).loss if llama is not None else \
            torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - ts)
        step += 1
        s = neuron_runtime.stats()
        host.append(s["host_runs"] - before)
        if compiled_at is None and host[-1] == 0 and not s.get("background", {}).get("pending"):
            compiled_at = time.perf_counter() - t0
        if compiled_at is not None and step >= args.steps:
            break
        if time.perf_counter() - t0 > args.max_seconds:
            break
    s = neuron_runtime.stats()
    rest = times[1:] or times
    print(json.dumps({
        "first_step_s": round(times[0], 4), "import_to_first_op_s": round(ts - t_import, 3) if step == 1 else None,
        "all_compiled_after_s": None if compiled_at is None else round(compiled_at, 2),
        "steps": step, "steps_with_host_runs": sum(1 for h in host if h), "max_step_s": round(max(times), 4),
        "median_step_ms": round(1000 * sorted(rest)[len(rest) // 2], 3), "compiles": s["compiles"],
        "prefetched_before_first_op": prefetched_before, "background": s.get("background"),
        "hits": s["hits"], "fallback_ops": s["fallback_ops"], "keys": sorted(_runtime.runtime().by_digest),
        "compile_phases": s.get("compile_phases"), "loss_last": losses[-1],
        "load_before": json.loads(os.environ.get("NEURON_BENCH_LOAD_BEFORE", "null")), "load_after": os.getloadavg()}))


# Llama-style decoders (Hugging Face LlamaForCausalLM from a config): (config, (batch, sequence)).
LLAMA: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    # DESIGN.md section 9's model: 4 layers, hidden 256, vocab 4096, sequence 128 (5 M parameters)
    "llama": ({"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256}, (2, 128)),
    # another size: 2 layers, hidden 128, grouped-query attention, sequence 64
    "llama_small": ({"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}, (4, 64)),
}


class Case:
    def __init__(self, root: Path, tier: str, cold_runtime: bool = False) -> None:
        self.root = root
        self.tier = tier
        self.cold_runtime = cold_runtime

    def env(self, local: Path, **extra: str) -> dict[str, str]:
        # The local tier's parent holds Inductor's scratch (precompiled headers): a fresh parent is a cold host.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
        env.update(TORCH_NEURONX_COMPILER=self.tier, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(local / "neff"),
                   TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="5", OMP_NUM_THREADS="1", TMPDIR=str(local / "tmp"))
        if self.cold_runtime:
            env["TORCH_NEURONX_AOTI_RUNTIME_DIR"] = str(local / "aoti-runtime")
        (local / "tmp").mkdir(parents=True, exist_ok=True)
        env.update(extra)
        return env

    def run(self, env: dict[str, str], steps: int, variant: str = "demo", max_seconds: float = 3600,
            code: Path | None = None) -> dict[str, Any]:
        """One child process; `code`: run another checkout's neuron_runtime (its directory first on
        PYTHONPATH), e.g. a `git worktree` of the code before a change, for a side-by-side number."""
        if code is not None:
            env = dict(env, PYTHONPATH=str(code) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
            env.pop("TORCH_NEURONX_AOTI_RUNTIME_DIR", None)  # not a setting of the other checkout
        env = dict(env, NEURON_BENCH_LOAD_BEFORE=json.dumps(os.getloadavg()))
        r = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--variant", variant,
                            "--max-seconds", str(max_seconds)], env=env, stdout=subprocess.PIPE, text=True,
                           timeout=max_seconds + 600, cwd=str(code) if code is not None else None)
        if r.returncode != 0:
            raise RuntimeError(f"child failed ({r.returncode})")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def wait_services_gone(self, timeout: float = 60) -> None:
        """Let a case's compile service idle out before the next case starts (no CPU shared across cases)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["pgrep", "-f", "_service/_server.py"], capture_output=True, text=True).stdout
            if not out.strip():
                return
            time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--old", help="another checkout (e.g. a git worktree of main before a change): the llama "
                   "cases run it side by side with this one")
    p.add_argument("--llama-steps", type=int, default=3, help="steps the llama cases train once all compiled")
    p.add_argument("--cold-runtime", action="store_true",
                   help="an empty aoti shared runtime per case too (a host that never ran make install)")
    p.add_argument("--max-seconds", type=float, default=3600, help="give up on a case after this long")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="demo", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    only = set(filter(None, args.only.split(",")))
    want = (lambda name: not only or name in only)  # noqa: E731
    root = Path(tempfile.mkdtemp(prefix="neuron-cold-start-"))
    case = Case(root, args.tier, args.cold_runtime)
    out: dict[str, Any] = {"tier": args.tier, "steps": args.steps, "cpus": os.cpu_count(), "cold_runtime": args.cold_runtime,
                           "load_before": os.getloadavg()}
    # The aoti fingerprint is computed once per torch install (Inductor's import): not part of any case.
    for code in [None, *([args.old] if args.old else [])]:
        env = case.env(root / "fingerprint")
        if code:
            env["PYTHONPATH"] = code
        subprocess.run([sys.executable, "-c", f"import importlib\nfor m in {_RUNTIME_MODULES!r}:\n"
                        " try:\n  r = importlib.import_module(m)\n except ImportError:\n  continue\n"
                        " r.runtime()\n break"],
                       env=env, check=True, cwd=code)
    try:
        keys: list[str] = []
        if want("sync_cold"):
            print("== sync_cold", file=sys.stderr, flush=True)
            out["sync_cold"] = r = case.run(case.env(root / "sync", TORCH_NEURONX_COMPILE_MODE="sync"), args.steps)
            keys = r.pop("keys")
        warm_dir = None
        for w in (1, 2):
            name = f"bg_cold_w{w}"
            if want(name):
                print(f"== {name}", file=sys.stderr, flush=True)
                d = root / name
                r = case.run(case.env(d, TORCH_NEURONX_COMPILE_WORKERS=str(w), TORCH_NEURONX_JOB="cold-start"),
                             args.steps)
                keys = r.pop("keys")
                if r["all_compiled_after_s"]:
                    r["compiles_per_s"] = round(r["compiles"] / r["all_compiled_after_s"], 4)
                out[name] = r
                warm_dir = warm_dir or d
                case.wait_services_gone()
        if warm_dir is not None and want("warm_local"):
            print("== warm_local", file=sys.stderr, flush=True)
            r = case.run(case.env(warm_dir, TORCH_NEURONX_JOB="cold-start"), args.steps)
            r.pop("keys")
            out["warm_local"] = r
        if warm_dir is not None:
            for kind in ("path", "grpc"):
                if not want(f"fleet_{kind}"):
                    continue
                print(f"== fleet_{kind}", file=sys.stderr, flush=True)
                server = None
                if kind == "path":
                    url = str(root / "fleet-path")
                else:
                    port = _free_port()
                    server = subprocess.Popen([sys.executable, "-m", "cache_server", "--listen", f"127.0.0.1:{port}",
                                               "--storage", str(root / "fleet-grpc")], stderr=subprocess.DEVNULL)
                    url = f"grpc://127.0.0.1:{port}"
                    time.sleep(3)
                try:
                    # Warm the store: the warm host's run writes the job's manifest there; `neuron-cache
                    # compile` pushes the entries it has locally.
                    manifest = root / f"record-{kind}.jsonl"
                    case.run(case.env(warm_dir, TORCH_NEURONX_NEFF_CACHE_DIR=url, TORCH_NEURONX_JOB="cold-start",
                                      TORCH_NEURONX_RECORD_FILE=str(manifest)), 2)
                    subprocess.run([sys.executable, "-m", "neuron_runtime.cli", "compile", str(manifest), "--tier",
                                    args.tier, "--local-dir", str(warm_dir / "neff"), "--fleet", url, "--json"],
                                   env=case.env(warm_dir), check=True, stdout=subprocess.DEVNULL)
                    r = case.run(case.env(root / f"fresh-{kind}", TORCH_NEURONX_NEFF_CACHE_DIR=url,
                                          TORCH_NEURONX_JOB="cold-start"), args.steps)
                    r.pop("keys")
                    out[f"fleet_{kind}"] = r
                finally:
                    if server is not None:
                        server.terminate()
                        server.wait(30)
                case.wait_services_gone()
        if want("four_procs"):
            print("== four_procs", file=sys.stderr, flush=True)
            d = root / "four"
            env = case.env(d, TORCH_NEURONX_JOB="cold-start-4")
            procs = [subprocess.Popen([sys.executable, __file__, "--child", "--steps", str(args.steps)], env=env,
                                      stdout=subprocess.PIPE, text=True) for _ in range(4)]
            results = [json.loads(pr.communicate()[0].strip().splitlines()[-1]) for pr in procs]
            unique = set().union(*(r.pop("keys") for r in results))
            out["four_procs"] = {"compiles_sum": sum(r["compiles"] for r in results), "unique_keys": len(unique),
                                 "first_step_s": [r["first_step_s"] for r in results],
                                 "max_step_s": [r["max_step_s"] for r in results],
                                 "all_compiled_after_s": [r["all_compiled_after_s"] for r in results]}
            case.wait_services_gone()
        # A Llama-style training step (and another size), cold, this code and --old side by side.
        for variant in ("llama", "llama_small"):
            for who, code in (("old", args.old), ("new", None)):
                name = f"{variant}_{who}"
                if not want(name) or (who == "old" and not args.old):
                    continue
                print(f"== {name}", file=sys.stderr, flush=True)
                r = case.run(case.env(root / name, TORCH_NEURONX_JOB=name), args.llama_steps, variant=variant,
                             max_seconds=args.max_seconds, code=Path(code) if code else None)
                r.pop("keys")
                out[name] = r
                case.wait_services_gone()
            old_r, new_r = out.get(f"{variant}_old"), out.get(f"{variant}_new")
            if old_r and new_r and old_r["all_compiled_after_s"] and new_r["all_compiled_after_s"]:
                out.setdefault("targets_llama", {})[variant] = {
                    "all_compiled_new_vs_old": round(new_r["all_compiled_after_s"] / old_r["all_compiled_after_s"], 3),
                    "refused_new": new_r["fallback_ops"], "refused_old": old_r["fallback_ops"]}
        if want("variant_wide"):
            print("== variant_wide", file=sys.stderr, flush=True)
            env = case.env(root / "wide", TORCH_NEURONX_COMPILE_WORKERS="1")
            r = case.run(env, args.steps, variant="wide")
            r.pop("keys")
            out["variant_wide"] = r
            case.wait_services_gone()
            r = case.run(env, args.steps, variant="wide")
            r.pop("keys")
            out["variant_wide_warm"] = r
        # The targets, as ratios (None where a case did not run).
        sync_first = out.get("sync_cold", {}).get("first_step_s")
        warm_first = out.get("warm_local", {}).get("first_step_s")
        ratios: dict[str, Any] = {}
        for name in ("bg_cold_w1", "bg_cold_w2", "variant_wide"):
            r = out.get(name)
            warm = out.get("variant_wide_warm" if name == "variant_wide" else "warm_local", {}).get("first_step_s")
            if r:
                ratios[name] = {"first_step_s": r["first_step_s"],
                                "first_vs_warm": round(r["first_step_s"] / warm, 2) if warm else None,
                                "all_compiled_vs_sync_first": round(r["all_compiled_after_s"] / sync_first, 2)
                                if sync_first and r["all_compiled_after_s"] else None}
        for name in ("fleet_path", "fleet_grpc"):
            r = out.get(name)
            if r and warm_first:
                ratios[name] = {"first_vs_warm": round(r["first_step_s"] / warm_first, 2), "compiles": r["compiles"],
                                "prefetched_before_first_op": r["prefetched_before_first_op"]}
        out["targets"] = ratios
        out["keys"] = len(keys)
        out["load_after"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
