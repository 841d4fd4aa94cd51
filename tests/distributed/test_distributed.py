"""`torch.distributed` on `neuron` with real processes: torchrun-launched ranks on one host, the `neuron`
c10d backend (gloo over zero-copy host views), DDP, FSDP2, DTensor, DCP, faults and shared compiles.

One torchrun launch runs every API check (tests/jobs/dist_job.py, scenario `api`) and the tests below read
its per-rank results; fault and cold-compile scenarios are launches of their own. Reference tier."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

JOB = Path(__file__).resolve().parents[1] / "jobs" / "dist_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp / "local"), DIST_OUT=str(tmp), OMP_NUM_THREADS="1",
               TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="1", TORCH_NEURONX_COMPILE_WORKERS="1")
    env.update(extra)
    return env


def torchrun(tmp: Path, nproc: int, env: dict[str, str], timeout: float = 300) -> list[dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(JOB)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return read_ranks(tmp, nproc)


def read_ranks(tmp: Path, n: int) -> list[dict[str, Any]]:
    out = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(n)]
    for r in out:
        assert "crash" not in r, r["crash"]
    return out


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two ranks through every check, with the fleet's cache server down the whole time."""
    tmp = tmp_path_factory.mktemp("dist-api")
    dead = f"grpc://127.0.0.1:{free_port()}"
    return torchrun(tmp, 2, job_env(tmp, DIST_SCENARIO="api", TORCH_NEURONX_NEFF_CACHE_DIR=dead,
                                    TORCH_NEURONX_FLEET_TIMEOUT="2"))


def test_init_process_group_without_a_backend_picks_neuron(api: list[dict[str, Any]]) -> None:
    assert [r["group"] for r in api] == ["neuron"] * 2  # the default group's backend for neuron tensors


def test_every_collective_on_neuron_tensors(api: list[dict[str, Any]]) -> None:
    for r in api:
        bad = [k for k, ok in r["collectives"].items() if not ok]
        assert not bad, (r["rank"], bad)
        # every ReduceOp, the list/tensor/coalesced variants, p2p, async, objects, barrier
        assert len(r["collectives"]) == 25


def test_collectives_are_counted_in_stats(api: list[dict[str, Any]]) -> None:
    c = api[0]["stats"]["collectives"]
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "all_gather_into_tensor_coalesced", "barrier"):
        assert c[name]["calls"] >= 1, name
    assert c["all_reduce"]["bytes"] > 100_000  # DDP's gradient buckets went through it


def test_wrong_device_tensors_get_clear_errors(api: list[dict[str, Any]]) -> None:
    """As nccl's groups and CPU tensors: c10d finds no backend for the tensor's device in the group."""
    e = api[0]["errors"]
    assert e["cpu_through_neuron"] == "RuntimeError: No backend type associated with device type cpu"
    assert e["neuron_through_gloo"] == "RuntimeError: No backend type associated with device type neuron"
    # a neuron backend handed a tensor of another device (a mixed list: c10d picks by the first tensor)
    assert e["mixed_devices"].startswith("ValueError: all_gather: expected neuron tensors, got a tensor on cpu")


def test_ddp_losses_equal_one_process_on_the_global_batch(api: list[dict[str, Any]]) -> None:
    for r in api:
        d = r["ddp"]
        assert d["buckets"] >= 2
        assert d["device_ids"] == [0]  # device_ids=[LOCAL_RANK]: each process's core is neuron:0
        assert "each process owns neuron:0" in d["bad_device_ids"]
        assert len(d["got"]) == len(d["ref"]) == 4
        assert max(abs(a - b) for a, b in zip(d["got"], d["ref"])) <= 1e-6, d


def test_ddp_no_sync_and_unused_parameters(api: list[dict[str, Any]]) -> None:
    for r in api:
        assert r["no_sync"]["all_reduces_inside"] == 0
        assert r["no_sync"]["max_grad_diff"] <= 1e-6
        assert r["find_unused"]["max_grad_diff"] <= 1e-6
        assert r["find_unused"]["unused_grad_is_none"] is True


def test_ddp_comm_hooks(api: list[dict[str, Any]]) -> None:
    for r in api:
        assert r["comm_hooks"]["allreduce"] <= 1e-6
        assert 0 < r["comm_hooks"]["fp16"] <= 1e-3, r["comm_hooks"]  # gradients travelled as float16


def test_fsdp2_losses_equal_one_process(api: list[dict[str, Any]]) -> None:
    for r in api:
        f = r["fsdp2"]
        assert f["param_type"] == "DTensor" and f["shard_device"] == "neuron" and f["shard_rows"] == 64
        assert max(abs(a - b) for a, b in zip(f["got"], f["ref"])) <= 1e-6, f


