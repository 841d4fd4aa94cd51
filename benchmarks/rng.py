"""Random numbers on `neuron` against CPU (issue 44), JSON on stdout.

Each (tier, compile mode) runs in its own process with its own empty cache, doing:
  1. after `torch.manual_seed(3)`: `F.dropout(x, 0.5)` three times, then `torch.rand(3)`, on CPU and on
     neuron: which calls equal CPU's (`dropout_calls_equal`);
  2. the issue's CNN (Conv2d 3->8, BatchNorm2d, ReLU, MaxPool2d, Flatten, Dropout(0.2), Linear; SGD with
     momentum; batch sizes 4, 6, 8, 4; the same seed before each forward) on CPU and on neuron: the losses
     and their largest relative difference (`cnn_max_rel_diff`, the target is <= 1e-5);
  3. (background mode) 1 and 2 again once the compiles landed (`..._after_compiles`: executables run);
     (sync mode) the same CNN trained one step at each new batch size 8, 12, 16, 24, 32: compiles per batch
     size, and the ops that ran on the host because the compiler refused them (`fallback_ops`);
  4. the count of aten ops that run on the host by design because they draw random numbers.
With `--inductor`, also whether CPU Inductor (`torch.compile` on CPU) reproduces eager's dropout masks, by
default and with `torch._inductor.config.fallback_random = True`, and whether `torch.compile(backend=
"neuron")` does.

    python benchmarks/rng.py [--tier aoti|reference] [--modes sync,background] [--inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import copy, json, sys, torch, torch.nn.functional as F
import neuron_runtime
from neuron_runtime.signatures import classify, cpu_ops
from neuron_runtime.signatures._ops import RANDOM

def dropout_calls(dev):
    torch.manual_seed(3)
    x = torch.ones(64, 64, device=dev)
    outs = [F.dropout(x, 0.5).cpu() for _ in range(3)]
    return outs + [torch.rand(3, device=dev).cpu()]

def cnn(device, batches, data_seed=0):
    torch.manual_seed(data_seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8 * 4 * 4, 10))
    data = [(torch.randn(b, 3, 8, 8), torch.randint(0, 10, (b,))) for b in batches]
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, compiles = [], []
    for i, (x, y) in enumerate(data):
        before = neuron_runtime.stats()["compiles"]
        torch.manual_seed(100 + i)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
        compiles.append(neuron_runtime.stats()["compiles"] - before)
    return losses, compiles

out = {}
c, n = dropout_calls("cpu"), dropout_calls("neuron")
out["dropout_calls_equal"] = [bool(torch.equal(a, b)) for a, b in zip(c, n)]
want, _ = cnn("cpu", [4, 6, 8, 4])
got, _ = cnn("neuron", [4, 6, 8, 4])
out["cnn_losses_cpu"], out["cnn_losses_neuron"] = want, got
out["cnn_max_rel_diff"] = max(abs(g - w) / abs(w) for w, g in zip(want, got))
if sys.argv[1] == "background":  # the same again once the compiles landed: executables run this time
    neuron_runtime.wait_for_compiles(1800)
    before = neuron_runtime.stats()["executions"]
    got, _ = cnn("neuron", [4, 6, 8, 4])
    out["cnn_after_compiles_max_rel_diff"] = max(abs(g - w) / abs(w) for w, g in zip(want, got))
    out["cnn_after_compiles_executions"] = neuron_runtime.stats()["executions"] - before
    n = dropout_calls("neuron")
    out["dropout_calls_equal_after_compiles"] = [bool(torch.equal(a, b)) for a, b in zip(c, n)]
if sys.argv[1] == "sync":
    _, per_batch = cnn("neuron", [8, 12, 16, 24, 32], data_seed=1)
    out["compiles_per_new_batch_size"] = dict(zip(["8", "12", "16", "24", "32"], per_batch))
s = neuron_runtime.stats()
out["fallback_ops"] = s["fallback_ops"]
out["stats"] = {k: s[k] for k in ("compiles", "fallbacks", "host_ops", "host_runs", "executions")}
out["random_host_ops_by_design"] = sum(1 for q in cpu_ops() if classify(q).reason == RANDOM)
if sys.argv[2] == "inductor":
    def masks(fn, dev):
        torch.manual_seed(3)
        x = torch.ones(64, 64, device=dev)
        return [fn(x).cpu() for _ in range(2)]
    eager = masks(lambda x: F.dropout(x, 0.5), "cpu")
    f = lambda x: F.dropout(x, 0.5) * 2
    eager2 = masks(f, "cpu")
    import torch._inductor.config as ic
    res = {}
    res["inductor_cpu_default"] = all(torch.equal(a, b) for a, b in zip(eager2, masks(torch.compile(f), "cpu")))
    torch._dynamo.reset()
    with ic.patch(fallback_random=True):
        res["inductor_cpu_fallback_random"] = all(torch.equal(a, b) for a, b in
                                                  zip(eager2, masks(torch.compile(f), "cpu")))
    torch._dynamo.reset()
    res["neuron_backend"] = all(torch.equal(a, b) for a, b in
                                zip(eager2, masks(torch.compile(f, backend="neuron"), "neuron")))
    out["compiled_equals_eager"] = res
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--modes", default="sync,background")
    p.add_argument("--inductor", action="store_true")
    a = p.parse_args(argv)
    results: dict[str, object] = {"tier": a.tier, "load": os.getloadavg()}
    for i, mode in enumerate(a.modes.split(",")):
        env = {**os.environ, "TORCH_NEURONX_COMPILER": a.tier, "TORCH_NEURONX_COMPILE_MODE": mode,
               "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": tempfile.mkdtemp(prefix="neuron-rng-"),
               "TORCH_NEURONX_PREFETCH": "0", "PYTHONWARNINGS": "ignore"}
        extra = "inductor" if a.inductor and i == 0 else "-"
        proc = subprocess.run([sys.executable, "-c", CHILD, mode, extra], env=env, capture_output=True, text=True,
                              timeout=3600)
        if proc.returncode != 0:
            results[mode] = {"error": proc.stderr[-2000:]}
            continue
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
