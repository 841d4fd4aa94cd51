"""Hit-path cost of the dispatch: native CPU eager vs `neuron`, side by side in one run (JSON on stdout).

Method: OMP_NUM_THREADS=1 (set below before torch loads), warm every signature first, then interleave
A/B rounds of N calls each and report medians of µs per op and their ratio. The compiler tier is
TORCH_NEURONX_COMPILER (default here: reference, the pure hit-path cost); run with =aoti for compiled
executables.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_NEURONX_COMPILER", "reference")

import torch  # noqa: E402

import neuron_runtime  # noqa: E402
from _ab import interleaved_medians  # noqa: E402

torch.set_num_threads(1)


def _time(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def compare(native, neuron, n: int, rounds: int) -> dict[str, float]:
    native(), neuron(), native(), neuron()  # warm (compiles happen here, or are queued in background mode)
    neuron_runtime.wait_for_compiles()  # background mode: the executables are in memory ...
    neuron(), neuron()  # ... and installed for the hit path (measured below), never the host path
    na, nb = interleaved_medians(lambda: _time(native, n), lambda: _time(neuron, n), rounds)
    return {"native_us": round(na, 2), "neuron_us": round(nb, 2), "ratio": round(nb / na, 2)}


def mlp_step(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    return step


def main() -> int:
    quick = "--quick" in sys.argv
    rounds = 3 if quick else 7
    a64, b64 = torch.randn(64), torch.randn(64)
    na64, nb64 = a64.to("neuron"), b64.to("neuron")
    m1, m2 = torch.randn(128, 128), torch.randn(128, 128)
    nm1, nm2 = m1.to("neuron"), m2.to("neuron")
    out = {
        "tier": neuron_runtime.stats()["compiler"],
        "threads": torch.get_num_threads(),
        "add_64": compare(lambda: torch.add(a64, b64), lambda: torch.add(na64, nb64), 2000 if quick else 20000, rounds),
        "mm_128": compare(lambda: torch.mm(m1, m2), lambda: torch.mm(nm1, nm2), 200 if quick else 2000, rounds),
        "mlp_train_step": compare(mlp_step("cpu"), mlp_step("neuron"), 20 if quick else 200, rounds),
    }
    s = neuron_runtime.stats()
    out["compiles"] = s["compiles"]
    out["fallback_ops"] = s["fallback_ops"]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