def test_dtensor_ops_on_neuron_shards(api: list[dict[str, Any]]) -> None:
    for r in api:
        d = r["dtensor"]
        assert d == {"local_device": "neuron", "local_shape": [4, 6], "matmul_ok": True, "redistribute_ok": True}


def test_tensor_parallel_linears_match_one_process(api: list[dict[str, Any]]) -> None:
    for r in api:
        t = r["tp"]
        assert t["weight_shard"] == [16, 16]  # the column-wise Linear's 32 rows, half on each rank
        assert t["out_diff"] <= 1e-5 and t["grad_diff"] <= 1e-5, t


def test_dcp_save_and_load_of_a_sharded_model(api: list[dict[str, Any]]) -> None:
    d = api[0]["dcp"]
    assert d["equal"] is True and d["keys"] == 6
    assert any(f.endswith(".distcp") for f in d["files"]) and ".metadata" in d["files"]


def test_mismatched_shapes_fail_within_the_timeout(api: list[dict[str, Any]]) -> None:
    for r in api:
        m = r["mismatch"]
        assert r["same_shapes_ok"] is True
        # PyTorch's desync check (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the neuron backend as it wraps nccl's)
        assert m["error"].startswith("RuntimeError: Detected mismatch between collectives on ranks"), m
        assert "OpType=ALLREDUCE" in m["error"] and "device=neuron" in m["error"], m
        assert m["s"] < 5 + 10, m


def test_training_goes_on_with_the_cache_server_down(api: list[dict[str, Any]]) -> None:
    for r in api:
        assert r["stats"]["fleet_errors"] > 0  # every fleet call failed ...
        assert r["stats"]["compiles"] + r["stats"]["hits"]["local"] > 0  # ... and the local tier served


def _rank_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def test_a_killed_or_hung_rank_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    """Plain processes, not torchrun (whose agent would tear the survivors down itself)."""
    timeout = 5
    procs = {}
    for scenario in ("kill", "hang"):
        out = tmp_path / scenario
        out.mkdir()
        env = job_env(out, DIST_SCENARIO=scenario, DIST_TIMEOUT=str(timeout))
        port = free_port()
        procs[scenario] = [subprocess.Popen([sys.executable, str(JOB)], env=_rank_env(env, r, 2, port),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                           for r in range(2)]
    try:
        for scenario, (p0, p1) in procs.items():
            _, err = p0.communicate(timeout=180)
            assert p0.returncode == 0, err[-3000:]
            r0 = json.loads((tmp_path / scenario / "rank0.json").read_text())
            assert "crash" not in r0, r0["crash"]
            assert "all_reduce" in r0["error"] and "rank 0" in r0["error"], r0["error"]
            assert r0["s"] is not None and r0["s"] < timeout + 15, r0
            if scenario == "kill":
                p1.wait(timeout=30)
                assert p1.returncode == -9
            else:
                assert r0["s"] >= timeout - 1  # it waited for the peer as long as the timeout said
    finally:
        for ps in procs.values():
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@pytest.mark.parametrize(("mode", "hosts"), [("sync", 2), ("background", 1)])
def test_cold_ranks_compile_each_key_once(tmp_path: Path, mode: str, hosts: int) -> None:
    """4 ranks on cold hosts (empty local tiers) and an empty fleet store: the job's compiles, summed over
    every rank, equal its unique keys. sync: 2 simulated hosts × 2 ranks (the per-host single-flight on
    each host's local tier, the fleet store's lease between hosts); background: 4 ranks on one host (its
    one compile service)."""
    env = job_env(tmp_path, DIST_SCENARIO="cold", TORCH_NEURONX_COMPILE_MODE=mode, DIST_HOSTS=str(hosts),
                  TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "fleet"))
    ranks = torchrun(tmp_path, 4, env)
    keys = [set(r["keys"]) for r in ranks]
    assert all(k == keys[0] for k in keys) and len(keys[0]) > 10  # shape classes share some
    assert all(r["waited"] is True for r in ranks)
    compiles = sum(r["stats"]["compiles"] for r in ranks)
    assert compiles == len(keys[0]), [r["stats"]["compiles"] for r in ranks]
    fleet = [p for p in (tmp_path / "fleet").rglob("*") if p.is_file() and not p.name.endswith(".lease")]
    assert len(fleet) >= len(keys[0])
    assert len({r["loss"] for r in ranks}) == 1
    if hosts > 1:  # every host read what the other compiled from the fleet store
        assert sum(r["stats"]["hits"]["fleet"] for r in ranks) > 0, [r["stats"]["hits"] for r in ranks]
    if mode == "background":
        assert sum(r["stats"]["host_runs"] for r in ranks) > 0  # the first steps did not wait for compiles
