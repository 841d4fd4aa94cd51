"""`torchrun --nproc-per-node 2` with Trainer trains data-parallel on `neuron` with the losses of one
process on the global batch. Needs the `neuron` process-group backend ("torch.distributed on neuron");
until it is registered this test is skipped, and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from hf_helpers import run_trainer

HERE = Path(__file__).parent


def _neuron_backend() -> bool:
    return dist.is_available() and dist.is_backend_available("neuron")


@pytest.mark.skipif(not _neuron_backend(), reason="no `neuron` process-group backend registered yet")
def test_torchrun_two_ranks_train_with_the_losses_of_the_global_batch(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TORCH_NEURONX_COMPILE_MODE="sync", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(port),
                        str(HERE / "ddp_train.py"), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got["distributed_type"] == "DistributedType.MULTI_NEURON"
    # One process, per-device batch 4 = the two ranks' batches of 2 (same sampler seed), same model.
    one, _ = run_trainer(tmp_path / "one", use_cpu=False, dropout=0.0, save_strategy="no")
    assert got["losses"] == pytest.approx(one, rel=1e-5, abs=1e-5)

