"""A job that trains a small MLP with torch.compile(backend="neuron") for two steps (warm tests)."""

import json
import os

import torch

import neuron_runtime

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).to("neuron")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model, backend="neuron")
x = torch.randn(5, 8).to("neuron")
for _ in range(2):
    opt.zero_grad()
    loss = compiled(x).pow(2).mean()
    loss.backward()
    opt.step()
print("loss", loss.item())
out = os.environ.get("COMPILE_SMALL_OUT")
if out:
    with open(out, "w") as f:
        json.dump(neuron_runtime.stats()["graphs"], f)
