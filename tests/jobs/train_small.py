"""A tiny training job the tests run as a process of its own (a CI warm-up, a production host, "another
host"): a 2-layer MLP, AdamW, JOB_STEPS steps (default 3) on `neuron`.

JOB_OUT=path: write {"loss", "keys"} (the loss and the executables' cache keys) there as JSON.
CRASH_AFTER_FORWARD=1: raise after the first step (a warm-up script failing midway)."""

import json
import os

import torch

from neuron_runtime.aten import _runtime

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(8, 8, device="neuron"), torch.randint(0, 4, (8,), device="neuron")
for step in range(int(os.environ.get("JOB_STEPS", "3"))):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if os.environ.get("CRASH_AFTER_FORWARD") and step == 0:
        raise RuntimeError("warm-up script crashed midway")
print("loss", loss.item())
out = os.environ.get("JOB_OUT")
if out:
    with open(out, "w") as f:
        json.dump({"loss": loss.item(), "keys": sorted(_runtime.runtime().by_digest)}, f)
