"""Background mode with real AOTInductor executables: the steps that ran on the host and the ones that
ran compiled agree within the aoti self-check's tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Four signatures (mm, tanh, add, sum): a few compiles, not a model's worth.
CODE = """
import json, sys, torch, neuron_runtime
torch.manual_seed(0)
w, b = (torch.randn(16, 16) / 4).to("neuron"), torch.randn(16, device="neuron")
x = torch.randn(8, 16, device="neuron")
outs, host = [], []
for i in range(int(sys.argv[1])):
    before = neuron_runtime.stats()["host_runs"]
    x = torch.tanh(x @ w) + b
    outs.append(x.sum().item())
    host.append(neuron_runtime.stats()["host_runs"] - before)
    if i == 2:
        neuron_runtime.wait_for_compiles(600)
print(json.dumps({"outs": outs, "host": host, "stats": neuron_runtime.stats()}))
"""


def run(tmp: Path, host: str, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER="aoti", TORCH_NEURONX_COMPILE_MODE=mode, TORCH_NEURONX_PREFETCH="0",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp / host / "neff"), TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp / "fleet"),
               TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="2", TORCH_NEURONX_COMPILE_WORKERS="1")
    r = subprocess.run([sys.executable, "-c", CODE, "8"], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.aoti
def test_background_and_sync_agree_on_aoti(tmp_path: Path) -> None:
    sync = run(tmp_path, "a", "sync")  # compiles the four executables into the fleet store
    n = sync["stats"]["compiles"]
    assert n == 4 and sum(sync["host"]) == 0
    bg = run(tmp_path, "b", "background")  # a fresh host: host runs first, then the fleet's executables
    assert bg["host"][0] > 0 and bg["host"][-1] == 0 and bg["stats"]["compiles"] == 0
    assert bg["stats"]["background"]["loaded"] == n
    assert bg["outs"] == pytest.approx(sync["outs"], rel=1e-4, abs=1e-4)
