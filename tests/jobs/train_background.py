"""A training job for the background-compile tests (a process of its own): a 2-layer MLP, AdamW.

JOB_STEPS (default 3) steps; JOB_WAIT=S: then `wait_for_compiles(S)` and JOB_STEPS more steps (JOB_ROUNDS
times: default 1);
JOB_OUT=path: write JSON there: per-step losses and host runs, stats(), the service's pid.
JOB_SIGTERM_SELF=1: after the steps, once the compile service has its queue, send this process SIGTERM
(it dies without running atexit: mid-compile, as a job killed by its scheduler).
JOB_RAISE=1: after the steps, raise (the job ends on an uncaught exception)."""

import json
import os
import signal
import time

import torch

import neuron_runtime
from neuron_runtime.aten import _runtime


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 8, device="neuron"), torch.randint(0, 4, (8,), device="neuron")
    losses, host_runs = [], []
    waited = None

    def steps(n: int) -> None:
        for _ in range(n):
            before = neuron_runtime.stats()["host_runs"]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            host_runs.append(neuron_runtime.stats()["host_runs"] - before)

    n = int(os.environ.get("JOB_STEPS", "3"))
    steps(n)
    if os.environ.get("JOB_WAIT"):
        for _ in range(int(os.environ.get("JOB_ROUNDS", "1"))):
            waited = neuron_runtime.wait_for_compiles(float(os.environ["JOB_WAIT"]))
            steps(n)
    bg = _runtime.runtime().resolver._background
    client = bg.client if bg is not None else None
    if bg is not None and bg.jobs:  # compiles were asked for: the service's pid is known once it answered
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (client is None or client.service_pid is None):
            time.sleep(0.05)
            client = bg.client
    out = os.environ.get("JOB_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"losses": losses, "host_runs": host_runs, "waited": waited, "stats": neuron_runtime.stats(),
                       "service_pid": getattr(client, "service_pid", None),
                       "keys": sorted(_runtime.runtime().by_digest)}, f)
    if os.environ.get("JOB_SIGTERM_SELF"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (client is None or client.service_pid is None or client.unsent):
            time.sleep(0.05)
            client = bg.client
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get("JOB_RAISE"):
        raise RuntimeError("the job failed after its steps")


main()
