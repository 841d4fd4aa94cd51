"""End to end with the real runtime: a training job on the `neuron` device uses a grpc:// fleet cache; the
server is SIGKILLed mid-job and the job still finishes; a second "host" then compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.server.conftest import ServerProc

pytestmark = pytest.mark.timeout(240)

JOB = r"""
import json, os, sys, time
import torch
import neuron_runtime

torch.manual_seed(0)
m = torch.nn.Linear(4, 2).to("neuron")
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(4):
    # Another rank each step: new shape classes (a new batch size alone would reuse the generic
    # executables), so new signatures and fleet traffic after the server died.
    x = torch.randn(*([2] * step), 4 + step, 4).to("neuron")
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, flush=True)
    if step == 1 and os.environ.get("WAIT_FILE"):
        deadline = time.time() + 60
        while not os.path.exists(os.environ["WAIT_FILE"]) and time.time() < deadline:
            time.sleep(0.05)
print("STATS " + json.dumps(neuron_runtime.stats()), flush=True)
"""


def run_job(url: str, local: Path, wait_file: Path | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "TORCH_NEURONX_COMPILER": "reference", "TORCH_NEURONX_NEFF_CACHE_DIR": url,
           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(local), "TORCH_NEURONX_FLEET_TIMEOUT": "2",
           "PYTHONPATH": str(REPO)}
    if wait_file:
        env["WAIT_FILE"] = str(wait_file)
    return subprocess.Popen([sys.executable, "-c", JOB], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)


def stats_of(out: str) -> dict[str, object]:
    line = next(x for x in out.splitlines() if x.startswith("STATS "))
    return json.loads(line[len("STATS "):])  # type: ignore[no-any-return]


def test_job_finishes_when_the_server_dies(server_factory: type[ServerProc], tmp_path: Path) -> None:
    s = server_factory().start()
    go = tmp_path / "go"
    job = run_job(f"grpc://{s.address}", tmp_path / "local-a", go)
    assert job.stdout is not None
    for line in job.stdout:
        if line.startswith("step 1"):
            break
    else:
        pytest.fail("job ended early: " + (job.stderr.read() if job.stderr else ""))
    stored = s.client().stats()["entries"]
    assert stored > 0  # the first steps' executables reached the fleet store
    s.kill()
    go.touch()
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err[-3000:]
    st = stats_of(out)
    assert st["fleet_errors"] > 0  # it noticed, counted, and carried on  # type: ignore[operator]

    # A second host (fresh local cache) after a restart: everything the first one stored is a fleet hit.
    s2 = server_factory(s.storage, port=s.port).start()
    job2 = run_job(f"grpc://{s2.address}", tmp_path / "local-b")
    out2, err2 = job2.communicate(timeout=180)
    assert job2.returncode == 0, err2[-3000:]
    st2 = stats_of(out2)
    assert st2["hits"]["fleet"] >= stored  # type: ignore[index]
    assert st2["compiles"] < st["compiles"]  # type: ignore[operator]
